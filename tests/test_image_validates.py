"""The suite inside the built image, on this machine's CPU: what `docker run IMAGE` does without a GPU."""

import json
import subprocess

import pytest
from image_support import IMAGE, VALIDATION_TAG

from stackproof.errors import Exit

EXIT_OK, EXIT_NO_GPU = Exit.OK, Exit.NO_GPU

QUICK = ["--max-check-bytes", "64K", "--sweep-max", "256K"]


def docker_run(reports, *args, flags=("--ipc=host",)):
    reports.mkdir(mode=0o777, exist_ok=True)
    reports.chmod(0o777)  # the image runs as uid 1000
    cmd = ["docker", "run", "--rm", *flags, "-v", f"{reports}:/reports", VALIDATION_TAG, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    report = json.loads((reports / "report.json").read_text()) if (reports / "report.json").exists() else None
    return proc, report


@pytest.mark.docker
def test_the_suite_passes_inside_the_image_on_two_cpu_ranks(built, tmp_path):
    proc, report = docker_run(tmp_path / "reports", "validate", "--expect-gpus", "0", *QUICK)
    assert proc.returncode == EXIT_OK, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert report["verdict"] == "OK" and report["world"]["size"] == 2
    passed = {c["name"] for c in report["checks"] if c["outcome"] == "passed"}
    # Inside the image the pins are compared with /etc/stackproof/expected.json and the lock: they must run.
    assert {"pins::versions_match_the_promise", "pins::installed_packages_match_the_lock",
            "ddp_resnet::gradients_are_identical_across_ranks", "compile::torch_compile_matches_eager"} <= passed
    expected = report["context"]["expected"]
    assert expected["torch"] == IMAGE.torch and expected["nccl"] == IMAGE.nccl
    assert "/etc/stackproof/expected.json" in expected["source"]
    assert "# Verdict: OK" in proc.stdout
    assert (tmp_path / "reports" / "junit.xml").exists()


@pytest.mark.docker
def test_the_image_without_a_gpu_says_so_with_its_exit_code(built, tmp_path):
    proc, report = docker_run(tmp_path / "reports")
    assert proc.returncode == EXIT_NO_GPU, proc.stdout + proc.stderr
    assert "no GPU visible, but GPUs were expected (NVIDIA_VISIBLE_DEVICES=all)" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
    assert report["exit_code"] == EXIT_NO_GPU


@pytest.mark.docker
def test_a_small_dev_shm_is_caught_with_the_flag_that_fixes_it(built, tmp_path):
    proc, report = docker_run(tmp_path / "reports", "validate", "--expect-gpus", "0", "-k", "shm",
                              flags=["--shm-size=64m"])  # Docker's default size, spelled out
    assert proc.returncode == 1, proc.stdout[-3000:]
    message = next(c for c in report["checks"] if c["name"] == "host::dev_shm_is_large_enough")
    assert "/dev/shm size: expected >= " in message["message"] and "found 64 MiB" in message["message"]
    assert "--ipc=host" in message["hint"]
