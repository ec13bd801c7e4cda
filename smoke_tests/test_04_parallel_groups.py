"""Collectives on the sub-groups of a 3-D-parallel job: the world laid out as data x pipeline x tensor parallel
(stackproof/judge/parallel_groups.py derives the shape from the world size: on 2 ranks the axis under test is 2,
on 8 ranks 2 x 2 x 2), each group made with dist.new_group, and the collectives each axis runs checked against
known answers: all_reduce within tensor parallelism, send/recv along the pipeline both ways, all_gather and
reduce_scatter within data parallelism. A sum over the wrong ranks gives another answer, not just a wrong one."""

import pytest
import torch

from stackproof.judge import parallel_groups as layout
from stackproof.judge.findings import Judged
from stackproof.judge.promise import FULL, Needs
from stackproof.measure import parallel_groups as groups

DTYPES = (torch.float32, torch.bfloat16)


# The mesh's shape comes from the world size: any 2+ ranks.
@pytest.mark.check(FULL, Needs(ranks=2))
@pytest.mark.parametrize("axis", ["tp", "pp", "dp"])
def test_collectives_on_sub_groups(axis, dist_env, report):
    rank, device = dist_env.rank, dist_env.device
    shape = layout.mesh_shape(dist_env.world_size, axis)
    group, members = groups.my_group(axis, shape, rank, dist_env.timeout_s)
    report.figure("mesh", " x ".join(f"{name} {shape[name]}" for name in layout.AXES))
    report.figure("group", ",".join(map(str, members)))
    problems = []
    for dtype in DTYPES:
        if dtype == torch.bfloat16 and len(members) * (layout.VALUE_PERIOD // 2) > 256:
            continue  # the group's sum would leave bf16's whole numbers
        if axis == "tp":
            problems += groups.all_reduce(group, members, rank, dtype, device)
        elif axis == "pp":
            problems += groups.pipeline_send_recv(group, shape, rank, dtype, device)
        else:
            problems += groups.all_gather_reduce_scatter(group, members, rank, dtype, device)
    if dist_env.is_gpu:
        torch.cuda.synchronize(device)
    gpu = dist_env.gpu_index
    return Judged([layout.wrong_on_group(axis, members, rank, problems, gpu)] if problems else [],
                  hint=layout.WRONG_ON_A_GROUP)
