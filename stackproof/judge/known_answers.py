"""Known answers: every rank's input to a collective, and the exact result, as pure arithmetic on index arrays.

The functions take array-likes (torch tensors or numpy arrays: only + - * // % and comparisons are used), so the
suite runs them on the device and unit tests run them on the CPU for any world size without launching ranks.

Repeated calls on one shape read the pattern from index 1, 2, ... on (a shifted window): fresh data, made once.

Exact at any world size (checked for 2..4096 ranks in tests/test_known_answers.py): a sum element gets non-zero
inputs from at most CONTRIBUTORS ranks, each a whole number 1..7, so every partial sum in any order (ring, tree) is
a whole number <= 252, exact in bf16 (8 significant bits); the other ranks add zeros. Every rank still contributes
to one element in every `sparsity(world)`. Max/min take -6..6; products take 1, -1 and (ranks < 8) 2.

Rounding elements (one in ROUNDING_EVERY of a floating sum) tell round-to-nearest from truncation: two ranks give
2**significant_bits (where the dtype's spacing becomes 2) and 1.5; the exact 2**p + 1.5 lies between two
representable values, one add rounds it, and round-to-nearest gives 2**p + 2 where truncation gives 2**p.
"""

from __future__ import annotations

OPS = ("sum", "avg", "max", "min", "product")
VALUES = 7  # a sum input is 1..VALUES
CONTRIBUTORS = 36  # 36 x 7 = 252 <= 256: every partial sum is exact in bf16
ROUNDING_EVERY = 16
ROUNDING_SMALL = 1.5
PRODUCT_TWOS = 8  # ranks below this may give 2: |product| <= 2**8 at any world size
MINMAX_PERIOD = 13  # max/min inputs repeat every 13 ranks: the result is known from the first 13


def sparsity(world: int) -> int:
    """A rank adds a non-zero sum input to one element in this many: at most CONTRIBUTORS ranks per element."""
    return -(-world // CONTRIBUTORS)


def significant_bits(eps: float) -> int:
    """Significant bits of a float type from its machine epsilon (bf16 2**-7 -> 8, fp16 -> 11, fp32 -> 24)."""
    bits = 1
    while 2.0**-bits > eps:
        bits += 1
    return bits + 1


def rounds(world: int, bits: int | None) -> bool:
    """Whether a sum in this type gets rounding elements: a floating type whose 2**p + 1.5 is exact in float64
    (the reference), and two ranks to add."""
    return bits is not None and bits <= 50 and world >= 2


def _is_rounding(index, world: int, bits: int | None):
    return (index % ROUNDING_EVERY == ROUNDING_EVERY - 1) * 1 if rounds(world, bits) else index * 0


def _regular(rank, world: int, index):
    """1..7 on the ranks active for `index` (one in sparsity(world)), 0 elsewhere."""
    active = ((rank + index) % sparsity(world) == 0) * 1
    return active * ((index + 3 * rank) % VALUES + 1)


def _rounding(rank, world: int, index, bits: int):
    big_rank = (index // ROUNDING_EVERY) % world
    return (rank == big_rank) * 2.0**bits + (rank == (big_rank + 1) % world) * ROUNDING_SMALL


def contribution(op: str, rank, world: int, index, *, bits: int | None = None, integral: bool = False):
    """Rank `rank`'s input at positions `index` (either may be an array) for `op` over `world` ranks; `bits`:
    the dtype's significant bits (None for integers); `integral`: an integer dtype (an average of integers is
    taken of multiples of the world size)."""
    if op in ("sum", "avg"):
        values = _regular(rank, world, index)
        if op == "avg" and integral:
            return world * values
        if op == "sum" and rounds(world, bits):
            rounding = _is_rounding(index, world, bits)
            return (1 - rounding) * values + rounding * _rounding(rank, world, index, bits)
        return values
    if op in ("max", "min"):
        return (index * 5 + rank * 11) % MINMAX_PERIOD - 6
    if op == "product":
        choice = (index + rank) % 3
        two = 1 + (rank < PRODUCT_TWOS) * 1
        return (choice == 0) * 1 + (choice == 1) * two - (choice == 2) * 1
    raise ValueError(f"op {op!r}: expected one of {OPS}")


def exact(op: str, world: int, index, *, bits: int | None = None, integral: bool = False):
    """The exact result over every rank's `contribution` (whole numbers, or a float64-exact 2**p + 1.5 at
    rounding elements, or sum / world for a floating average): cast once to the dtype (rounding to nearest)
    it is what a correct reduction gives. Costs O(min(world, 36) x len(index)), whatever the world size."""
    if op in ("sum", "avg"):
        stride, total = sparsity(world), index * 0
        first = (-index) % stride  # the lowest active rank for each index
        for k in range(-(-world // stride)):
            rank = first + k * stride
            total = total + (rank < world) * ((index + 3 * rank) % VALUES + 1)
        if op == "avg":
            return total if integral else total / world
        if rounds(world, bits):
            rounding = _is_rounding(index, world, bits)
            return (1 - rounding) * total + rounding * (2.0**bits + ROUNDING_SMALL)
        return total
    if op in ("max", "min"):
        found = None
        for rank in range(min(world, MINMAX_PERIOD)):
            value = contribution(op, rank, world, index)
            if found is None:
                found = value
            else:  # max / min with arithmetic only, so that numpy arrays and tensors alike take it
                found = found + (value - found) * ((value > found) if op == "max" else (value < found))
        return found
    if op == "product":
        result = index * 0 + 1
        for rank in range(min(world, PRODUCT_TWOS)):  # the twos
            result = result * (1 + ((index + rank) % 3 == 1) * 1)
        # the sign: how many ranks r < world have (index + r) % 3 == 2
        first = (2 - index) % 3
        negatives = (first < world) * ((world - 1 - first) // 3 + 1)
        return result * (1 - 2 * (negatives % 2))
    raise ValueError(f"op {op!r}: expected one of {OPS}")


DENSE_PERIOD = 251  # a prime: ranks r and r + 251 are the first to send alike


def dense(rank, index):
    """What a rank sends in a broadcast or all_gather: -125..125 (exact in bf16), at every index, differing
    between ranks (up to 251 apart) and between neighbouring indices (by 1: a call that reads the pattern one
    index on differs from the previous call at every element, so a stale buffer shows)."""
    return (index + 97 * rank) % DENSE_PERIOD - DENSE_PERIOD // 2


def average_is_exact(world: int) -> bool:
    """NCCL averages floats by multiplying each input with 1/world (gloo divides the sum): exact only when 1/world
    is a power of two; otherwise the result may differ by a few units in the last place."""
    return world & (world - 1) == 0


def average_tolerance_ulps(world: int) -> int:
    """Units in the last place an average may be off: one rounding per input scaled (<= CONTRIBUTORS non-zero),
    one per add, one for the result; 0 when exact."""
    return 0 if average_is_exact(world) else 2 * min(world, CONTRIBUTORS) + 1


# Byte sizes every collective is checked at, besides the odd element counts: the mid range where NCCL switches
# protocols and algorithms (64 KiB .. 4 MiB, all multiples of 4 KiB) and DDP's default bucket (25 MiB).
KiB, MiB = 1 << 10, 1 << 20
DDP_BUCKET_BYTES = 25 * MiB
MID_RANGE_BYTES = (64 * KiB, 256 * KiB + 4 * KiB, MiB, 4 * MiB)
ODD_COUNTS = (1, 3, 17, 1023, 4097, 65537, (1 << 20) + 5, (16 << 20) + 1)


def check_counts(max_bytes: int, element_size: int) -> list[int]:
    """Element counts from 1 to max_bytes: odd counts, counts just past a power of two, the mid-range byte
    sizes, DDP's bucket, and the maximum."""
    top = max(1, max_bytes // element_size)
    by_bytes = [nbytes // element_size for nbytes in (*MID_RANGE_BYTES, DDP_BUCKET_BYTES)]
    return sorted({c for c in (*ODD_COUNTS, *by_bytes, top) if 0 < c <= top})


# --- Products (convolutions, GEMMs) against an exact or float64 reference ---------------------------------------

PRODUCT_ULPS = 4  # units of the compute precision per unit of magnitude an algorithm may lose (Winograd, split-K)


def product_bound(reference, magnitude, compute_eps: float, output_eps: float):
    """How far a product computed in low precision may be from its float64 `reference`, per element: rounding the
    output (one ulp of the output type) plus PRODUCT_ULPS units of the compute precision times `magnitude`, the
    same product taken over absolute values (sum |x| |w|), which bounds every partial sum whatever the order."""
    return output_eps * abs(reference) + PRODUCT_ULPS * compute_eps * magnitude


# The convolutions ResNet-50 (torchvision v1.5) runs: (in channels, out channels, kernel, stride, input size at
# 224 x 224). Every kernel/stride pair and every channel ratio it has, stem to last stage.
RESNET50_CONVS = (
    (3, 64, 7, 2, 224),
    (64, 64, 1, 1, 56), (64, 64, 3, 1, 56), (64, 256, 1, 1, 56), (256, 64, 1, 1, 56),
    (256, 128, 1, 1, 56), (128, 128, 3, 2, 56), (256, 512, 1, 2, 56),
    (512, 256, 1, 1, 28), (256, 256, 3, 2, 28), (256, 1024, 1, 1, 14), (1024, 256, 1, 1, 14), (256, 256, 3, 1, 14),
    (512, 512, 3, 2, 14), (2048, 512, 1, 1, 7), (512, 512, 3, 1, 7), (512, 2048, 1, 1, 7),
)


# --- One DDP step against a single-process reference ------------------------------------------------------------

STEP_ROUNDINGS = 16  # units of float32 per unit of magnitude a gradient may carry through the small network


def ddp_step_bound(eps: float, world: int, lr: float, reference, magnitude):
    """How far a rank's parameter after one SGD step (p - lr * mean of the ranks' gradients) may be from the
    float64 reference (computed on another path, by formula on the CPU), per element: one rounding of the
    parameter, and lr times the gradient's error. A gradient is a sum over the batch and positions whose float32
    error scales with the sum of its terms' magnitudes (`magnitude`: the mean over the shards of sum |input| x
    |grad of output|), not with the sum itself, which cancels (a bias's): STEP_ROUNDINGS units for the roundings
    on its path through the network, world + 1 for DDP's mean. Summing instead of averaging, dividing twice, a
    rank's wrong gradient or a kernel wrong on every rank moves the parameter by lr x a part of a whole gradient,
    far outside."""
    return eps * abs(reference) + lr * (world + 1 + STEP_ROUNDINGS) * eps * magnitude


def running_stat_bound(eps: float, reference, magnitude):
    """How far a BatchNorm running statistic after one forward may be from its float64 reference: one rounding
    of the buffer, and STEP_ROUNDINGS units of float32 times `magnitude`, what the statistic's sum over the batch
    adds in absolute value (momentum x the mean |input|, or the mean square of |input| + |mean| for the
    variance), so the cancellation in a mean near zero stays inside. A wrong momentum, a biased variance, a
    statistic of another batch or a wrong convolution before it is a part of the statistic itself, outside."""
    return eps * abs(reference) + STEP_ROUNDINGS * eps * magnitude


# --- GEMMs at every K class, exact by construction ---------------------------------------------------------------

# K picks the kernel: cuBLAS(Lt) switches tiles, split-K and stream-K with it, so each class is checked. Not powers
# of two (a remainder tile), multiples of 16 (fp8's _scaled_mm needs it).
GEMM_K_CLASSES = {"small": 96, "medium": 2080, "large": 8224}
GEMM_ROWS = 64  # M = N: small, so the largest K class costs ~1 M multiply-adds per GEMM


def gemm_stride(k: int, output_bits: int) -> int:
    """Row i of A is non-zero (+-1) only where k % stride == i % stride, B is +-1 everywhere: every product is
    +-1 or 0, so every partial sum in any order (a tile's, a split-K slice's, a reduction of slices) is a whole
    number no larger than K / stride <= 2**output_bits, exact in the output type (bf16: 256) and in any
    accumulator, and every slice of K of `stride` or more elements still adds to each output."""
    return -(-k // (1 << output_bits))


def gemm_sign(i, k):
    """+-1 by a quadratic hash of (i, k) mod a prime above GEMM_ROWS: every row and column of the product differs
    from every other, so a shifted, permuted or transposed operand shows."""
    return 1 - 2 * ((i * i * 3 + k * k * 5 + i * k * 7 + i + 2 * k) % 257 < 128)


def gemm_a(i, k, stride: int):
    """A[i, k] (i and k index arrays that broadcast): +-1 where k % stride == i % stride, else 0."""
    return (k % stride == i % stride) * gemm_sign(i, k)


def gemm_b(k, j):
    """B[k, j]: +-1 everywhere, another hash than A's."""
    return gemm_sign(j + 101, k)
