"""Per-GPU proof: the silent-data-corruption GEMM digest, measurements on one device timed with CUDA events, and
the cross-rank decisions (the odd one out, the one below the median) that rank 0 takes on every rank's value.
The bars these figures are held to are stackproof/judge/bars.py's."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch

from stackproof.measure import patterns

# --- Silent data corruption --------------------------------------------------------------------------------------

def one_ulp_up(tensor: torch.Tensor) -> torch.Tensor:
    """A copy with element [0, 0] moved up by one unit in the last place (its bit pattern + 1)."""
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[tensor.dtype]
    bumped = tensor.clone()
    bumped.view(bits)[0, 0] += 1
    return bumped


DIGEST_DTYPES = (torch.bfloat16, torch.float32)


Inputs = dict[torch.dtype, tuple[torch.Tensor, ...]]  # per dtype of DIGEST_DTYPES, on the CPU


def digest_inputs(n: int = 2048, steps: int = 8, seed: int = 20260101) -> Inputs:
    """The GEMM chain's fixed-seed inputs, made on the CPU, in each dtype: (start, weight per step...). The CPU's
    part of the digest (0.4 s on an H200's host), made apart so that it can run beside the GPU's other checks."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randn(n, n, generator=generator)
    weights = [torch.randn(n, n, generator=generator) / math.sqrt(n) for _ in range(steps)]
    return {dtype: (start.to(dtype), *(w.to(dtype) for w in weights)) for dtype in DIGEST_DTYPES}


def digest_chain(device: torch.device, n: int = 2048, steps: int = 8, seed: int = 20260101,
                 perturb: bool = False, inputs: Inputs | None = None) -> str:
    """sha256 of a chain of GEMMs (x <- tanh(x @ w), in bf16 and in fp32) from fixed-seed inputs made on the CPU
    (`inputs`: digest_inputs(n, steps, seed), made ahead). cuBLAS gives bit-identical results on GPUs of the same
    architecture and SM count, so every GPU of one model must produce the same digest; a GPU that computes wrong
    (silent data corruption) produces another. `perturb` moves one input element by one ulp (the sdc fault)."""
    inputs = inputs or digest_inputs(n, steps, seed)
    digest = hashlib.sha256()
    for dtype in DIGEST_DTYPES:
        start, *weights = inputs[dtype]
        x = (one_ulp_up(start) if perturb else start).to(device)
        for w in weights:
            x = torch.tanh(x @ w.to(device))
        digest.update(x.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def exact_inputs(m: int = 2048, k: int = 256, seed: int = 20260102) -> Inputs:
    """(a, b, a @ b) of the exact GEMM in each dtype, on integers in {-1, 0, 1}, the product in float64 on the CPU
    (0.2 s on an H200's host), made apart so that it can run beside the GPU's other checks."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.randint(-1, 2, (m, k), generator=generator).double()
    b = torch.randint(-1, 2, (k, m), generator=generator).double()
    a[0, 0] = 1.0  # a one-ulp move of a non-zero element changes the products it enters
    want = a @ b
    return {dtype: (a.to(dtype), b.to(dtype), want.to(dtype)) for dtype in DIGEST_DTYPES}


def exact_gemm_mismatches(device: torch.device, m: int = 2048, k: int = 256, seed: int = 20260102,
                          perturb: bool = False, inputs: Inputs | None = None) -> dict[str, int]:
    """Elements that differ from the exact answer, per dtype, of a GEMM on integers in {-1, 0, 1} (`inputs`:
    exact_inputs(m, k, seed), made ahead): with k = 256 every partial sum is an integer of at most 256, exact in
    bf16 and fp32 whatever the order or precision of the reduction, so the GPU's result must equal the CPU's bit
    for bit. This needs no other GPU to compare with, so it names a bad GPU even in a job of two (where no digest
    has a majority)."""
    inputs = inputs or exact_inputs(m, k, seed)
    wrong = {}
    for dtype in DIGEST_DTYPES:
        a, b, want = inputs[dtype]
        left = one_ulp_up(a) if perturb else a
        found = (left.to(device) @ b.to(device)).cpu()
        wrong[str(dtype).removeprefix("torch.")] = int((found != want).sum())
    return wrong


# --- Measurements on one device (CUDA events; no collective inside) ---------------------------------------------

def seconds_per_iteration(device: torch.device, step: Callable[[], object], warmup: int, iters: int,
                          during: Callable[[], object] | None = None) -> tuple[float, object]:
    """GPU time of one `step`, from CUDA events around `iters` steps after `warmup` untimed ones. `during` is
    called on the host once the timed steps are queued, while the GPU runs them (to read NVML under load); its
    result is returned with the time."""
    stream = torch.cuda.current_stream(device)
    for _ in range(warmup):
        step()
    stream.synchronize()  # this stream only: work queued on others (the slow-gpu fault's) keeps running
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(iters):
        step()
    end.record(stream)
    seen = during() if during is not None else None
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters, seen


def device_copy_bytes_per_s(device: torch.device, nbytes: int = 1 << 30, warmup: int = 5, iters: int = 50,
                            seed: int = 0) -> tuple[float, patterns.WrongBytes | None]:
    """Device-to-device copy bandwidth counting read + write (2 x nbytes per copy), as the HBM peak counts, and
    what the last copy delivered: the source holds the pattern of `seed`, the destination starts as its
    complement (a copy that never happened shows), and is compared once after the timing."""
    src = patterns.made(nbytes, seed, device)
    dst = torch.bitwise_not(src)
    seconds, _ = seconds_per_iteration(device, lambda: dst.copy_(src), warmup, iters)
    return 2 * nbytes / seconds, patterns.first_wrong(dst, seed)


COPY_TRIES = 3  # host<->device copies timed at most this many times while below their bar; the best counts


class HostCopies:
    """Host <-> device bandwidth one way at a time, from page-locked host memory (what DataLoader pin_memory
    uses), with what arrived checked: host-to-device carries the pattern of `seed` (written on the CPU, checked
    on the GPU), device-to-host carries another (written on the GPU, checked on the CPU). `prepare` and
    `check_host` do the CPU's part (about 0.1 s per 512 MiB) outside the timed turns of the node's GPUs."""

    def __init__(self, device: torch.device, seed: int, nbytes: int = 512 << 20):
        self.device, self.nbytes = device, nbytes
        self.seeds = (seed, patterns.seed_of("device-to-host", seed))
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def prepare(self) -> None:
        patterns.fill(self.host, self.seeds[0])

    def to_device(self, warmup: int = 2, iters: int = 10, during: Callable[[], object] | None = None
                  ) -> tuple[float, object, patterns.WrongBytes | None]:
        self.on_device.fill_(0xA5)  # not the pattern: a copy that never happened shows
        seconds, seen = seconds_per_iteration(
            self.device, lambda: self.on_device.copy_(self.host, non_blocking=True), warmup, iters, during)
        return self.nbytes / seconds, seen, patterns.first_wrong(self.on_device, self.seeds[0])

    def to_host(self, warmup: int = 2, iters: int = 10) -> float:
        patterns.fill(self.on_device, self.seeds[1])
        seconds, _ = seconds_per_iteration(
            self.device, lambda: self.host.copy_(self.on_device, non_blocking=True), warmup, iters)
        torch.cuda.current_stream(self.device).synchronize()
        return self.nbytes / seconds

    def check_host(self) -> patterns.WrongBytes | None:
        return patterns.first_wrong(self.host, self.seeds[1])


def pinned_copy_bytes_per_s(device: torch.device, to_device: bool, nbytes: int = 512 << 20, warmup: int = 2,
                            iters: int = 10, during: Callable[[], object] | None = None) -> tuple[float, object]:
    """Host <-> device bandwidth one way, unchecked (benchmarks/per_gpu_spread.py's figure)."""
    copies = HostCopies(device, 0, nbytes)
    if to_device:
        rate, seen, _ = copies.to_device(warmup, iters, during)
        return rate, seen
    return copies.to_host(warmup, iters), None


def gemm_flops_per_s(device: torch.device, n: int = 8192, dtype: torch.dtype = torch.bfloat16, warmup: int = 10,
                     iters: int = 50, noisy_neighbour: bool = False,
                     during: Callable[[], object] | None = None) -> tuple[float, object]:
    """Dense GEMM throughput, 2 n^3 FLOP per product. `noisy_neighbour` (the slow-gpu fault) first queues twice
    as many products on a second stream, so the timed ones share the SMs with them (about half the rate)."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    out = torch.empty_like(a)
    step = lambda: torch.matmul(a, b, out=out)  # noqa: E731
    if noisy_neighbour:
        for _ in range(warmup):
            step()
        torch.cuda.synchronize(device)
        side, side_out = torch.cuda.Stream(device), torch.empty_like(a)
        with torch.cuda.stream(side):
            for _ in range(2 * iters):
                torch.matmul(a, b, out=side_out)
        warmup = 0  # done; warming up again would wait out the neighbour's queue
    seconds, seen = seconds_per_iteration(device, step, warmup, iters, during)
    torch.cuda.synchronize(device)  # the neighbour's work, if any, ends before its buffers go
    wrong = gemm_known_answer_problem(device, n, dtype)
    if wrong:
        raise WrongGemm(wrong)
    return 2 * n**3 / seconds, seen


class WrongGemm(AssertionError):
    """The timed GEMM kernel computes wrong numbers: a finding about the GPU, not a slow figure."""


GEMM_CHECK_OPERANDS = 2  # operand pairs through the timed kernel; two vectors of Freivalds' identity each
GEMM_CHECK_NONZEROS = 128  # per row of A: every partial sum of a row of A @ B is a whole number <= ~170 < 256


def gemm_known_answer_problem(device: torch.device, n: int = 8192, dtype: torch.dtype = torch.bfloat16,
                              operands: int = GEMM_CHECK_OPERANDS, seed: int = 20260103) -> str:
    """'' when the kernel the throughput check times (torch.matmul into `out`, n x n x n, `dtype`) gives the
    exact product; else what was wrong. A holds about 128 entries +-1 per row, B is +-1, so every entry and every
    partial sum of A @ B is a whole number of at most ~170: exact in bf16 whatever the order or split of the
    reduction. Freivalds' identity, (A @ B) x == A (B x), is then exact in float64 for x of +-1 (n^2 work, not
    n^3); any wrong element changes its row's sum by a non-zero amount."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def signs(*shape):
        return torch.randint(0, 2, shape, device=device, generator=generator, dtype=torch.int8) * 2 - 1

    out = torch.empty(n, n, device=device, dtype=dtype)
    for operand in range(operands):
        keep = torch.rand(n, n, device=device, generator=generator) < GEMM_CHECK_NONZEROS / n
        a, b = (signs(n, n) * keep).to(dtype), signs(n, n).to(dtype)
        torch.matmul(a, b, out=out)
        a64, b64, c64 = a.double(), b.double(), out.double()
        for _ in range(2):
            x = signs(n).double()
            wrong_rows = (torch.mv(c64, x) != torch.mv(a64, torch.mv(b64, x))).nonzero()
            if len(wrong_rows):
                row = int(wrong_rows[0, 0])
                return (f"the {n}^3 {str(dtype).removeprefix('torch.')} GEMM the throughput check times gave wrong "
                        f"elements in {len(wrong_rows)} of {n} rows (operand pair {operand + 1}, first row {row}): "
                        "(A @ B) x != A (B x) for whole-number operands whose product is exact in every dtype")
    return ""
