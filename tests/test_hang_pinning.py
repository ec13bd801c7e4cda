"""A hang is pinned on a GPU only when the stalled rank's main thread is inside a CUDA call and NVML agrees
(issue 25, part 4); a rank stalled in a slow write or on a starved CPU is a tool timeout, which drains nothing.
The judgement from the watchdog's answers; the native reading from real processes (one blocked reading a pipe,
one stuck in a close on a FUSE mount that never answers: a slow network file system's stand-in)."""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stackproof.judge import hang, policy
from stackproof.measure import stall

FUSE_HOLD = Path(__file__).parent / "stuck_rank" / "fuse_hold.py"
GPU = {"index": 3, "uuid": "GPU-8c1e"}


def answer(**said):
    return {"waiting": False, "where": "test_02_per_gpu.py:180 in test_hbm_bandwidth", "native": "R running",
            "gpu": GPU, "in_cuda": "", "gpu_util": 0, "gpu_error": "", **said}


@pytest.mark.parametrize(("said", "check", "action"), [
    ({"in_cuda": "torch.cuda __init__.py:985 in synchronize", "gpu_util": 100}, "GPU hang", policy.DRAIN),
    ({"in_cuda": "ioctl /dev/nvidia3", "gpu_util": None, "gpu_error": "no answer"}, "GPU hang", policy.DRAIN),
    ({"in_cuda": "ioctl /dev/nvidia3", "gpu_util": None, "gpu_error": "NVML error GPU is lost"}, "GPU hang",
     policy.DRAIN),
    # In a CUDA call, but NVML sees the GPU idle: the wait is elsewhere (a host callback, the CPU).
    ({"in_cuda": "torch.cuda __init__.py:985 in synchronize", "gpu_util": 0}, "check timed out", policy.ALERT),
    # The GPU busy (someone's kernel), the rank in a slow write: not the GPU's hang.
    ({"native": "D syscall 1 (fd /mnt/nfs/ckpt.pt)", "gpu_util": 100}, "check timed out", policy.ALERT),
    ({"native": "R running"}, "check timed out", policy.ALERT),  # a starved CPU / Python busy
])
def test_a_stall_is_a_gpu_hang_only_inside_cuda_with_nvml_agreeing(said, check, action):
    finding = hang.hang_finding("per_gpu::hbm_bandwidth", 3, answer(**said), 310)
    assert (finding.check, policy.of(finding), finding.gpu_index) == (check, action, 3)
    assert "rank 3 at test_02_per_gpu.py:180" in finding.found


def test_a_cpu_rank_stalled_is_never_a_gpu_hang():
    finding = hang.hang_finding("x", 0, answer(gpu=None, in_cuda="ioctl /dev/nvidia0", gpu_util=100), 10)
    assert finding.category == "tool-error" and finding.gpu_index is None


def test_the_driver_ioctl_is_told_from_other_syscalls():
    ioctl = str(stall.IOCTL)
    assert stall.native_of("S", [ioctl, "0x5", "0xc0"], lambda fd: "/dev/nvidia0").in_gpu_driver
    assert stall.native_of("S", [ioctl, "0x5"], lambda fd: "/dev/nvidiactl").syscall == "ioctl /dev/nvidiactl"
    assert not stall.native_of("S", [ioctl, "0x5"], lambda fd: "/dev/pts/0").in_gpu_driver
    assert stall.native_of("R", ["running"], None) == stall.Native("R", "running", False)


def test_a_process_blocked_reading_a_pipe_is_not_in_the_driver():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        time.sleep(0.2)
        seen = stall.native(proc.pid, f"/proc/{proc.pid}")
        assert (seen.state, seen.in_gpu_driver) == ("S", False) and "pipe:" in seen.syscall
    finally:
        proc.kill()
        proc.wait()


def test_a_rank_stuck_in_a_slow_file_system_is_a_tool_timeout(tmp_path):
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    server = subprocess.Popen([sys.executable, str(FUSE_HOLD), str(mountpoint)], stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([server.stdout], [], [], 10)
    if not ready or server.stdout.readline().strip() != "ready":
        server.kill()
        server.wait()
        pytest.skip("no FUSE mount here: needs /dev/fuse and CAP_SYS_ADMIN")
    rank = subprocess.Popen([sys.executable, "-c", f"f = open({str(mountpoint / 'held')!r}); print('open', "
                             "flush=True); f.close()"], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline().strip() == "open"
        time.sleep(0.3)
        seen = stall.native(rank.pid, f"/proc/{rank.pid}")
        # Waiting for the file system's answer to the close (FLUSH), as a write to a dead NFS server waits.
        assert seen.state in ("S", "D") and seen.syscall.startswith("syscall 3") and not seen.in_gpu_driver, seen
        said = answer(native=f"{seen.state} {seen.syscall}", gpu_util=100)
        assert hang.hang_finding("ddp_resnet::checkpoint", 0, said, 310).category == "tool-error"
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=10)
        rank.wait(timeout=10)
