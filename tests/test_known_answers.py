"""The known answers are exact at any world size: every rank's input is built for world sizes 2..4096 without
launching ranks, and accumulated in the dtype in ring and tree order (as NCCL does); plus the GEMM check's own
proof on the CPU. Pure functions, torch on the CPU only."""

import numpy as np
import pytest
import torch

from stackproof.judge import known_answers as recipe
from stackproof.measure import gpu_proof, known_answers

FLOATS = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Every world size up to 80 and where the recipe's structure changes (a multiple of 36 ranks and the next), around
# powers of two, odd and prime sizes, up to 4096 and one past it.
DENSE_WORLDS = sorted({*range(2, 81), *(36 * k + d for k in (3, 28, 113) for d in (0, 1)), 127, 128, 129, 255, 256,
                       257, 1021, 1024, 1025, 2048, 4095, 4096, 4097})


def _columns(world: int) -> torch.Tensor:
    """Indices covering one period of the recipe's pattern at this world size (7 x the sparsity; the rounding
    elements replace some of it), one more rounding element and an odd tail. Every regular pattern, rounding
    elements or not, is covered by test_every_world_size_up_to_4096_keeps_every_partial_sum_exact."""
    return torch.arange(7 * recipe.sparsity(world) + recipe.ROUNDING_EVERY + 3, dtype=torch.float64)


def _inputs(op, world, dtype):
    index = _columns(world)
    ranks = torch.arange(world, dtype=torch.float64)[:, None]
    values = recipe.contribution(op, ranks, world, index[None, :], bits=known_answers.bits_of(dtype))
    cast = values.to(dtype)
    assert torch.equal(cast.double(), values), f"{op} inputs at world {world} are not exact in {dtype}"
    return cast, index


def _ring(rows: torch.Tensor, start: int, combine) -> torch.Tensor:
    """Accumulate in the rows' dtype in ring order from `start` (each add rounds, as on the GPU)."""
    world = rows.shape[0]
    total = rows[start % world].clone()
    for step in range(1, world):
        total = combine(total, rows[(start + step) % world])
    return total


def _tree(rows: torch.Tensor, combine) -> torch.Tensor:
    """Accumulate in the rows' dtype pairwise, level by level (a binary tree over the ranks)."""
    while rows.shape[0] > 1:
        paired = combine(rows[0:rows.shape[0] - 1:2], rows[1::2])
        rows = torch.cat([paired, rows[-1:]]) if rows.shape[0] % 2 else paired
    return rows[0]


COMBINE = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum, "product": torch.mul}


@pytest.mark.parametrize("dtype_name", list(FLOATS))
def test_sums_are_exact_in_ring_and_tree_order_in_the_dtype(dtype_name):
    dtype = FLOATS[dtype_name]
    worlds = DENSE_WORLDS if dtype != torch.float32 else [2, 3, 36, 37, 256, 4096]
    for world in worlds:
        rows, index = _inputs("sum", world, dtype)
        want = recipe.exact("sum", world, index, bits=known_answers.bits_of(dtype)).to(dtype)
        starts = sorted({0, 1, world // 2, world - 1})  # every start at once: the rotated copies side by side
        found = _ring(torch.cat([rows.roll(-start, 0) for start in starts], dim=1), 0, torch.add)
        assert torch.equal(found, want.repeat(len(starts))), (world, int((found != want.repeat(len(starts))).sum()))
        assert torch.equal(_tree(rows, torch.add), want), world


def test_rounding_elements_tell_round_to_nearest_from_truncation():
    for dtype, bits, nearest in ((torch.bfloat16, 8, 258.0), (torch.float16, 11, 2050.0),
                                 (torch.float32, 24, 2.0**24 + 2)):
        rows, index = _inputs("sum", 5, dtype)
        assert known_answers.bits_of(dtype) == bits
        rounding = index % recipe.ROUNDING_EVERY == recipe.ROUNDING_EVERY - 1
        total = _ring(rows, 0, torch.add)[rounding]
        assert torch.all(total == nearest) and nearest - 2 != nearest  # truncation would give 2**bits


@pytest.mark.parametrize("op", ["max", "min", "product"])
def test_other_reductions_are_exact_in_any_order(op):
    for world in (2, 3, 7, 8, 9, 13, 14, 72, 257, 4096):
        rows, index = _inputs(op, world, torch.bfloat16)
        want = recipe.exact(op, world, index).to(torch.bfloat16)
        assert torch.equal(_ring(rows, 1, COMBINE[op]), want), world
        assert torch.equal(_tree(rows, COMBINE[op]), want), world


def test_averages_are_exact_at_powers_of_two_and_within_tolerance_elsewhere():
    """NCCL scales each input by 1/world in the dtype, then sums (ncclAvg as a pre-multiplied sum)."""
    eps = torch.finfo(torch.bfloat16).eps
    for world in (2, 3, 36, 37, 72, 100, 256, 1000, 4096):
        rows, index = _inputs("avg", world, torch.bfloat16)
        scaled = rows * torch.tensor(1 / world, dtype=torch.bfloat16)
        want = recipe.exact("avg", world, index)
        found = _ring(scaled, 0, torch.add).double()
        error = (found - want).abs() / (eps * want.abs().clamp(min=1))
        assert error.max() <= recipe.average_tolerance_ulps(world), (world, float(error.max()))
        if recipe.average_is_exact(world):
            assert torch.equal(found, want.to(torch.bfloat16).double()), world


def test_every_world_size_up_to_4096_keeps_every_partial_sum_exact():
    """All 4095 world sizes, order-free: sum inputs are whole numbers >= 0 outside the rounding elements, so every
    partial sum in any order lies between 0 and the element's total; totals <= 256 make every one exact in bf16."""
    for world in range(2, 4097):
        index = np.arange(7 * recipe.sparsity(world))  # one period of the pattern
        total = recipe.exact("sum", world, index)
        assert total.max() <= 2**8, (world, total.max())
        assert total.min() >= 1 or world > recipe.CONTRIBUTORS, world
        for rank in (0, world // 2, world - 1):  # every rank contributes somewhere in each period
            assert recipe.contribution("sum", rank, world, index).max() >= 1, (world, rank)


def test_gemm_check_passes_a_right_kernel_and_catches_a_wrong_element(monkeypatch):
    cpu = torch.device("cpu")
    assert gpu_proof.gemm_known_answer_problem(cpu, n=512) == ""
    real = torch.matmul

    def one_wrong_element(a, b, *, out=None):
        result = real(a, b, out=out)
        result[100, 7] += 1
        return result

    monkeypatch.setattr(torch, "matmul", one_wrong_element)
    problem = gpu_proof.gemm_known_answer_problem(cpu, n=512)
    assert "wrong elements in 1 of 512 rows" in problem and "first row 100" in problem


def test_first_mismatch_reports_index_and_values():
    want = torch.arange(10, dtype=torch.float32)
    found = want.clone()
    found[7] += 1
    bad = known_answers.first_mismatch(found, want)
    assert (bad.index, bad.found, bad.expected, bad.wrong) == (7, 8.0, 7.0, 1)


def test_the_ring_harness_catches_the_old_dense_inputs_at_72_ranks():
    """Every rank giving 1..7 at every index (the recipe before sparsity) is exact only to 36 ranks: at 72 the
    harness must find bf16 sums that rounded (issue 18 measured 1,755 of 4,097 elements)."""
    index, ranks = torch.arange(4097, dtype=torch.float64), torch.arange(72, dtype=torch.float64)[:, None]
    dense = ((index[None, :] + 3 * ranks) % 7 + 1).to(torch.bfloat16)
    wrong = int((_ring(dense, 0, torch.add).double() != dense.double().sum(0)).sum())
    assert wrong > 1000, wrong
