"""torch.compile works: inductor generates and builds kernels at run time, in C++ on the CPU (a C++ compiler and
Python.h) and with Triton on GPUs (a C compiler for its launcher). An image without them fails the first compile.
The compiled function is called several times with fresh inputs, each result compared with eager: a compiled
kernel that is right once and wrong later (stale inputs, a bad cache entry) fails too. And compile must really have
compiled: dynamo's and inductor's counters must show a traced graph built into generated kernels, so a
torch.compile that hands back the eager function (an eager fallback) fails instead of comparing eager with
eager."""

import os
import time
from pathlib import Path

import pytest
import torch

from stackproof.judge import software
from stackproof.judge.findings import Judged
from stackproof.judge.promise import FULL, Needs

pytestmark = pytest.mark.check(FULL, Needs())

CALLS = 3  # the first call compiles; the later ones reuse the kernels on new data

def pointwise_and_reduction(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * torch.cos(y) + (x * y).sum(dim=-1, keepdim=True)


def _on_a_noexec_mount(path: str) -> bool:
    """Whether `path` (or, before it exists, the nearest folder above it) is on a filesystem mounted noexec."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return bool(os.statvfs(folder).f_flag & os.ST_NOEXEC)


def _hint(is_gpu: bool) -> str:
    """The fix when the compile fails: a noexec kernel cache (a read-only container with a noexec --tmpfs /tmp),
    else a missing compiler or Python headers."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    kernels = cache_dir()
    if _on_a_noexec_mount(kernels):
        return (f"inductor builds its kernels in {kernels} and loads them from there, but that filesystem is mounted "
                "noexec: let /tmp allow exec (docker run --tmpfs /tmp:exec; Kubernetes: an emptyDir at /tmp), or "
                "set TORCHINDUCTOR_CACHE_DIR to a folder on a filesystem that allows exec")
    return (f"torch.compile needs a {'C' if is_gpu else 'C++'} compiler and the Python headers in the image (apt: "
            "g++ python3.X-dev; stackproof images have them, docker/base); or set CXX/CC to one")


def test_torch_compile_matches_eager(dist_env, report):
    # inductor's own on-disk cache is kept: a container starts with an empty one, so an image always compiles
    # here; on a host an earlier run's kernels may be reused, and the figure 'kernels' says which happened.
    import torch._inductor.config  # here, not at the top: its import takes seconds, and --tier fast collects this
    from torch._dynamo.utils import counters
    from torch._inductor import metrics

    torch._dynamo.reset()
    counters.clear()
    metrics.reset()
    backend, fix = "Triton" if dist_env.is_gpu else "C++", _hint(dist_env.is_gpu)
    generator = torch.Generator().manual_seed(7)
    inputs = [[torch.randn(64, 256, generator=generator).to(dist_env.device) for _ in range(2)] for _ in range(CALLS)]
    compiled = torch.compile(pointwise_and_reduction, backend="inductor", fullgraph=True, dynamic=False)
    started = time.perf_counter()
    try:
        # One compile thread: a pool of compile workers costs more to start than this one kernel takes.
        with torch._inductor.config.patch(compile_threads=1):
            found = [compiled(x, y) for x, y in inputs]
    except Exception as err:  # inductor wraps the compiler's failure; its first line names it
        if "no compiled frames" in str(err):  # fullgraph and a disabled dynamo (TORCH_COMPILE_DISABLE=1)
            return Judged([software.compile_proof({k: dict(v) for k, v in counters.items()}, 0, backend)], hint=fix)
        said = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        return Judged([software.compile_failed(backend, dist_env.device.type, said, fix)], hint=fix)
    if dist_env.is_gpu:
        torch.cuda.synchronize(dist_env.device)
    report.figure("compile", round(time.perf_counter() - started, 2), "s")
    report.figure("backend", f"inductor ({backend}, {dist_env.device.type})")
    report.figure("kernels", "from cache" if counters["inductor"]["fxgraph_cache_hit"] else "compiled")
    report.figure("calls", CALLS)
    report.figure("generated_kernels", metrics.generated_kernel_count)
    eager = software.compile_proof({k: dict(v) for k, v in counters.items()}, metrics.generated_kernel_count,
                                   backend)
    gpu = dist_env.gpu_index
    if eager is not None:
        return Judged([eager], hint=fix)
    return Judged([software.compiled_differs(call + 1, CALLS, differs, gpu) for call, ((x, y), result) in
                   enumerate(zip(inputs, found, strict=True))
                   if (differs := _differs(result, pointwise_and_reduction(x, y)))][:1], hint=fix)


def _differs(found: torch.Tensor, want: torch.Tensor) -> str:
    """torch.testing's words on how `found` differs from `want` ('' when within its tolerance)."""
    try:
        torch.testing.assert_close(found, want)
    except AssertionError as err:
        return " ".join(str(err).split())
    return ""
