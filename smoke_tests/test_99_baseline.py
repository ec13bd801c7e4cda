"""The figures this run's earlier checks recorded, each rank's own, against --baseline (the median of the user's
known-good runs for this GPU model and topology): more than --baseline-tolerance worse fails, naming the figure,
what was found, the baseline and the rank's node and GPU. Runs last, in every tier."""

import pytest

from stackproof.suite import baseline
from stackproof.suite.plugin import REPORT_KEY

pytestmark = [pytest.mark.fast]


def test_figures_hold_their_baseline(request, dist_env, settings, report):
    if not settings.baseline:
        pytest.skip("no --baseline given (make one from known-good runs: stackproof baseline REPORT... -o FILE)")
    known = baseline.load(settings.baseline)  # checked at start-up; read again here, on the rank that needs it

    def decide(_nothing):
        """On rank 0, which holds every rank's figures: what regressed, by rank."""
        run = request.config.stash[REPORT_KEY]
        data = run.to_json()
        key = baseline.key_of(data)
        entry = baseline.entry_for(known, key)
        if entry is None:
            return {"skip": f"{settings.baseline} has no entry for this run ({baseline.key_text(key)}); it has: "
                            f"{baseline.keys_text(known['entries'])}"}
        compared, worse = baseline.regressions(data, entry, settings.baseline_tolerance)
        return {"key": baseline.key_text(key), "compared": compared,
                "worse": {str(rank): [f"{line} on {run.where(rank)}" for line in lines]
                          for rank, lines in worse.items()}}

    answer = dist_env.agree(None, "the baseline comparison", decide)
    if "skip" in answer:
        pytest.skip(answer["skip"])
    report.figure("compared", answer["compared"])
    report.figure("tolerance", settings.baseline_tolerance)
    report.figure("key", answer["key"])
    if not answer["compared"]:
        pytest.skip(f"this run measured none of the figures of {settings.baseline} ({answer['key']}); run the "
                    "checks the baseline was made from")
    report.classify("performance", "triage")
    report.hint("a figure fell below the machine's own known-good runs: compare the node's GPUs, links and clocks "
                "with a good node; if the change is intended (new image, new driver), make the baseline again")
    mine = answer["worse"].get(str(dist_env.rank), [])
    assert not mine, "; ".join(mine)
