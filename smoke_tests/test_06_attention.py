"""Attention known answers: scaled_dot_product_attention through each backend this torch and device offer (flash,
memory-efficient, cuDNN, math), forward and backward, causal and not, fp16 and bf16, head sizes 64 / 128 / 256 and
sequence lengths a multiple of the kernels' tiles and not, against a float64 reference computed on the CPU by
another path (stackproof/measure/attention.py), within a derived tolerance (stackproof/judge/attention.py).
A backend that serves no case here is a reading (skipped, with what sdpa said), not a pass. On CPU ranks the
CPU's backends (flash and math) run."""

import pytest
import torch

from stackproof.judge import attention as judged
from stackproof.judge import software
from stackproof.judge.findings import Judged
from stackproof.judge.promise import FULL, Needs
from stackproof.measure import attention

pytestmark = pytest.mark.check(FULL, Needs())

# GPU kernels tile the sequence by 64 or 128; the CPU's flash kernel by 16 or more. Small on CPU: CI's cost.
TILE_GPU, TILE_CPU = 128, 16
DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (64, 128, 256)
# The fused backends serve only what they were built for (flash and cuDNN: sm80+; none of the three on every CPU
# build): one that serves nothing here is a reading (skipped, sdpa's words), not an unfinished proof. Math always.
FUSED = "a fused attention backend serves only the GPU architectures, head sizes and dtypes it was built for"
BACKENDS = [pytest.param(name, marks=pytest.mark.check(FULL, Needs(), optional=FUSED)) if name != "math" else name
            for name in judged.BACKENDS]


@pytest.fixture(scope="module")
def references(dist_env):
    """Every case's inputs and float64 answer, made once for all backends."""
    tile = TILE_GPU if dist_env.is_gpu else TILE_CPU
    cases = judged.cases(DTYPES, HEAD_DIMS, judged.seq_lengths(tile))
    return {case: attention.reference(case, seed) for seed, case in enumerate(cases)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_gives_the_known_answer(backend, references, dist_env, report):
    device = dist_env.device
    library = f"sdpa {backend} backend (torch {torch.__version__}, {device.type})"
    readings = [attention.measure(backend, case, ref, device) for case, ref in references.items()]
    verdict = judged.judge(readings)
    report.figure("cases_ran", len(verdict.ran))
    report.figure("cases_not_served", len(verdict.not_served))
    report.figure("worst_error_over_tolerance", round(verdict.worst_ratio, 3))
    report.context(f"attention_{backend}", {"ran": verdict.ran, "not_served": verdict.not_served})
    if not verdict.ran and not verdict.wrong:
        pytest.skip(judged.not_served_reason(backend, readings))
    return Judged([software.known_answer(library, "scaled_dot_product_attention forward and backward",
                                         "the float64 reference within the derived tolerance", wrong)
                   for wrong in verdict.wrong], hint=judged.WRONG_ANSWER)
