"""What cross-rank agreement costs as the world grows: W ranks (threads, each with its own store connection,
as real ranks have) against one TCPStore, agreeing on a check's outcome as the plugin does after every check.

    python benchmarks/sync.py                 # W = 16, 64, 256, 1024
    python benchmarks/sync.py --worlds 8 64 --syncs 20

Prints one row per world size: the cost of one agreement (each rank hands in the outcomes of one module of
checks, as the plugin does) and of a whole run's agreements (one per module of the suite, plus start-up and
end, counted from the suite itself), and the part that is rank 0's alone: from its own arrival until every
rank's value is in the store ("all in"), then reading them, deciding and posting the answer ("rank 0"). The
rest is the threads of this one process waking to read the answer, which real ranks (processes on many hosts)
do in parallel: at thousands of threads on a few cores it dominates. Figures, not a test: a 2-core machine's
timings vary with whatever else runs.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist

from stackproof.judge import consensus
from stackproof.judge.findings import Finding
from stackproof.run.dist import DistEnv

FINDING = Finding(3, "GPU-8c1e0f9a-...", "collectives::all_reduce[sum-float32]", "the known answer", "index 7: 6.0, "
                  "expected 5.0", "interconnect", "isolate", "check the driver/NCCL pair", pci_bus_id="0000:19:00.0",
                  source="collectives::all_reduce[sum-float32]")


def suite_shape() -> tuple[int, int]:
    """(agreements in one full run, checks per agreement): one per module of checks, one at start-up
    (identity), one before exit (the report)."""
    import subprocess

    suite = Path(__file__).resolve().parents[1] / "smoke_tests"
    out = subprocess.run([sys.executable, "-c", "import pytest, sys; sys.exit(pytest.main(["
                          f"{str(suite)!r}, '--collect-only', '-q', '-p', 'no:cacheprovider', "
                          "'--noconftest', '-o', 'addopts=']))"],
                         capture_output=True, text=True, timeout=300).stdout
    checks = [line.split("::")[0] for line in out.splitlines() if "::" in line]
    modules = len(set(checks))
    return modules + 2, -(-len(checks) // modules)


class TimedRankZero(DistEnv):
    """Rank 0, with the time until every value is in and the time it then takes to answer, per agreement."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.parts: list[tuple[float, float]] = []

    def _decide(self, prefix, mine, decide):
        begin = time.perf_counter()
        keys = [prefix + str(r) for r in range(1, self.world_size)]
        self.store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
        arrived = time.perf_counter()
        answer = super()._decide(prefix, mine, decide)
        self.parts.append((arrived - begin, time.perf_counter() - arrived))
        return answer


def measure(world: int, syncs: int, checks: int, failing_ranks: int = 0) -> tuple[list[float], list[tuple]]:
    timeout = datetime.timedelta(seconds=600)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    envs = [(TimedRankZero if rank == 0 else DistEnv)(
        rank, world, dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout), 600.0)
        for rank in range(world)]
    start_line = threading.Barrier(world + 1)
    durations: list[float] = []

    def rank_main(env: DistEnv) -> None:
        # As run/plugin.py posts them: a passing check carries no finding; a failing rank carries its own.
        failing = env.rank < failing_ranks
        mine = [{"nodeid": f"test_04_collectives.py::test_all_reduce[sum-{i}]",
                 "outcome": "failed" if failing else "passed", "message": "wrong data" if failing else "",
                 "figures": {"largest": {"value": 268435456, "unit": "B"}},
                 "findings": [FINDING.at(rank=env.rank, node=f"node{env.rank // 8}").to_json()] if failing else []}
                for i in range(checks)]

        def decide(values):
            return [consensus.joint_outcome([v[i] for v in values]) for i in range(checks)]

        for _ in range(syncs):
            start_line.wait()
            env.agree(mine, "a module's checks", decide)
            start_line.wait()

    threads = [threading.Thread(target=rank_main, args=(env,), daemon=True) for env in envs]
    for thread in threads:
        thread.start()
    for _ in range(syncs):
        start_line.wait()  # every rank arrives at once, as after a check
        begin = time.perf_counter()
        start_line.wait()  # every rank has the answer
        durations.append(time.perf_counter() - begin)
    for thread in threads:
        thread.join()
    return durations, envs[0].parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--syncs", type=int, default=10, help="agreements timed per world size (default 10)")
    parser.add_argument("--failing", type=int, default=0, metavar="N",
                        help="ranks whose checks all fail, each carrying its own finding (default 0: a healthy run)")
    args = parser.parse_args()
    per_run, checks = suite_shape()
    print(f"# one agreement = every rank posts the outcomes of {checks} checks, rank 0 reads all and answers; "
          f"{per_run} per run (modules + start-up + end)")
    print(f"# {'ranks':>6}  {'median':>9}  {'max':>9}  {'run total':>10}  {'all in':>9}  {'rank 0':>9}")
    print(f"# {'':>6}  {'(ms)':>9}  {'(ms)':>9}  {'(s)':>10}  {'(ms)':>9}  {'(ms)':>9}")
    for world in args.worlds:
        durations, parts = measure(world, args.syncs, checks, args.failing)
        median = statistics.median(durations)
        arrive, answer = (statistics.median(p[i] for p in parts) * 1e3 for i in (0, 1))
        print(f"  {world:>6}  {median * 1e3:>9.1f}  {max(durations) * 1e3:>9.1f}  {median * per_run:>10.2f}"
              f"  {arrive:>9.1f}  {answer:>9.1f}", flush=True)


if __name__ == "__main__":
    main()
