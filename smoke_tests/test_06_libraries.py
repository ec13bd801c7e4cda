"""Every CUDA library the image ships, exercised once with a known answer on the run's device (as pytorch's own
release smoke test, .ci/pytorch/smoke_test/smoke_test.py, does, and more): cuSOLVER, cuFFT, cuRAND, cuBLASLt in
the dtypes training uses, torchvision's compiled ops, CUDA device-side errors reaching Python, numpy interop. A
library built for another torch or CUDA loads, trains a ResNet and fails only here; each wrong answer, and each
error where an answer was due, is a software-pins finding (stackproof/judge/software.py). On CPU ranks the same
answers come from the CPU's libraries (LAPACK, pocketfft, oneDNN)."""

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from stackproof.judge import known_answers as recipe
from stackproof.judge import software
from stackproof.judge.findings import Judged
from stackproof.judge.promise import FAST, FULL, Needs
from stackproof.measure import known_answers as known

pytestmark = pytest.mark.check(FULL, Needs())

ASSERT_TIMEOUT_S = 60.0  # a fresh process with a CUDA context, made to fail on purpose


def _library(device: torch.device, cuda: str, cpu: str) -> str:
    return cuda if device.type == "cuda" else cpu


def _wrong(library: str, what: str, expected: str, compute):
    """`compute()` returns '' when right, else what it found; an exception is the library failing. The finding,
    or None."""
    try:
        found = compute()
    except Exception as err:  # the library itself failing is the finding (no kernel image, no backend)
        found = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err).strip() else ''}"
    return software.known_answer(library, what, expected, found) if found else None


def _answers(*cases: tuple) -> Judged:
    """Each case (library, what, expected, compute) that gave another answer, as its finding: every wrong case, not
    only the first (which of them tells the kernel apart)."""
    return Judged(finding for case in cases if (finding := _wrong(*case)))


def _close(found: torch.Tensor, want: torch.Tensor, tolerance: float) -> str:
    error = float((found.double().cpu() - want.double().cpu()).abs().max())
    return "" if error <= tolerance else f"max error {error:.3g} (tolerance {tolerance:g})"


def test_linear_algebra(dist_env, report):
    """cuSOLVER: a solve with a whole-number answer, and the singular values of Q diag(s) Q^T."""
    device = dist_env.device
    library = _library(device, f"cuSOLVER ({torch.backends.cuda.preferred_linalg_library()})", "LAPACK")
    report.figure("library", library)
    generator = torch.Generator().manual_seed(31)
    n = 64

    def solve():
        a = torch.randint(-3, 4, (n, n), generator=generator).double() + 16 * torch.eye(n, dtype=torch.float64)
        x = torch.randint(-5, 6, (n, 2), generator=generator).double()
        return _close(torch.linalg.solve(a.to(device), (a @ x).to(device)), x, 1e-9)

    def svd():
        q, _ = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
        s = torch.arange(n, 0, -1, dtype=torch.float64)
        found = torch.linalg.svdvals((q @ torch.diag(s) @ q.T).to(device))
        return _close(found, s, 1e-9)

    return _answers((library, "linalg.solve", "A x = b solved to the whole-number x", solve),
                    (library, "linalg.svdvals", "singular values n..1 of Q diag(n..1) Q^T", svd))


def test_fft(dist_env, report):
    """cuFFT: a cosine's spectrum is two spikes of n/2; rfft then irfft gives the signal back."""
    device = dist_env.device
    library = _library(device, "cuFFT", "pocketfft")
    report.figure("library", library)
    n, k = 4096, 3
    signal = torch.cos(2 * math.pi * k * torch.arange(n, dtype=torch.float64) / n).float()
    want = torch.zeros(n, dtype=torch.complex64)
    want[k] = want[n - k] = n / 2

    def spectrum():
        return _close(torch.fft.fft(signal.to(device)).abs(), want.abs(), 1e-2)

    def round_trip():
        return _close(torch.fft.irfft(torch.fft.rfft(signal.to(device)), n), signal, 1e-5)

    return _answers((library, "fft", f"|X| = {n // 2} at bins {k} and {n - k}, 0 elsewhere", spectrum),
                    (library, "irfft(rfft(x))", "x back", round_trip))


def test_random_numbers(dist_env, report):
    """cuRAND's Philox through torch: one seed, the same numbers twice; uniform in [0, 1) with mean 1/2 and
    normal with variance 1, to within 6 standard errors."""
    device = dist_env.device
    library = _library(device, "cuRAND (Philox)", "CPU generator (MT19937)")
    report.figure("library", library)
    count = 1 << 22

    def draws(seed):
        generator = torch.Generator(device=device).manual_seed(seed)
        return (torch.rand(count, device=device, generator=generator),
                torch.randn(count, device=device, generator=generator))

    def right():
        (uniform, normal), (again, _) = draws(5), draws(5)
        problems = []
        if not torch.equal(uniform, again):
            problems.append("the same seed gave other numbers")
        if not (float(uniform.min()) >= 0 and float(uniform.max()) < 1):
            problems.append(f"uniform outside [0, 1): {float(uniform.min())}..{float(uniform.max())}")
        if abs(float(uniform.double().mean()) - 0.5) > 6 * math.sqrt(1 / 12 / count):
            problems.append(f"uniform mean {float(uniform.double().mean()):.5f}")
        if abs(float(normal.double().var()) - 1) > 6 * math.sqrt(2 / count):
            problems.append(f"normal variance {float(normal.double().var()):.5f}")
        return "; ".join(problems)

    return _answers((library, "rand/randn", "reproducible, in range, the right moments", right))


def _matmul_dtypes(device: torch.device) -> list[str]:
    names = ["float32", "tf32", "bfloat16", "float16"]
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9) and hasattr(torch, "_scaled_mm"):
        names.append("float8_e4m3fn")
    return names if device.type == "cuda" else ["float32", "bfloat16"]


def test_cublaslt_matmuls(dist_env, report):
    """cuBLAS / cuBLASLt in the dtypes training uses (tf32, bf16, fp16, fp8 where the GPU has it), a plain GEMM,
    a GEMM with its bias fused (addmm: cuBLASLt's epilogue) and a batched one: whole-number operands whose
    products are exact in every dtype, so the answer is the CPU's float64 bit for bit."""
    device = dist_env.device
    library = _library(device, f"cuBLASLt {torch.version.cuda}", "oneDNN / CPU BLAS")
    names = _matmul_dtypes(device)
    report.figure("library", library)
    report.figure("dtypes", ",".join(names))
    generator = torch.Generator().manual_seed(41)
    m, k = 256, 32  # |every partial sum| <= 32: exact in bf16's 8 significant bits, and in fp8 inputs of +-1
    a = torch.randint(-1, 2, (4, m, k), generator=generator).double()
    b = torch.randint(-1, 2, (4, k, m), generator=generator).double()
    bias = torch.randint(-4, 5, (m,), generator=generator).double()
    cases = []
    for name in names:
        def right(name=name):
            if name == "float8_e4m3fn":
                fp8 = torch.float8_e4m3fn
                one = torch.ones((), device=device)
                found = torch._scaled_mm(a[0].to(device, fp8), b[0].T.contiguous().to(device, fp8).T, one, one,
                                         out_dtype=torch.bfloat16)
                return _close(found, a[0] @ b[0], 0)
            dtype = torch.float32 if name == "tf32" else getattr(torch, name)
            previous = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            try:
                x, y, c = (t.to(device, dtype) for t in (a, b, bias))
                problems = [f"{what}: {wrong}" for what, wrong in (
                    ("mm", _close(x[0] @ y[0], a[0] @ b[0], 0)),
                    ("addmm", _close(torch.addmm(c, x[0], y[0]), bias + a[0] @ b[0], 0)),
                    ("bmm", _close(torch.bmm(x, y), a @ b, 0))) if wrong]
            finally:
                torch.backends.cuda.matmul.allow_tf32 = previous
            return "; ".join(problems)

        cases.append((library, f"{name} GEMMs", "the exact product (whole numbers)", right))
    return _answers(*cases)


def _gemm_case(device: torch.device, name: str, k: int) -> str:
    """'' when x @ y and F.linear(x, y^T) (a layer's layout) at this K give the exact product, else what they
    gave. fp8 goes through torch._scaled_mm (unit scales, bf16 out), the path fp8 training takes."""
    fp8 = name == "float8_e4m3fn"
    out_dtype = torch.bfloat16 if fp8 else torch.float32 if name == "tf32" else getattr(torch, name)
    a, b, want = known.gemm_inputs(k, out_dtype)  # shared between calls: read, never written
    if fp8:
        one = torch.ones((), device=device)
        found = torch._scaled_mm(a.to(device, torch.float8_e4m3fn), b.T.contiguous().to(device, torch.float8_e4m3fn).T,
                                 one, one, out_dtype=torch.bfloat16)
        return _close(found, want, 0)
    x, y = a.to(device, out_dtype), b.to(device, out_dtype)
    problems = [f"{what}: {wrong}" for what, wrong in (
        ("x @ y", _close(x @ y, want, 0)), ("F.linear", _close(F.linear(x, y.T.contiguous()), want, 0))) if wrong]
    return "; ".join(problems)


@pytest.mark.check(FAST, Needs())  # ~ms on a GPU: every tier proves the GEMMs a job will run
def test_gemms_at_every_k_class(dist_env, report):
    """Every precision training multiplies in (fp32, TF32, bf16, fp16, fp8 where the GPU has it) at a small, a
    medium and a large K: the library picks another kernel (tile, split-K, stream-K) per K class, so a kernel
    wrong only at large K passes a small-K check. Operands of +-1 and 0 placed so that every partial sum is a
    whole number exact in the output type (judge/known_answers.py: gemm_stride): the answer is exact, tolerance
    zero. M = N = 64 keeps the whole check to a few milliseconds on a GPU."""
    device = dist_env.device
    library = _library(device, f"cuBLASLt {torch.version.cuda}", "oneDNN / CPU BLAS")
    names = _matmul_dtypes(device)
    report.figure("library", library)
    report.figure("dtypes", ",".join(names))
    report.figure("k", ",".join(f"{cls} {k}" for cls, k in recipe.GEMM_K_CLASSES.items()))
    findings = []
    for name in names:
        for cls, k in recipe.GEMM_K_CLASSES.items():
            def right(name=name, k=k):
                previous = torch.backends.cuda.matmul.allow_tf32
                torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
                try:
                    return _gemm_case(device, name, k)
                finally:
                    torch.backends.cuda.matmul.allow_tf32 = previous

            if finding := _wrong(library, f"{name} GEMM at {cls} K = {k}", "the exact product (whole numbers)",
                                 right):
                findings.append(finding)
    return Judged(findings)  # every wrong case: which precisions and K classes tells the kernel apart


def test_torchvision_ops(dist_env, report):
    """torchvision's compiled ops on the run's device: nms keeps the known boxes, roi_align equals torchvision's
    own CPU kernel. A torchvision built for another torch or CUDA imports and fails here."""
    import torchvision  # here, not at the top: its import takes seconds
    from torchvision import ops

    device = dist_env.device
    library = f"torchvision {torchvision.__version__} ({device.type})"
    report.figure("library", library)
    boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30], [21, 21, 30, 30], [0, 0, 5, 5]],
                         dtype=torch.float32)
    scores = torch.tensor([0.9, 0.8, 0.7, 0.95, 0.1])

    def nms():
        keep = ops.nms(boxes.to(device), scores.to(device), 0.5).cpu().tolist()
        return "" if keep == [3, 0, 4] else f"kept {keep}"

    def roi_align():
        generator = torch.Generator().manual_seed(51)
        features = torch.randn(2, 4, 32, 32, generator=generator)
        rois = torch.tensor([[0, 1.5, 2.0, 20.0, 17.5], [1, 0.0, 0.0, 31.0, 31.0]])
        want = ops.roi_align(features, rois, (7, 7), 0.5, 2, aligned=True)
        found = ops.roi_align(features.to(device), rois.to(device), (7, 7), 0.5, 2, aligned=True)
        return _close(found, want, 1e-5)

    return _answers((library, "nms", "boxes [3, 0, 4] kept (IoU threshold 0.5)", nms),
                    (library, "roi_align", "torchvision's CPU kernel's answer", roi_align))


# The child ends by os._exit: once a device-side assert has poisoned its CUDA context, Python's own teardown
# (freeing every tensor through the dead context) only adds time.
_ASSERT_CHILD = ("import os, sys, torch\n"
                 "try:\n"
                 "    torch._assert_async(torch.tensor(False, device='cuda:{index}'))\n"
                 "    torch.cuda.synchronize({index})\n"
                 "except RuntimeError as err:\n"
                 "    print(f'RuntimeError: {{err}}', file=sys.stderr, flush=True)\n"
                 "    os._exit(3)\n"
                 "os._exit(0)\n")


@pytest.fixture(scope="module", autouse=True)
def assert_child(request, dist_env):
    """On a GPU, the device-side assert's child process, started with this module's first check so that its
    start-up (importing torch and making a CUDA context: ~3 s on an H200) runs beside the checks before its own;
    None on a CPU or when that check is not selected. Ended (by its pid) if its check never waits for it."""
    wanted = any(item.originalname == "test_device_side_errors_reach_python" for item in request.session.items)
    if not (wanted and dist_env.device.type == "cuda"):
        yield None
        return
    child = subprocess.Popen([sys.executable, "-c", _ASSERT_CHILD.format(index=dist_env.device.index)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield child
    if child.poll() is None:
        child.kill()
        child.wait(timeout=ASSERT_TIMEOUT_S)


def test_device_side_errors_reach_python(dist_env, report, assert_child):
    """torch._assert_async: a true condition passes; a false one raises in Python (on a GPU, a device-side
    assert: in a child process, since it poisons the CUDA context it happens in)."""
    device = dist_env.device
    report.figure("device", device.type)
    torch._assert_async(torch.tensor(True, device=device))

    def raised():
        if device.type != "cuda":
            try:
                torch._assert_async(torch.tensor(False, device=device))
            except RuntimeError:
                return ""
            return "no error"
        try:
            _, stderr = assert_child.communicate(timeout=ASSERT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            assert_child.kill()
            assert_child.communicate()
            return f"the child process gave no answer in {ASSERT_TIMEOUT_S:g} s"
        said = stderr.strip().splitlines()
        if assert_child.returncode != 0 and "device-side assert" in stderr:
            return ""
        return f"exit {assert_child.returncode}: {said[-1][:300] if said else 'nothing on stderr'}"

    return _answers((f"CUDA {torch.version.cuda}" if device.type == "cuda" else "torch",
                     "torch._assert_async(False)", "a RuntimeError naming a device-side assert", raised))


def test_numpy_interop(dist_env, report):
    """torch and numpy share memory both ways, and the device's tensors come back through numpy intact."""
    import numpy

    report.figure("numpy", numpy.__version__)

    def right():
        array = numpy.arange(12, dtype=numpy.float32).reshape(3, 4)
        shared = torch.from_numpy(array)
        shared[0, 0] = 42
        problems = [] if array[0, 0] == 42 else ["torch.from_numpy copied instead of sharing"]
        back = (shared.to(dist_env.device) * 2).cpu().numpy()
        if not numpy.array_equal(back, array * 2):
            problems.append("a device round trip through numpy changed the values")
        if torch.from_numpy(numpy.zeros(2, dtype=numpy.int64)).dtype != torch.int64:
            problems.append("numpy int64 did not map to torch.int64")
        return "; ".join(problems)

    return _answers((f"numpy {numpy.__version__}", "interop", "memory shared, values intact", right))
