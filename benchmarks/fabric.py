"""How long the fast tier's network check takes on this host: reading every NIC from sysfs (stackproof/measure/
fabric.py) and judging its ports (stackproof/judge/fabric.py), the part a Prolog pays for (target: <= 0.2 s).

    python benchmarks/fabric.py [SYSFS_ROOT ...]     # default /sys and the test fixture tree
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from stackproof.judge import fabric as rules
from stackproof.measure import fabric

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "sysfs" / "fabric-2xhdr"
REPEATS = 50


def once(root: str) -> tuple[float, dict]:
    begin = time.perf_counter()
    found = fabric.read(root).to_json()
    rules.port_findings(found, rules.expectation(found, [], None), 3)
    return time.perf_counter() - begin, found


def main(roots: list[str]) -> None:
    print("# fabric read + judge, per call (median and max of 50), ms")
    print(f"# {'root':<60} {'median':>8} {'max':>8}  NICs")
    for root in roots:
        times, found = zip(*(once(root) for _ in range(REPEATS)), strict=True)
        print(f"  {root:<60} {statistics.median(times) * 1e3:8.3f} {max(times) * 1e3:8.3f}  "
              f"{rules.describe(found[0])}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["/sys", str(FIXTURE)])
