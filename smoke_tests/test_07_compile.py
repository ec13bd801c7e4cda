"""torch.compile works: inductor generates and builds kernels at run time, in C++ on the CPU (a C++ compiler and
Python.h) and with Triton on GPUs (a C compiler for its launcher). An image without them fails the first compile.
The compiled function is called several times with fresh inputs, each result compared with eager: a compiled
kernel that is right once and wrong later (stale inputs, a bad cache entry) fails too."""

import time

import pytest
import torch

CALLS = 3  # the first call compiles; the later ones reuse the kernels on new data

def pointwise_and_reduction(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * torch.cos(y) + (x * y).sum(dim=-1, keepdim=True)


def test_torch_compile_matches_eager(dist_env, report):
    report.classify("software-pins", "triage")
    # inductor's own on-disk cache is kept: a container starts with an empty one, so an image always compiles
    # here; on a host an earlier run's kernels may be reused, and the figure 'kernels' says which happened.
    import torch._inductor.config  # here, not at the top: its import takes seconds, and --tier fast collects this
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    backend = "Triton" if dist_env.is_gpu else "C++"
    report.hint(f"torch.compile needs a {'C' if dist_env.is_gpu else 'C++'} compiler and the Python headers in the "
                "image (apt: g++ python3.X-dev; stackproof images have them, docker/base); or set CXX/CC to one")
    generator = torch.Generator().manual_seed(7)
    inputs = [[torch.randn(64, 256, generator=generator).to(dist_env.device) for _ in range(2)] for _ in range(CALLS)]
    compiled = torch.compile(pointwise_and_reduction, backend="inductor", fullgraph=True, dynamic=False)
    started = time.perf_counter()
    try:
        # One compile thread: a pool of compile workers costs more to start than this one kernel takes.
        with torch._inductor.config.patch(compile_threads=1):
            found = [compiled(x, y) for x, y in inputs]
    except Exception as err:  # inductor wraps the compiler's failure; its first line names it
        pytest.fail(f"torch.compile (inductor, {backend} on {dist_env.device.type}) failed: "
                    f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}")
    if dist_env.is_gpu:
        torch.cuda.synchronize(dist_env.device)
    report.figure("compile", round(time.perf_counter() - started, 2), "s")
    report.figure("backend", f"inductor ({backend}, {dist_env.device.type})")
    report.figure("kernels", "from cache" if counters["inductor"]["fxgraph_cache_hit"] else "compiled")
    report.figure("calls", CALLS)
    for call, ((x, y), result) in enumerate(zip(inputs, found, strict=True)):
        torch.testing.assert_close(result, pointwise_and_reduction(x, y),
                                   msg=lambda m, call=call: f"call {call + 1} of {CALLS}: compiled != eager: {m}")
