"""The pure halves of the training checks, without torch: the GEMM operands' exactness at every K class, the
3-D-parallel layout at several world sizes, the optimizers' reference against hand-computed steps, and the
attention verdict from recorded readings."""

import math

import numpy
import pytest

from stackproof.judge import attention, optimizers, parallel_groups
from stackproof.judge import known_answers as recipe


@pytest.mark.parametrize("bits", [8, 11, 24])  # bf16 (and fp8's bf16 output), fp16, fp32
@pytest.mark.parametrize("k", list(recipe.GEMM_K_CLASSES.values()))
def test_gemm_operands_keep_every_partial_sum_exact(k, bits):
    stride = recipe.gemm_stride(k, bits)
    rows, ks = numpy.arange(recipe.GEMM_ROWS)[:, None], numpy.arange(k)[None, :]
    a = recipe.gemm_a(rows, ks, stride)
    b = recipe.gemm_b(ks.T, numpy.arange(recipe.GEMM_ROWS)[None, :])
    assert set(numpy.unique(a)) <= {-1, 0, 1} and set(numpy.unique(b)) == {-1, 1}
    # any partial sum is bounded by the sum of |products|: a whole number no larger than 2**bits
    assert (numpy.abs(a) @ numpy.abs(b)).max() <= 2**bits
    # every row of A reaches into every stretch of K of `stride` elements: a lost K slice changes the answer
    assert all(numpy.abs(a[i]).reshape(-1)[: k - k % stride].reshape(-1, stride).sum(1).min() == 1
               for i in range(recipe.GEMM_ROWS))
    product = a @ b  # rows and columns all differ: a permuted or transposed operand shows
    assert len({tuple(row) for row in product}) == len({tuple(col) for col in product.T}) == recipe.GEMM_ROWS


@pytest.mark.parametrize(("world", "axis", "shape"), [
    (2, "tp", {"dp": 1, "pp": 1, "tp": 2}), (2, "pp", {"dp": 1, "pp": 2, "tp": 1}),
    (2, "dp", {"dp": 2, "pp": 1, "tp": 1}), (8, "pp", {"dp": 2, "pp": 2, "tp": 2}),
    (12, "tp", {"dp": 2, "pp": 2, "tp": 3}), (1, "dp", {"dp": 1, "pp": 1, "tp": 1}),
])
def test_mesh_shape_gives_the_axis_under_test_ranks(world, axis, shape):
    assert parallel_groups.mesh_shape(world, axis) == shape


def test_groups_partition_the_world_along_each_axis():
    shape = parallel_groups.mesh_shape(8, "tp")
    assert parallel_groups.groups("tp", shape) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert parallel_groups.groups("pp", shape) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert parallel_groups.groups("dp", shape) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert parallel_groups.pipeline_neighbours(0, shape) == (None, 2)
    assert parallel_groups.pipeline_neighbours(3, shape) == (1, None)
    index = numpy.arange(64)
    # a sum over the wrong ranks gives another answer at some index
    assert (parallel_groups.group_sum([0, 1], index) != parallel_groups.group_sum([0, 1, 2, 3], index)).any()
    assert (parallel_groups.group_sum([0, 1], index) != parallel_groups.group_sum([2, 3], index)).any()


def test_optimizer_references_follow_the_definitions():
    p, g = numpy.array([1.0]), [numpy.array([0.5]), numpy.array([-1.0])]
    sgd, _ = optimizers.reference("SGD", p, g)  # buf1 = 0.51, p1 = 0.949; buf2 = 0.9*0.51 - 0.99051
    buf2 = 0.9 * 0.51 + (-1.0 + 0.01 * 0.949)
    assert sgd[0] == pytest.approx(0.949 - 0.1 * buf2, rel=1e-15)
    adamw, moved = optimizers.reference("AdamW", p, g[:1])  # one step from zero state: lr * sign(g), decayed
    assert adamw[0] == pytest.approx(1.0 * (1 - 0.001) - 0.01 * 0.5 / (0.5 + 1e-8), rel=1e-12)
    assert moved[0] == pytest.approx(1.0 - adamw[0])
    adam, _ = optimizers.reference("Adam", p, g[:1])
    assert adam[0] == pytest.approx(1.0 - 0.01 * 0.51 / (0.51 + 1e-8), rel=1e-12)
    assert optimizers.bound(numpy.array([2.0]), numpy.array([0.0]), 2**-23)[0] == pytest.approx(
        optimizers.PARAM_ROUNDINGS * optimizers.STEPS * 2 * 2**-23)


def test_attention_verdict_tells_a_reading_from_a_wrong_answer():
    case = attention.Case("bfloat16", 64, 256, True)
    readings = [attention.Reading(case, worst={"out": 0.2, "dq": 0.5}),
                attention.Reading(attention.Case("float16", 256, 193, False), error="No available kernel. Aborting"),
                attention.Reading(attention.Case("float16", 64, 193, False), worst={"out": 3.0, "dv": math.nan},
                                  head={"out": 1, "dv": 0}),
                attention.Reading(attention.Case("float16", 128, 193, True), error="CUDA error: illegal address")]
    verdict = attention.judge(readings)
    assert verdict.ran == [str(case), "float16 d=64 seq=193 full"]
    assert verdict.not_served == ["float16 d=256 seq=193 full"]
    assert verdict.wrong == ["float16 d=64 seq=193 full: error / tolerance out 3x (head 1), dv nanx (head 0)",
                             "float16 d=128 seq=193 causal: CUDA error: illegal address"]
    assert attention.seq_lengths(128) == (256, 193)
    none = attention.judge([attention.Reading(case, error="No viable backend for scaled_dot_product_attention")])
    assert not none.ran and not none.wrong


def test_the_attention_cases_cover_every_pair_of_settings_at_a_fraction_of_the_product():
    from stackproof.judge import attention

    dims = (("float16", "bfloat16"), (64, 128, 256), (256, 193), (False, True))
    chosen = attention.cases(*dims[:3])
    rows = [(c.dtype, c.head_dim, c.seq, c.causal) for c in chosen]
    for i in range(4):
        for j in range(i + 1, 4):
            for a in dims[i]:
                for b in dims[j]:
                    assert any(r[i] == a and r[j] == b for r in rows), (i, a, j, b)
    assert len(chosen) == 6 < 24  # the fewest: the 2 dtypes x 3 head sizes need 6 cases on their own


def _float32_sum(terms) -> float:
    """The terms added one by one in float32 (the worst order for rounding error of the usual ones)."""
    total = numpy.float32(0)
    for term in terms.astype(numpy.float32):
        total = numpy.float32(total + term)
    return float(total)


def _step(world: int, offset: float):
    """Each rank's gradient a sum of 4096 terms (spread 1e-3 around `offset`), the reference step in float64 and
    the same step as a float32 rank makes it (its sum, DDP's mean, the update): (found, want, magnitude, grads)."""
    lr, param = 0.1, numpy.float32(0.25)
    rng = numpy.random.default_rng(world)
    shards = [(lambda t: t - t.mean() + offset)(rng.standard_normal(4096) * 1e-3) for _ in range(world)]
    grads = [math.fsum(terms) for terms in shards]
    want = float(param) - lr * math.fsum(grads) / world
    magnitude = sum(float(numpy.abs(terms).sum()) for terms in shards) / world
    mean32 = numpy.float32(sum(numpy.float32(_float32_sum(t) / world) for t in shards))
    return float(numpy.float32(param - numpy.float32(lr) * mean32)), want, magnitude, grads


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ddp_step_bound_scales_with_the_gradients_terms_not_their_sum(world):
    """A bias's gradient is a sum over batch and positions that cancels: its float32 error scales with the sum of
    |terms|, not with |sum| (a bound from |want| failed a healthy run: 2.5e-10 against 2.1e-10). A rank's float32
    sum of 4096 terms, DDP's mean and the step stay inside, where the old bound is 10x tighter; the ranks' sum
    instead of their mean, one rank's gradient alone and a kernel 1e-3 off stay outside."""
    eps, lr = float(numpy.finfo(numpy.float32).eps), 0.1
    found, want, magnitude, grads = _step(world, offset=1e-9)  # cancels to ~4e-6
    bound = recipe.ddp_step_bound(eps, world, lr, want, magnitude)
    assert abs(found - want) <= bound
    assert bound > 10 * (eps * abs(want) + lr * (world + 5) * eps * abs(math.fsum(grads) / world))

    found, want, magnitude, grads = _step(world, offset=1e-4)  # a gradient that does not cancel away
    bound = recipe.ddp_step_bound(eps, world, lr, want, magnitude)
    assert abs(found - want) <= bound
    wrongs = [0.25 - lr * math.fsum(grads), want - lr * 1e-3 * magnitude]  # summed; a kernel 1e-3 off
    wrongs += [0.25 - lr * grads[0] / world] if world > 1 else []  # one rank's gradient only
    for wrong in wrongs:
        if world > 1 or wrong != wrongs[0]:  # on one rank the sum is the mean
            assert abs(wrong - want) > bound, (wrong, want, bound)


def test_running_stat_bound_holds_a_float32_mean_near_zero_and_catches_a_doubled_momentum():
    eps, momentum = float(numpy.finfo(numpy.float32).eps), 0.1
    values = numpy.random.default_rng(0).standard_normal(2048)
    values -= values.mean()  # a mean near zero: all cancellation
    want = momentum * math.fsum(values) / len(values)
    magnitude = momentum * float(numpy.abs(values).mean())
    found = float(numpy.float32(momentum) * numpy.float32(_float32_sum(values) / len(values)))
    bound = recipe.running_stat_bound(eps, want, magnitude)
    assert abs(found - want) <= bound
    biased, unbiased = values.var(), values.var(ddof=1)  # the variance's buffer: 0.9 + 0.1 x the unbiased one
    want_var = (1 - momentum) + momentum * unbiased
    var_bound = recipe.running_stat_bound(eps, want_var, momentum * float((values ** 2).mean()) * 2048 / 2047)
    assert abs((1 - momentum) + momentum * float(numpy.float32(unbiased)) - want_var) <= var_bound
    assert abs((1 - momentum) + momentum * biased - want_var) > var_bound  # the biased variance shows
    assert abs((1 - 2 * momentum) + 2 * momentum * unbiased - want_var) > var_bound  # so does a doubled momentum
