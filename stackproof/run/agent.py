"""torchrun, run in this process (torch.distributed.run), so that a rank that dies is known by number and
exit code, not only from torchrun's log: `python -m stackproof.run.agent REPORTS_DIR [torchrun args]`.
The launcher and scripts/torchrun start it; it records the failures in report.json (settle.settle)."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

from stackproof.errors import Exit
from stackproof.run import settle


def main(argv: list[str]) -> int:
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import get_args_parser, run

    # torchrun's own warnings and failure summaries: what they say, the verdict says with the rank's name.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    reports, torchrun_args = Path(argv[0]), argv[1:]
    try:
        run(get_args_parser().parse_args(torchrun_args))
    except (SignalException, KeyboardInterrupt) as err:  # the launcher says "interrupted" in the verdict
        signum = getattr(err, "sigval", signal.SIGINT)
        return 128 + int(signum)
    except (RendezvousError, DistError, TimeoutError) as err:  # some node never joined: nothing ran here
        why = f"the rendezvous did not complete: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        report = settle.settle(reports, launcher_exit=1, rendezvous=why)
        return int(report.exit_code)
    except ChildFailedError as err:
        failures = [{"rank": rank, "local_rank": f.local_rank, "exitcode": f.exitcode, "pid": f.pid}
                    for rank, f in sorted(err.failures.items())]
        return int(settle.settle(reports, launcher_exit=1, failures=failures).exit_code) or Exit.INCOMPLETE
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
