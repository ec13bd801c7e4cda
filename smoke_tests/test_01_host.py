"""The host around the GPUs: shared memory for NCCL and DataLoader workers."""

import os

import pytest

from stackproof.judge import hardware
from stackproof.judge.findings import Judged
from stackproof.judge.promise import FAST, Needs

pytestmark = pytest.mark.check(FAST, Needs())
MiB = 1 << 20


def test_dev_shm_is_large_enough(report, settings):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this system")
    stats = os.statvfs("/dev/shm")
    size = stats.f_blocks * stats.f_frsize
    report.figure("dev_shm", round(size / MiB), "MiB")
    return Judged(hardware.shm_too_small(size, settings.min_shm), hint=hardware.SHM_FIX)
