"""Why a node that should show GPUs shows none to CUDA: the readings that tell a broken node (the GPUs are there
and CUDA cannot reach them) from a broken setup (a CPU-only torch, a container without the NVIDIA runtime, a
driver whose library does not match it after an upgrade). NVML's own start-up error, the CUDA driver API's
(cuInit through ctypes: no torch import, no context), torch's build (read from its version.py, not imported) and
the GPUs' device files. Each call that can hang in a broken driver runs with a deadline. judge/reach.py decides."""

from __future__ import annotations

import ast
import glob
import importlib.util
import json
import subprocess
import sys
import threading
from pathlib import Path

from stackproof import environment
from stackproof.judge.readings import Reach

PROBE_DEADLINE_S = 10.0  # cuInit / nvmlInit on a healthy node: well under a second
NO_ANSWER = -1  # the probe did not return within its deadline


def within(seconds: float, call, hung):
    """`call()`, or `hung` when it does not return in `seconds` (its thread is left behind, as a daemon)."""
    answer = [hung]

    def ask() -> None:
        answer[0] = call()

    worker = threading.Thread(target=ask, name="cuda-reach", daemon=True)
    worker.start()
    worker.join(seconds)
    return answer[0]


def nvml_start() -> tuple[int | None, str, int | None]:
    """(NVML's error code at nvmlInit / counting, its words, the GPUs it counts)."""
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed", None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return err.value, str(err), None
    try:
        return None, "", pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as err:
        return err.value, str(err), None
    finally:
        pynvml.nvmlShutdown()


# The driver API asked in a process of its own: CUDA_VISIBLE_DEVICES unset (every GPU the container has), no state
# left in this one, and a deadline that holds even where cuInit hangs in the driver.
CUDA_PROBE = """
import ctypes, json
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError as err:
    print(json.dumps([None, "libcuda.so.1: %s" % err, None])); raise SystemExit
result, name, count = cuda.cuInit(0), ctypes.c_char_p(), ctypes.c_int(0)
named = cuda.cuGetErrorName(result, ctypes.byref(name)) == 0 and name.value
words = name.value.decode() if named else "CUresult %d" % result
if result == 0:
    cuda.cuDeviceGetCount(ctypes.byref(count))
print(json.dumps([result, words, count.value if result == 0 else None]))
"""


def cuda_start(deadline_s: float = PROBE_DEADLINE_S) -> tuple[int | None, str, int | None]:
    """(cuInit's CUresult, its name, the devices CUDA counts) for every GPU of the container, as torch's first CUDA
    call would ask (None: libcuda.so.1 not loadable; NO_ANSWER: no answer within the deadline)."""
    env = environment.inherited(without=(environment.CUDA_VISIBLE_DEVICES.name,))
    try:
        done = subprocess.run([sys.executable, "-c", CUDA_PROBE], capture_output=True, text=True, env=env,
                              timeout=deadline_s)
        return tuple(json.loads(done.stdout.strip().splitlines()[-1]))  # type: ignore[return-value]
    except subprocess.TimeoutExpired:
        return NO_ANSWER, f"cuInit did not return within {deadline_s:g} s", None
    except (OSError, ValueError, IndexError) as err:
        return NO_ANSWER, f"the CUDA probe failed: {err}", None


def torch_build() -> tuple[str | None, str | None]:
    """(torch's version, the CUDA it was built for) from its version.py, without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None, None
    try:
        tree = ast.parse((Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text())
    except (OSError, SyntaxError, StopIteration):
        return None, None
    values = {}
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
            values[target.id] = node.value.value
    return values.get("__version__"), values.get("cuda")


def read(deadline_s: float = PROBE_DEADLINE_S) -> Reach:
    nvml_error, nvml_words, nvml_gpus = within(deadline_s, nvml_start, (NO_ANSWER, f"nvmlInit did not return "
                                                                                   f"within {deadline_s:g} s", None))
    cuda_error, cuda_words, cuda_gpus = cuda_start(deadline_s)
    version, cuda = torch_build()
    files = tuple(sorted(path for path in glob.glob("/dev/nvidia[0-9]*") if path[len("/dev/nvidia"):].isdigit()))
    return Reach(nvml_error, nvml_words, nvml_gpus, cuda_error, cuda_words, cuda_gpus, version, cuda, files,
                 environment.CUDA_VISIBLE_DEVICES.get())
