"""The process groups a 3-D-parallel job makes (data-, pipeline- and tensor-parallel, tensor innermost as
Megatron and torchtitan lay them out), derived from the world size, and the known answers of the collectives it
runs on them. Pure: ranks and index arrays in, ranks and values out (+ - * // % only, so tensors and numpy alike)."""

from __future__ import annotations

from stackproof.judge.findings import Finding, first_of

WRONG_ON_A_GROUP = ("a collective on a sub-group gave a wrong answer: the group's communicator (NCCL_* split "
                    "settings, ncclCommSplit), the driver/NCCL pair, or the link between these ranks")

AXES = ("dp", "pp", "tp")  # outermost first: rank = (dp_index * pp + pp_index) * tp + tp_index
VALUE_PERIOD = 13  # group_value is -6..6: a sum over up to 42 ranks (<= 252) is exact in bf16


def _primes(n: int) -> list[int]:
    found, p = [], 2
    while n > 1:
        while n % p == 0:
            found.append(p)
            n //= p
        p += 1
    return found


def mesh_shape(world: int, first: str) -> dict[str, int]:
    """Each axis's size: the world's prime factors, largest first, dealt round-robin to the axes starting with
    `first`, so the axis under test is never 1 on 2+ ranks (2 ranks: that axis is 2; 8 ranks: 2 x 2 x 2)."""
    order = [first, *(axis for axis in reversed(AXES) if axis != first)]
    shape = dict.fromkeys(AXES, 1)
    for i, prime in enumerate(sorted(_primes(world), reverse=True)):
        shape[order[i % len(order)]] *= prime
    return shape


def coordinates(rank: int, shape: dict[str, int]) -> dict[str, int]:
    return {"dp": rank // (shape["pp"] * shape["tp"]), "pp": rank // shape["tp"] % shape["pp"],
            "tp": rank % shape["tp"]}


def rank_of(coords: dict[str, int], shape: dict[str, int]) -> int:
    return (coords["dp"] * shape["pp"] + coords["pp"]) * shape["tp"] + coords["tp"]


def groups(axis: str, shape: dict[str, int]) -> list[list[int]]:
    """Every group along `axis` (the ranks that differ only in that coordinate), in one order every rank agrees on:
    each rank must create every group, its own or not."""
    world = shape["dp"] * shape["pp"] * shape["tp"]
    found: dict[tuple, list[int]] = {}
    for rank in range(world):
        coords = coordinates(rank, shape)
        key = tuple(coords[a] for a in AXES if a != axis)
        found.setdefault(key, []).append(rank)
    return list(found.values())


def group_value(rank, index):
    """What a rank contributes at `index`: -6..6, differing between ranks (13 apart) and neighbouring indices."""
    return (index + 5 * rank) % VALUE_PERIOD - VALUE_PERIOD // 2


def group_sum(members: list[int], index):
    """The exact sum over a group's members: a reduction over the wrong ranks (WORLD, another group) differs."""
    total = index * 0
    for rank in members:
        total = total + group_value(rank, index)
    return total


def pipeline_neighbours(rank: int, shape: dict[str, int]) -> tuple[int | None, int | None]:
    """The previous and next stage's rank in this rank's pipeline (None at either end)."""
    coords = coordinates(rank, shape)
    before = rank_of({**coords, "pp": coords["pp"] - 1}, shape) if coords["pp"] > 0 else None
    after = rank_of({**coords, "pp": coords["pp"] + 1}, shape) if coords["pp"] < shape["pp"] - 1 else None
    return before, after


def wrong_on_group(axis: str, members: list[int], rank: int, wrong: list, gpu_index: int | None) -> Finding:
    """The collectives of one axis's group that gave this rank a wrong answer (measure/parallel_groups.py's
    readings: what it was, its first wrong element (index, found, expected, wrong), the elements it gave): on the
    group's links or its communicator, for someone to look at."""
    said = first_of([f"{what}: {bad.wrong} of {count} elements wrong, first at index {bad.index}: found "
                     f"{bad.found}, expected {bad.expected}" for what, bad, count in wrong], 3)
    return Finding(gpu_index, "", f"collectives on the {axis} group", f"the known answer of each collective on "
                   f"group {members} at rank {rank}", said, "interconnect", "triage", WRONG_ON_A_GROUP)
