"""Optimizers training uses (SGD with momentum, Adam, AdamW), each in its for-loop, foreach and fused form, a few
steps from a fresh state on the run's device against a float64 reference written from the algorithms' definitions
(stackproof/judge/optimizers.py), which shares no kernel with torch.optim. A form this torch and device lack is a
reading (skipped with torch's words), not a pass."""

import pytest
import torch

from stackproof.judge import optimizers as judged
from stackproof.judge.findings import Judged
from stackproof.judge.promise import FULL, Needs
from stackproof.measure import optimizers

pytestmark = pytest.mark.check(FULL, Needs())
# torch.optim's fused forms came to the CPU in torch 2.4 and to some optimizers later: a missing one is a reading.
FORMS = [pytest.param(form, marks=pytest.mark.check(FULL, Needs(), optional="older torches have no fused form of "
                                                    "every optimizer on every device")) if form == "fused" else form
         for form in judged.FORMS]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", judged.OPTIMIZERS)
def test_optimizer_step_equals_the_reference(name, form, dist_env, report):
    device = dist_env.device
    params, grads = optimizers.start()
    report.figure("settings", ", ".join(f"{k}={v}" for k, v in judged.SETTINGS[name].items()))
    try:
        found = optimizers.step(name, form, params, grads, device)
    except (RuntimeError, ValueError) as err:  # this torch has no such form on this device: a reading
        if form != "fused":
            raise
        pytest.skip(f"torch {torch.__version__} has no fused {name} on {device.type}: "
                    f"{str(err).strip().splitlines()[0][:300]}")
    worst, where = optimizers.worst_ratio(name, form, params, grads, found)
    report.figure("worst_error_over_tolerance", round(worst, 3))
    return Judged(judged.step_wrong(name, form, device.type, worst, where))
