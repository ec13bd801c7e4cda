"""Convolutions give the known answer: ResNet-50's convolution shapes, fp32 and bf16, channels_last, on the backend
the run uses (cuDNN on GPUs, oneDNN or the native kernels on CPUs), against a float64 reference computed without
a convolution (im2col + a float64 GEMM). Inputs are small whole numbers, exact in bf16, so the only error allowed
is what the dtype's rounding explains (stackproof/judge/known_answers.product_bound)."""

import pytest
import torch
import torch.nn.functional as F

from stackproof.judge import known_answers as recipe
from stackproof.judge import software
from stackproof.judge.findings import Finding, Judged
from stackproof.judge.promise import FULL, Needs

pytestmark = pytest.mark.check(FULL, Needs())

CPU_SHRINK = 8  # CPU runs take 1/8 of each spatial size: the same kernels, strides and channels, in seconds
BATCH = {"cuda": 4, "cpu": 2}


def _backend(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuDNN {torch.backends.cudnn.version()}"
    return "oneDNN" if torch.backends.mkldnn.is_available() else "native CPU kernels"


def _compute_eps(dtype: torch.dtype, device: torch.device) -> float:
    """The precision products are accumulated in: fp32 (bf16 convolutions accumulate in fp32), or TF32's 10
    mantissa bits where cuDNN may use TF32 for fp32 convolutions."""
    if dtype == torch.float32 and device.type == "cuda" and torch.backends.cudnn.allow_tf32:
        return 2.0**-10
    return torch.finfo(torch.float32).eps


def _reference(x: torch.Tensor, w: torch.Tensor, stride: int, padding: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x conv w, |x| conv |w|) in float64, by im2col and a GEMM: no convolution kernel involved."""
    n, _, h, width = x.shape
    out_h, out_w = (h + 2 * padding - w.shape[2]) // stride + 1, (width + 2 * padding - w.shape[3]) // stride + 1
    columns = F.unfold(x.double(), w.shape[2:], padding=padding, stride=stride)  # n, c*k*k, L
    flat = w.double().reshape(w.shape[0], -1)

    def product(a, b):
        return torch.einsum("ok,nkl->nol", a, b).reshape(n, w.shape[0], out_h, out_w)

    return product(flat, columns), product(flat.abs(), columns.abs())


def _cudnn_runs_the_convolutions(device: torch.device, dtype: torch.dtype, report) -> Finding | None:
    """cuDNN is enabled, and torch dispatches a convolution to it (aten::cudnn_convolution in the profiler's
    CPU-side op list; no CUPTI needed): else the answers below would be another backend's."""
    x = torch.ones(1, 8, 8, 8, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
    w = torch.ones(8, 8, 3, 3, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        F.conv2d(x, w, None, 1, 1)
    ops = {event.name for event in profile.events()}
    used = "aten::cudnn_convolution" in ops
    report.figure("cudnn_used", used)
    if torch.backends.cudnn.enabled and torch.backends.cudnn.is_available() and used:
        return None
    return software.pins("convolutions run on cuDNN", "torch.backends.cudnn enabled and available, and "
                            "aten::cudnn_convolution dispatched",
                            f"enabled={torch.backends.cudnn.enabled}, available={torch.backends.cudnn.is_available()}, "
                            f"convolution ops: {sorted(op for op in ops if 'conv' in op)}",
                            "load the image's cuDNN (pins::native_library_comes_from_its_wheel) and leave "
                            "torch.backends.cudnn.enabled on")


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_convolutions_give_the_known_answer(dtype_name, dist_env, report):
    dtype, device = getattr(torch, dtype_name), dist_env.device
    generator = torch.Generator().manual_seed(2026 + dist_env.rank)
    shrink, batch = (1 if dist_env.is_gpu else CPU_SHRINK), BATCH[device.type]
    failures, worst = [], 0.0
    if dist_env.is_gpu and (not_cudnn := _cudnn_runs_the_convolutions(device, dtype, report)):
        return Judged([not_cudnn], hint=software.CONVOLUTIONS_WRONG)
    for c_in, c_out, kernel, stride, size in recipe.RESNET50_CONVS:
        size = max(size // shrink, kernel)
        x = torch.randint(-2, 3, (batch, c_in, size, size), generator=generator).to(device, dtype)
        w = torch.randint(-2, 3, (c_out, c_in, kernel, kernel), generator=generator).to(device, dtype)
        x, w = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
        found = F.conv2d(x, w, None, stride, kernel // 2).double()
        want, magnitude = _reference(x, w, stride, kernel // 2)
        bound = recipe.product_bound(want, magnitude, _compute_eps(dtype, device), torch.finfo(dtype).eps)
        error = (found - want).abs()
        worst = max(worst, float((error / magnitude.clamp(min=1)).max()))
        bad = error > bound
        if bad.any():
            first = [int(i) for i in bad.nonzero()[0]]
            failures.append(f"conv {c_in}->{c_out} {kernel}x{kernel} stride {stride} on {batch}x{c_in}x{size}x{size}: "
                            f"{int(bad.sum())} of {bad.numel()} outputs off, first at (n, c, h, w) = {tuple(first)}: "
                            f"found {found[tuple(first)].item()}, expected {want[tuple(first)].item()} "
                            f"+- {bound[tuple(first)].item():.3g}")
    report.figure("backend", _backend(device))
    report.figure("shapes", len(recipe.RESNET50_CONVS))
    report.figure("worst_relative_error", f"{worst:.2g}")
    said = f"{_backend(device)}, {dtype_name}, channels_last: " + "; ".join(failures[:3]) + (
        f" (and {len(failures) - 3} more shapes)" if len(failures) > 3 else "")
    return Judged([software.wrong_convolutions(_backend(device), dist_env.is_gpu, said,
                                               dist_env.gpu_index)] if failures else [],
                  hint=software.CONVOLUTIONS_WRONG)
