"""The image's software doing what it claims: torch.compile really compiled, torch carries kernels for this GPU,
and every library it ships gives a known answer. Pure functions on what the checks read (no torch); each wrong
answer is a software-pins finding: the image, not the machine, is to blame, and rebuilding it is the fix."""

from __future__ import annotations

import re

from packaging.version import Version

from stackproof.judge.findings import Finding

REBUILD = "rebuild the image from its lock (make build); a library or wheel other than the lock's is loaded"


def pins(check: str, expected: str, found: str, action: str = REBUILD, gpu_index: int | None = None,
         uuid: str = "") -> Finding:
    return Finding(gpu_index, uuid, check, expected, found, "software-pins", "triage", action)


def compile_proof(counters: dict[str, dict[str, int]], kernels: int, backend: str) -> Finding | None:
    """None when torch.compile traced a graph (dynamo's stats.unique_graphs) and inductor built it (an FX graph
    compiled or loaded from its cache, and kernels generated): a torch.compile that hands back the eager
    function (suppress_errors, TORCH_COMPILE_DISABLE, a patched torch.compile) compares eager with eager."""
    graphs = counters.get("stats", {}).get("unique_graphs", 0)
    inductor = counters.get("inductor", {})
    built = sum(inductor.get(key, 0) for key in ("fxgraph_cache_miss", "fxgraph_cache_hit", "fxgraph_cache_bypass"))
    if graphs and built and (kernels or inductor.get("fxgraph_cache_hit")):  # a cache hit may skip codegen
        return None
    why = ("dynamo traced no graph (torch.compile returned the eager function: TORCH_COMPILE_DISABLE=1, "
           "torch._dynamo.config.suppress_errors, or a torch.compile replaced)" if not graphs else
           f"inductor built no graph ({dict(inductor) or 'no inductor counters'}): another backend ran")
    return pins("torch.compile generated kernels", f"a graph traced by dynamo and compiled by inductor into "
                f"{backend} kernels", f"{why}; graphs {graphs}, inductor graphs {built}, kernels {kernels}",
                "unset TORCH_COMPILE_DISABLE and torch._dynamo.config.suppress_errors, and check the image's "
                "compiler toolchain (the check's hint); an eager fallback hides every compile failure")


def compile_failed(backend: str, device: str, error: str, fix: str) -> Finding:
    """torch.compile raised: inductor could not build its kernels (a compiler or headers missing, a noexec cache)."""
    return pins("torch.compile builds kernels", f"inductor to compile and build {backend} kernels on {device}",
                error, fix)


def compiled_differs(call: int, calls: int, detail: str, gpu_index: int | None) -> Finding:
    """The compiled function's answer left eager's on a later call (stale inputs, a bad cache entry)."""
    return pins("torch.compile matches eager", f"the compiled function's answer equal to eager's (within "
                f"torch.testing's tolerance) at every call of {calls}", f"call {call} of {calls}: compiled != eager: "
                f"{detail}", "clear inductor's cache (TORCHINDUCTOR_CACHE_DIR) and rebuild the image from its lock; "
                "if only one GPU differs, run the burn tier on it", gpu_index)


def _major_minor(version: str) -> tuple[int, ...]:
    return Version(version).release[:2]


def minor_version_compatible(built: str, driver: str) -> bool:
    """torch built for a newer CUDA minor than the driver supports, in the same major: CUDA's minor-version
    compatibility runs it (a note, not a fault)."""
    return _major_minor(driver)[0] >= _major_minor(built)[0] and _major_minor(driver) < _major_minor(built)


def driver_too_old(built: str, driver: str, driver_version: str, fix: str) -> list[Finding]:
    """A driver whose CUDA major is below the one torch was built for: no kernel of the image runs."""
    if _major_minor(driver)[0] >= _major_minor(built)[0]:
        return []
    return [Finding(None, "", "driver supports the image's CUDA", f"a driver that supports CUDA {built}",
                    f"driver {driver_version} supports CUDA {driver} at most", "configuration", "triage", fix)]


_ARCH = re.compile(r"^(sm|compute)_(\d+)(\d)([af]?)$")


def arch_covers(arch_list: list[str], capability: tuple[int, int]) -> bool:
    """Whether torch's kernels run on a GPU of `capability`: a cubin sm_XY runs on capability X.y with y >= Y
    (binary compatibility within a major version; not the arch-specific 'a'/'f' cubins, which run on X.Y
    only), PTX compute_XY is JIT-compiled for any capability >= X.Y (CUDA's compatibility rules)."""
    major, minor = capability
    for arch in arch_list:
        match = _ARCH.match(arch)
        if not match:
            continue
        kind, arch_major, arch_minor, variant = match.group(1), int(match.group(2)), int(match.group(3)), match[4]
        if kind == "compute" and (arch_major, arch_minor) <= capability:
            return True
        if kind == "sm" and arch_major == major and (arch_minor == minor if variant else arch_minor <= minor):
            return True
    return False


def arch_finding(arch_list: list[str], capability: tuple[int, int], gpu_index: int | None, uuid: str, name: str
                 ) -> Finding | None:
    if arch_covers(arch_list, capability):
        return None
    want = f"sm_{capability[0]}{capability[1]}"
    return pins("torch has kernels for the GPU", f"a cubin for {want} (or PTX at or below it)",
                f"{name} is compute capability {capability[0]}.{capability[1]}; torch was built for "
                f"{', '.join(arch_list) or 'no CUDA architecture'}",
                f"use an image whose torch is built for {want} (TORCH_CUDA_ARCH_LIST): the GPU is not broken, the "
                "image has no kernels for it", gpu_index, uuid)


def known_answer(library: str, what: str, expected: str, found: str) -> Finding:
    """A library the image ships gave a wrong answer, or none (an error where the answer was due)."""
    return pins(f"{library}: {what}", expected, found)


CONVOLUTIONS_WRONG = ("a convolution gave wrong numbers: check the cuDNN/oneDNN build the image loads (pins) and the "
                      "GPU (sdc_digest); TORCH_CUDNN_V8_API_DISABLED=1 or torch.backends.cudnn.enabled=False narrows "
                      "it down")


def wrong_convolutions(backend: str, on_gpu: bool, found: str, gpu_index: int | None = None) -> Finding:
    """Convolutions off their known answer. On CPU ranks the image's oneDNN is to blame; on a GPU the GPU or the
    image's cuDNN, which this check cannot tell apart: the GPU's, to triage (sdc_digest on it says whether it
    computes wrong)."""
    return Finding(gpu_index, "", f"{backend} convolutions", "ResNet-50's convolutions within their known answer's "
                   "bound", found, "gpu-hardware" if on_gpu else "software-pins", "triage", CONVOLUTIONS_WRONG)
