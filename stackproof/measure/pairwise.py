"""Which GPU pair, node or link is slow: bandwidth between pairs of ranks, scheduled round-robin, and the decision
that turns the pairs' figures into names.

Schedule: the circle method. With m members (GPUs of a node, or nodes) there are m-1 rounds (m rounds when m is
odd: one member sits each round out); every pair meets exactly once and a member is in one pair per round, so all
pairs of a round run at once. Inside a node the members are local ranks (every node runs its own rounds at the same
time); across nodes the members are nodes, and node a meets node b as local rank k of a <-> local rank k of b, for
every k at once (each rail).

Figure: each pair exchanges `nbytes` both ways at once (send/recv, batch_isend_irecv), `iters` times after warm-up;
bandwidth = nbytes / time per exchange, GB = 1e9 B, per direction while both directions run. Both ranks time it
(on GPU the mean over the iterations, with CUDA events; on CPU the median iteration, since CPU ranks share cores)
and the pair's time is the slower of the two.

The decision (bars, the second pass, names) is stackproof/judge/pairwise.py's.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from stackproof.judge.pairwise import (  # noqa: F401 (the decision, re-exported for the checks' one import)
    GB,
    Bar,
    Pair,
    bar_for,
    is_slow,
    localize,
    pack_rounds,
    pair_figures,
    ratios,
    reference_gbps,
    retest_rounds,
    second_pass,
    suspects,
)
from stackproof.measure import fabric, patterns

# --- the schedule --------------------------------------------------------------------------------------------

def round_robin(members: int) -> list[list[Pair]]:
    """Every pair of range(members) once, as rounds of disjoint pairs (circle method); pairs are (low, high)."""
    if members < 2:
        return []
    slots = list(range(members)) + ([None] if members % 2 else [])
    rounds = []
    for _ in range(len(slots) - 1):
        half = len(slots) // 2
        pairs = [(a, b) for a, b in zip(slots[:half], reversed(slots[half:]), strict=True)
                 if a is not None and b is not None]
        rounds.append(sorted((min(a, b), max(a, b)) for a, b in pairs))
        slots = [slots[0], slots[-1], *slots[1:-1]]  # member 0 stays, the others turn
    return rounds


def peer_in(round_pairs: Sequence[Pair], member: int) -> int | None:
    return next((b if a == member else a for a, b in round_pairs if member in (a, b)), None)


# --- the measurement -----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Exchange:
    peer: int
    seconds: float | None  # per exchange; None: the peer never answered within the timeout
    error: str = ""
    wrong: dict | None = None  # the first wrong byte received from the peer (patterns.WrongBytes' fields)
    # TCP segments this rank's network namespace sent, and sent again because they were lost, while it exchanged
    # (gloo and NCCL's sockets ride TCP; other ranks of the node are in the same round with the same peer node);
    # None: unknown.
    tcp_sent: int | None = None
    tcp_retransmitted: int | None = None


def exchange_seed(sender: int, receiver: int, salt: object = "") -> int:
    """The pattern `sender` sends `receiver`: each direction of each pair its own, so crossed or stale data
    shows."""
    return patterns.seed_of("send/recv", sender, receiver, salt)


def exchange(peer: int, nbytes: int, device: torch.device, warmup: int, iters: int, timeout_s: float,
             slow_down: int = 0, salt: object = "") -> Exchange:
    """nbytes to `peer` and nbytes from it at once, `iters` times after `warmup`, and what arrived from it
    checked once afterwards against the pattern the peer sent (exchange_seed). `slow_down` (a fault, the same on
    both ends) makes each exchange move the data that many more times: the pair is that much slower under
    whatever else the host does at the moment."""
    count = max(2, nbytes // 4 // 2 * 2)  # whole 8-byte words of float32
    me = dist.get_rank()
    send = patterns.made(count * 4, exchange_seed(me, peer, salt), device, torch.float32)
    recv = torch.full_like(send, -1.0)  # not the pattern: an exchange that never delivered shows
    wait = datetime.timedelta(seconds=timeout_s)

    def once() -> None:
        for _ in range(1 + slow_down):
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)])
            for work in works:
                if device.type == "cuda":
                    work.wait()  # NCCL: the process group's --timeout applies, the watchdog backs it
                elif not work.wait(wait):
                    raise TimeoutError(f"no answer from rank {peer} within {timeout_s:.0f} s")

    before = fabric.tcp_segments()
    try:
        for _ in range(warmup):
            once()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                once()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3 / iters
        else:
            # CPU ranks share cores with everything else: an exchange waits for a core as long as the host's other
            # work keeps it, whatever the link, so the fastest is the link's (as the stragglers' best arrival).
            times = []
            for _ in range(iters):
                begin = time.perf_counter()
                once()
                times.append(time.perf_counter() - begin)
            seconds = min(times)
    except (RuntimeError, TimeoutError) as err:
        return Exchange(peer, None, f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
    after = fabric.tcp_segments()
    tcp = after.since(before) if after and before else None
    wrong = patterns.first_wrong(recv, exchange_seed(peer, me, salt))
    return Exchange(peer, seconds, wrong=None if wrong is None else dataclasses.asdict(wrong),
                    tcp_sent=tcp.sent if tcp else None, tcp_retransmitted=tcp.lost if tcp else None)


# CPU ranks: the schedule runs this many times, each pair's exchanges shared among the sweeps.
CPU_SWEEPS = 4


def sweeps_of(device: torch.device, iters: int) -> int:
    """How many times the whole schedule runs, each pair's `iters` exchanges shared among them. GPUs: once.
    CPU ranks: CPU_SWEEPS, so that every pair is measured across the whole pass; in one block per pair, a clean
    pair measured in a burst of the host's other work read 6x slower than a pair measured calm, and a 10x-slowed
    node passed (issue 36 item 15). Not one exchange per sweep: the first after a barrier waits for the peer's
    wake-up (2-3 ms on a loaded host, 10x a 1 MiB loopback exchange) and hid a slowed link."""
    return 1 if device.type == "cuda" else max(1, min(CPU_SWEEPS, iters))


def merged(sweeps: Sequence[Exchange]) -> Exchange:
    """One pair's sweeps as one exchange: the fastest (CPU ranks: the others waited for a core), the first
    error and wrong byte, TCP's counts summed."""
    failed = next((ex for ex in sweeps if ex.seconds is None), None)
    wrong = next((ex.wrong for ex in sweeps if ex.wrong), None)
    counted = all(ex.tcp_sent is not None and ex.tcp_retransmitted is not None for ex in sweeps)
    return Exchange(sweeps[0].peer, None if failed else min(ex.seconds for ex in sweeps),  # type: ignore[type-var]
                    failed.error if failed else "", wrong,
                    sum(ex.tcp_sent for ex in sweeps) if counted else None,  # type: ignore[misc]
                    sum(ex.tcp_retransmitted for ex in sweeps) if counted else None)  # type: ignore[misc]


def run_rounds(rounds: Sequence[Sequence[Pair]], me: int, rank_of: Callable[[int], int],
               measure: Callable[[int, int], Exchange], barrier: Callable[[], None],
               sweeps: int = 1) -> list[Exchange]:
    """This rank's part of every round (rounds of members; `rank_of(member)` is the rank this rank meets there),
    `sweeps` times over (measure(peer, sweep)): one exchange per round it is in, a barrier before the first and
    after each so that a round's pairs run together (and NCCL's first send/recv finds every rank's communicator
    up). A peer that never answered is not waited for again in a later sweep."""
    parts: list[list[Exchange]] = []
    barrier()
    for sweep in range(sweeps):
        mine = 0
        for pairs in rounds:
            peer = peer_in(pairs, me)
            if peer is not None:
                if sweep == 0:
                    parts.append([measure(rank_of(peer), sweep)])
                elif parts[mine][0].seconds is not None:
                    parts[mine].append(measure(rank_of(peer), sweep))
                mine += 1
            barrier()
    return [merged(part) for part in parts]


# --- the contract ---------------------------------------------------------------------------------------------

def format_matrix(labels: Sequence[str], figures: dict[Pair, float | None], header: str) -> str:
    """nvbandwidth's square matrix (row -> column, GB/s), with nccl-tests' conventions: units in the header,
    '#' before every line that is not data; 'N/A' where a pair never answered, '-' on the diagonal."""
    width = max(9, *(len(label) for label in labels))
    lines = [f"# {header}", "# " + f"{'(GB/s)':>{width}}" + "".join(f"  {label:>{width}}" for label in labels)]
    for i, row in enumerate(labels):
        cells = []
        for j in range(len(labels)):
            if i == j:
                cells.append("-")
                continue
            gbps = figures.get((min(i, j), max(i, j)), "absent")
            cells.append("N/A" if gbps is None else "" if gbps == "absent" else f"{gbps:.2f}")
        lines.append("  " + f"{row:>{width}}" + "".join(f"  {cell:>{width}}" for cell in cells))
    return "\n".join(lines)
