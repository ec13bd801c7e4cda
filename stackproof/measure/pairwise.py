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

Decision (pure functions below, unit-tested): a pair is slow below the bar; the bar is `--min-pair-gbps` (or the
NVML link's peak x --busbw-fraction inside a node), else the reference minus --pair-tolerance, where the
reference is the median over members of each member's best pair. (Not the median of all pairs: on 3 nodes a bad
node is in 2 of the 3 pairs and would drag the median down to its own level; a member's best pair is slow only
when the member itself is.) A member whose every pair is slow is a suspect; a second pass re-pairs each suspect
with a member that passed, and measures every other slow pair again. A suspect slow again is named (the node, or
the GPU); a slow pair whose members are both fine elsewhere, slow again, is named as a link. A suspect fine in its
re-test is not named, nor are its slow pairs (its own slowness then explains them); with no member that passed,
every slow pair is measured again. Nothing is named from one measurement, inside a node as across nodes.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from stackproof.measure import patterns

GB = 1e9
Pair = tuple[int, int]


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


def retest_rounds(suspects: Sequence[int], passing: Sequence[int]) -> list[list[Pair]]:
    """The second pass: each suspect paired with a member that passed, as rounds of disjoint pairs (a passing
    member serves one suspect per round). Empty when nobody passed: then nothing can be told apart."""
    if not passing:
        return []
    rounds: list[list[Pair]] = []
    for start in range(0, len(suspects), len(passing)):
        chunk = suspects[start:start + len(passing)]
        rounds.append(sorted((min(s, p), max(s, p)) for s, p in zip(chunk, passing, strict=False)))
    return rounds


def pack_rounds(pairs: Sequence[Pair]) -> list[list[Pair]]:
    """These pairs as few rounds of disjoint pairs as a greedy pass finds (the second pass's slow links)."""
    rounds: list[list[Pair]] = []
    for pair in sorted(pairs):
        home = next((r for r in rounds if not {m for p in r for m in p} & set(pair)), None)
        if home is None:
            rounds.append(home := [])
        home.append(pair)
    return rounds


def second_pass(figures: dict[Pair, float | None], bar: float | None) -> list[list[Pair]]:
    """What the second pass measures: each suspect against a member that passed, then every other slow pair again
    (a link is named only if it is slow twice: one slow measurement on a busy host is not a broken link). When no
    member passed, every slow pair is measured again: nothing is named from one measurement."""
    accused, passing = suspects(figures, bar)
    if not passing:
        return pack_rounds([p for p, g in figures.items() if is_slow(g, bar)])
    links = [p for p, g in figures.items() if is_slow(g, bar) and not set(p) & set(accused)]
    return retest_rounds(accused, passing) + pack_rounds(links)


def peer_in(round_pairs: Sequence[Pair], member: int) -> int | None:
    return next((b if a == member else a for a, b in round_pairs if member in (a, b)), None)


# --- the decision --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Bar:
    gbps: float | None
    source: str


def reference_gbps(figures: dict[Pair, float | None]) -> float | None:
    """Median over members of each member's best pair (None: a pair that never answered)."""
    best: dict[int, float] = {}
    for (a, b), gbps in figures.items():
        for member in (a, b):
            if gbps is not None:
                best[member] = max(best.get(member, 0.0), gbps)
    return statistics.median(best.values()) if best else None


def bar_for(figures: dict[Pair, float | None], tolerance: float, override: float | None, what: str) -> Bar:
    if override is not None:
        return Bar(override, "--min-pair-gbps")
    reference = reference_gbps(figures)
    if reference is None:
        return Bar(None, "no pair answered")
    if len({m for pair in figures for m in pair}) < 3:
        return Bar(None, f"2 {what}s: one pair is its own reference; pass --min-pair-gbps to judge it")
    return Bar(round(reference * (1 - tolerance), 3),
               f"{1 - tolerance:g} x {reference:.3f} GB/s (median over {what}s of each one's best pair; "
               "--pair-tolerance)")


def ratios(figures: dict[Pair, float | None], bars: dict[Pair, float]) -> dict[Pair, float | None]:
    """Each pair's figure as a fraction of its own bar (pairs judged each against its NVML link), or the figures
    as they are when there is no bar per pair."""
    if not bars:
        return dict(figures)
    return {p: None if g is None else g / bars[p] for p, g in figures.items()}


def is_slow(gbps: float | None, bar: float | None) -> bool:
    return gbps is None or (bar is not None and gbps < bar)


def suspects(figures: dict[Pair, float | None], bar: float | None) -> tuple[list[int], list[int]]:
    """(members whose every pair was slow, the others: members that passed at least once)."""
    members = sorted({m for pair in figures for m in pair})
    accused = [m for m in members if all(is_slow(g, bar) for pair, g in figures.items() if m in pair)]
    return accused, [m for m in members if m not in accused]


def localize(figures: dict[Pair, float | None], retests: dict[Pair, float | None], bar: float | None) -> dict:
    """The verdict from the first pass (every pair) and the second (each suspect against a member that passed):
    {"members": [named: every pair slow, the re-test too], "links": [slow pairs not explained by a named member],
    "unresolved": [slow pairs of suspects nobody could re-test: with no member that passed, a slow member and a
    slow link cannot be told apart], "silent": [pairs that never answered]}. A slow pair measured again in the
    second pass (second_pass) and fine there is not named, and neither is a slow pair of a suspect that was fine
    against a member that passed (that member's slowness, then, explains the pair)."""
    accused, passing = suspects(figures, bar)
    retested = {m: [g for pair, g in retests.items() if m in pair and set(pair) - {m} <= set(passing)]
                for m in accused}
    members = [m for m in accused if retested[m] and all(is_slow(g, bar) for g in retested[m])]
    cleared = {m for m in accused if retested[m] and m not in members}
    links, unresolved = [], []
    for pair, gbps in sorted(figures.items()):
        if not is_slow(gbps, bar) or set(members) & set(pair) or cleared & set(pair):
            continue
        if pair in retests and not is_slow(retests[pair], bar):
            continue  # slow once, fine when measured again
        (unresolved if any(m in accused and not retested[m] for m in pair) else links).append(pair)
    return {"members": members, "links": links, "unresolved": unresolved,
            "silent": sorted(pair for pair, gbps in {**figures, **retests}.items() if gbps is None)}


# --- the measurement -----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Exchange:
    peer: int
    seconds: float | None  # per exchange; None: the peer never answered within the timeout
    error: str = ""
    wrong: dict | None = None  # the first wrong byte received from the peer (patterns.WrongBytes' fields)


def exchange_seed(sender: int, receiver: int, salt: object = "") -> int:
    """The pattern `sender` sends `receiver`: each direction of each pair its own, so crossed or stale data
    shows."""
    return patterns.seed_of("send/recv", sender, receiver, salt)


def exchange(peer: int, nbytes: int, device: torch.device, warmup: int, iters: int, timeout_s: float,
             slow_down: float = 0.0, salt: object = "") -> Exchange:
    """nbytes to `peer` and nbytes from it at once, `iters` times after `warmup`, and what arrived from it
    checked once afterwards against the pattern the peer sent (exchange_seed). `slow_down` (a fault) makes this
    rank hold each send back by that many times a clean exchange's time after the warm-up (a fixed delay: both ends
    of a pair may be slowed, and a delay grown from the last exchange's time, which holds the peer's delay, would
    compound)."""
    count = max(2, nbytes // 4 // 2 * 2)  # whole 8-byte words of float32
    me = dist.get_rank()
    send = patterns.made(count * 4, exchange_seed(me, peer, salt), device, torch.float32)
    recv = torch.full_like(send, -1.0)  # not the pattern: an exchange that never delivered shows
    wait = datetime.timedelta(seconds=timeout_s)
    delay = 0.0

    def once() -> None:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)])
        for work in works:
            if device.type == "cuda":
                work.wait()  # NCCL: the process group's --timeout applies, the watchdog backs it
            elif not work.wait(wait):
                raise TimeoutError(f"no answer from rank {peer} within {timeout_s:.0f} s")
        if delay:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            time.sleep(delay)

    try:
        for _ in range(warmup):
            once()
        # One more exchange on both sides (the same count everywhere), after the warm-up has set the connection
        # up: a slowed rank's yardstick.
        begin = time.perf_counter()
        once()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        delay = slow_down * (time.perf_counter() - begin)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                once()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3 / iters
        else:  # CPU ranks share cores with everything else: the median exchange, not the mean, is the link's
            times = []
            for _ in range(iters):
                begin = time.perf_counter()
                once()
                times.append(time.perf_counter() - begin)
            seconds = statistics.median(times)
    except (RuntimeError, TimeoutError) as err:
        return Exchange(peer, None, f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
    wrong = patterns.first_wrong(recv, exchange_seed(peer, me, salt))
    return Exchange(peer, seconds, wrong=None if wrong is None else dataclasses.asdict(wrong))


def run_rounds(rounds: Sequence[Sequence[Pair]], me: int, rank_of: Callable[[int], int],
               measure: Callable[[int], Exchange], barrier: Callable[[], None]) -> list[Exchange]:
    """This rank's part of every round (rounds of members; `rank_of(member)` is the rank this rank meets there):
    one exchange per round it is in, a barrier before the first and after each so that a round's pairs run
    together (and NCCL's first send/recv finds every rank's communicator up)."""
    mine = []
    barrier()
    for pairs in rounds:
        peer = peer_in(pairs, me)
        if peer is not None:
            mine.append(measure(rank_of(peer)))
        barrier()
    return mine


def pair_figures(exchanges_by_rank: Sequence[Sequence[dict]], member_of: Callable[[int], int],
                 nbytes: int) -> tuple[dict[Pair, float | None], dict[Pair, list[dict]]]:
    """Every rank's exchanges ({"peer", "seconds", "error"}) -> per member pair, the bandwidth of its slowest rank
    pair (None if any rank pair never answered), and the rank pairs behind it (rails)."""
    rails: dict[Pair, dict[tuple[int, int], dict]] = {}
    for rank, exchanges in enumerate(exchanges_by_rank):
        for ex in exchanges:
            a, b = member_of(rank), member_of(ex["peer"])
            if a == b:
                continue
            pair, ranks = (min(a, b), max(a, b)), (min(rank, ex["peer"]), max(rank, ex["peer"]))
            entry = rails.setdefault(pair, {}).setdefault(ranks, {"ranks": list(ranks), "seconds": 0.0,
                                                                  "error": ""})
            if ex["seconds"] is None or entry["seconds"] is None:
                entry["seconds"], entry["error"] = None, entry["error"] or ex.get("error", "") or "no answer"
            else:
                entry["seconds"] = max(entry["seconds"], ex["seconds"])
    figures: dict[Pair, float | None] = {}
    by_pair: dict[Pair, list[dict]] = {}
    for pair, entries in rails.items():
        rows = [{**e, "gbps": None if e["seconds"] is None else nbytes / e["seconds"] / GB} for e in entries.values()]
        by_pair[pair] = sorted(rows, key=lambda r: r["ranks"])
        figures[pair] = None if any(r["gbps"] is None for r in rows) else min(r["gbps"] for r in rows)
    return figures, by_pair


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
