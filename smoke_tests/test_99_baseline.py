"""The figures this run's earlier checks recorded, each rank's own, against --baseline (the median of the user's
known-good runs for this GPU model and topology): worse by more than the figure's tolerance fails, naming the
figure, what was found, the baseline and the rank's node and GPU. A baseline with no entry for this machine is bad
input (exit 2): it cannot pass, and it says nothing about the machine. Runs last, in every tier.
stackproof/judge/baseline.py judges."""

import pytest

from stackproof.judge import baseline as judge
from stackproof.judge.findings import Judged
from stackproof.judge.promise import FAST, Needs
from stackproof.report import baseline

# Not promised: a --baseline holds only the figures it has, and none given holds none.
pytestmark = pytest.mark.check(FAST, Needs(),
                               optional="no --baseline given, or it holds none of this run's figures")


def test_figures_hold_their_baseline(dist_env, settings, report):
    if not settings.baseline:
        pytest.skip("no --baseline given (make one from known-good runs: stackproof baseline REPORT... -o FILE)")
    known = baseline.load(settings.baseline)  # checked at start-up; read again here, on the rank that needs it

    def decide(_nothing):
        """On rank 0, which holds every rank's figures: what regressed, by rank."""
        run = report.so_far()
        data = run.to_json()
        key = judge.key_of(data)
        entry = judge.entry_for(known, key)
        if entry is None:
            return {"no_entry": f"--baseline {settings.baseline}: expected an entry for this run's machine "
                                f"({judge.key_text(key)}), found only: {judge.keys_text(known['entries'])}; fix: "
                                "make a baseline from known-good runs on this kind of machine (stackproof baseline "
                                "REPORT... -o FILE), or pass the baseline made for it"}
        compared, worse = judge.regressions(data, entry, settings.baseline_tolerance)
        return {"key": judge.key_text(key), "compared": compared,
                "worse": {str(rank): [f"{line} on {run.where(rank)}" for line in lines]
                          for rank, lines in worse.items()}}

    answer = dist_env.agree(None, "the baseline comparison", decide)
    if "no_entry" in answer:
        report.bad_input(answer["no_entry"])
        pytest.skip(answer["no_entry"])
    report.figure("compared", answer["compared"])
    report.figure("tolerance", "per figure" if settings.baseline_tolerance is None else settings.baseline_tolerance)
    report.figure("key", answer["key"])
    if not answer["compared"]:
        pytest.skip(f"this run measured none of the figures of {settings.baseline} ({answer['key']}); run the "
                    "checks the baseline was made from")
    gpu = dist_env.gpu_index
    return Judged(judge.worse_findings(answer["worse"].get(str(dist_env.rank), []), gpu), hint=judge.WORSE_FIX)
