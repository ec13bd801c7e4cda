"""The data-, pipeline- and tensor-parallel process groups of stackproof/judge/parallel_groups.py, made with
dist.new_group (every rank makes every group, in one order), and the collectives a 3-D-parallel job runs on them."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from stackproof.judge import parallel_groups as layout
from stackproof.measure.known_answers import Mismatch, first_mismatch

COUNTS = (4097, (1 << 16) + 3)  # odd: no vector width divides them


def my_group(axis: str, shape: dict[str, int], rank: int, timeout_s: float):
    """This rank's group along `axis` and its members (global ranks); the other groups are made and dropped."""
    mine = None
    for members in layout.groups(axis, shape):
        group = dist.new_group(members, timeout=datetime.timedelta(seconds=timeout_s))
        if rank in members:
            mine = (group, members)
    return mine


def values(rank: int, count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return layout.group_value(rank, torch.arange(count, device=device, dtype=torch.float64)).to(dtype)


# A collective whose answer was wrong on this rank: (what it was, its first wrong element, the elements it gave).
Wrong = tuple[str, Mismatch, int]


def _wrong(what: str, found: torch.Tensor, want: torch.Tensor) -> list[Wrong]:
    bad = first_mismatch(found, want)
    return [] if bad is None else [(what, bad, want.numel())]


def all_reduce(group, members, rank, dtype, device) -> list[Wrong]:
    """Tensor parallelism's row-parallel layer output: a sum over the group only."""
    problems = []
    for count in COUNTS:
        tensor = values(rank, count, dtype, device)
        dist.all_reduce(tensor, group=group)
        want = layout.group_sum(members, torch.arange(count, device=device, dtype=torch.float64)).to(dtype)
        problems += _wrong(f"all_reduce sum of {count} {dtype} over {members}", tensor, want)
    return problems


def all_gather_reduce_scatter(group, members, rank, dtype, device) -> list[Wrong]:
    """Data parallelism under FSDP / ZeRO: parameters all-gathered, gradients reduce-scattered, in the group."""
    problems, size, index = [], len(members), members.index(rank)
    for count in COUNTS:
        mine = values(rank, count, dtype, device)
        gathered = torch.empty(count * size, dtype=dtype, device=device)
        dist.all_gather_into_tensor(gathered, mine, group=group)
        want = torch.cat([values(member, count, dtype, device) for member in members])
        problems += _wrong(f"all_gather of {count} {dtype} over {members}", gathered, want)
        full = values(rank, count * size, dtype, device)
        shard = torch.empty(count, dtype=dtype, device=device)
        dist.reduce_scatter_tensor(shard, full, group=group)
        positions = torch.arange(count * size, device=device, dtype=torch.float64)
        want = layout.group_sum(members, positions).to(dtype)[index * count:(index + 1) * count]
        problems += _wrong(f"reduce_scatter sum of {count * size} {dtype} over {members}, shard {index}", shard, want)
    return problems


def pipeline_send_recv(group, shape, rank, dtype, device) -> list[Wrong]:
    """Pipeline parallelism: activations to the next stage, then gradients back to the previous one, by
    batch_isend_irecv on the pipeline's group (peers named by global rank)."""
    problems = []
    before, after = layout.pipeline_neighbours(rank, shape)
    for count in COUNTS:
        for direction, (source, target) in (("forward", (before, after)), ("backward", (after, before))):
            ops, received = [], None
            if target is not None:
                ops.append(dist.P2POp(dist.isend, values(rank, count, dtype, device), target, group))
            if source is not None:
                received = torch.zeros(count, dtype=dtype, device=device)
                ops.append(dist.P2POp(dist.irecv, received, source, group))
            for work in dist.batch_isend_irecv(ops) if ops else []:
                work.wait()
            if received is not None:
                problems += _wrong(f"{direction} send/recv of {count} {dtype} from rank {source} to rank {rank}",
                                   received, values(source, count, dtype, device))
    return problems
