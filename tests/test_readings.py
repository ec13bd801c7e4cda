"""Readings taken beside a rank's start-up (stackproof/run/readings.py): the GPU inventory a check gets from them
is the one it would have read itself, from the H200 recording replayed beneath stackproof (tests/nvml_replay);
an NVML that cannot start or count its GPUs is the same error, raised where the check waits; an NVML slower than
the wait leaves the check to read its own. No torch, no GPU."""

from __future__ import annotations

import threading

import pytest
from test_judge_health import SYSFS, answer, recorded, replay  # noqa: F401

from stackproof.measure import topology
from stackproof.run import readings

NVML_ERROR_DRIVER_NOT_LOADED, NVML_ERROR_UNKNOWN = 9, 999


def test_the_early_inventory_is_the_one_the_check_would_read(replay):  # noqa: F811
    replay(recorded())
    early = readings.Early(SYSFS)
    found = early.inventory(SYSFS)
    assert found == topology.inventory(SYSFS) and found.gpus and not found.unreachable
    early.close()


@pytest.mark.parametrize(("name", "gpu", "words"), [
    ("nvmlInit", None, "NVML could not start"),
    ("nvmlDeviceGetCount", None, "NVML started but cannot count the GPUs"),
])
def test_an_nvml_that_fails_early_fails_the_check_alike(replay, name, gpu, words):  # noqa: F811
    recording = recorded()
    answer(recording, name, {"_error": NVML_ERROR_DRIVER_NOT_LOADED}, gpu=gpu)
    replay(recording)
    with pytest.raises(topology.NvmlUnavailable, match=words) as direct:
        topology.inventory(SYSFS)
    with pytest.raises(topology.NvmlUnavailable) as early:
        readings.Early(SYSFS).inventory(SYSFS)
    assert str(early.value) == str(direct.value)


def test_a_gpu_nvml_cannot_reach_early_is_in_the_inventory_as_unreachable(replay):  # noqa: F811
    recording = recorded()
    answer(recording, "nvmlDeviceGetHandleByIndex", {"_error": NVML_ERROR_UNKNOWN}, [0], gpu=None)
    replay(recording)
    found = readings.Early(SYSFS).inventory(SYSFS)
    assert found == topology.inventory(SYSFS) and not found.gpus and 0 in found.unreachable


def test_an_nvml_slower_than_the_wait_leaves_the_check_to_read_its_own(replay, monkeypatch):  # noqa: F811
    nvml = replay(recorded())
    held, start = threading.Event(), nvml.nvmlInit

    def stuck_in_the_early_thread(*args):
        if threading.current_thread().name == "stackproof-readings":
            held.wait(60)  # as an NVML call stuck in the driver
        return start(*args)

    monkeypatch.setattr(nvml, "nvmlInit", stuck_in_the_early_thread)
    early = readings.Early(SYSFS)
    try:
        assert early.inventory(SYSFS, wait_s=0.2) == topology.inventory(SYSFS)
    finally:
        held.set()
