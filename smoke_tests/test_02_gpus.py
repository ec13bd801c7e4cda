"""GPU visibility and capability: what the PCI bus, NVML and torch see, what was expected, that every GPU has
what it should (its NVLinks and PCIe lanes, and what its peers have), and that every GPU computes."""


import pytest
import torch

from stackproof import environment
from stackproof.judge import expectation, hardware, per_gpu, sharing, software
from stackproof.judge.findings import Judged
from stackproof.judge.promise import FAST, Needs
from stackproof.measure import nics, topology

pytestmark = pytest.mark.check(FAST, Needs(gpu=True))


@pytest.fixture(scope="module")
def inventory(settings, early_readings):
    try:  # read beside the rank's start-up (run/readings.py), or here when that is late
        return early_readings.inventory(settings.pci_devices)
    except topology.NvmlUnavailable as err:
        pytest.fail(f"torch sees a GPU but NVML does not: {err}; fix: run the container with "
                    "NVIDIA_DRIVER_CAPABILITIES including utility (stackproof images set compute,utility)")


@pytest.fixture(scope="module")
def visible(inventory):
    return topology.visible(inventory, topology.cuda_visible_devices())


def test_torch_sees_the_expected_gpus(inventory, visible, settings, report):
    count = torch.cuda.device_count()
    bus = topology.nvidia_gpus_on_bus(settings.pci_devices)
    expected = expectation.expected_gpus(settings.expect_gpus, environment.current(), bus)
    report.figure("gpus", count)
    report.figure("names", ",".join(sorted({g.name for g in visible})))
    report.figure("driver", inventory.driver_version)
    report.context("driver", {"version": inventory.driver_version, "cuda": inventory.cuda_driver_version})
    report.context("nics", nics.survey())  # the node class's network half (stackproof attest)
    gone = topology.missing_from_nvml(bus or [], inventory) if expected.source == expectation.BUS else []
    return Judged(expectation.seen_findings(expected, count, len(visible), len(inventory.gpus), len(bus or []),
                                            environment.CUDA_VISIBLE_DEVICES.get(), gone),
                  hint=expectation.VISIBILITY_FIX)


def test_gpus_have_what_they_should(inventory, report):
    """Each GPU against what it should have: every NVLink it has up, and as many as its same-model peers; PCIe at
    its own max width (and a slot that allows its own max generation); the memory and max clocks of its peers;
    and NVML able to reach it."""
    findings = [hardware.unreachable(index, error) for index, error in inventory.unreachable.items()]
    for gpu in inventory.gpus:
        findings += hardware.findings(gpu, inventory.gpus)
    for gpu in inventory.gpus:
        report.figure(f"gpu{gpu.index}", f"NVLink {gpu.nvlink_active}/{gpu.nvlink_supported}; PCIe "
                                         f"x{gpu.pcie_width_current} of x{gpu.pcie_width_gpu_max or gpu.pcie_width}")
    return Judged(findings,
                  hint="act on each finding's fix; nvidia-smi topo -m and nvidia-smi nvlink -s show the links")


def test_driver_supports_the_image_cuda(inventory, report):
    built = torch.version.cuda
    driver = inventory.cuda_driver_version
    report.figure("torch_cuda", built)
    report.figure("driver_cuda", driver)
    if software.minor_version_compatible(built, driver):
        report.figure("note", f"CUDA minor-version compatibility: {built} on a {driver} driver")
    fix = f"install an NVIDIA driver that supports CUDA {built} (or use the image built for CUDA {driver})"
    return Judged(software.driver_too_old(built, driver, inventory.driver_version, fix), hint=fix)


def test_every_gpu_computes(dist_env, report):
    """A matmul on small integers is exact in float32, so the GPU's answer must equal the CPU's bit for bit."""
    devices = ([dist_env.device] if dist_env.local_world_size >= torch.cuda.device_count()
               else [torch.device("cuda", i) for i in range(torch.cuda.device_count())])
    generator = torch.Generator().manual_seed(1234)
    a = torch.randint(-4, 5, (1024, 1024), generator=generator).float()
    b = torch.randint(-4, 5, (1024, 1024), generator=generator).float()
    want, found = a @ b, []
    for device in devices:
        wrong = int(((a.to(device) @ b.to(device)).cpu() != want).sum())
        if wrong:
            found.append(per_gpu.computes_wrong(device.index, str(torch.cuda.get_device_properties(device).uuid),
                                                "a float32 matmul of small integers against the CPU's",
                                                f"{wrong} of {want.numel()} elements differ"))
    report.figure("devices_checked", len(devices))
    return Judged(found, hint=per_gpu.COMPUTES_WRONG)



def test_torch_has_kernels_for_every_gpu(dist_env, report):
    """An image built without kernels for this GPU fails here as software-pins, not later as a GPU that
    'cannot compute' (CUDA error: no kernel image is available for execution on the device)."""
    arch_list = torch.cuda.get_arch_list()
    report.figure("arch_list", ",".join(arch_list))
    found = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        missing = software.arch_finding(arch_list, (props.major, props.minor), index, str(props.uuid), props.name)
        if missing is not None:
            found.append(missing)
    return Judged(found)


def test_no_two_ranks_share_a_gpu(dist_env, settings, report):
    """Two ranks on one GPU halve its figures and make stragglers of both: named here as the setup fault it is
    (judge/sharing.py), unless the nodes are emulated on one machine on purpose (--emulated-nodes)."""
    uuid = str(torch.cuda.get_device_properties(dist_env.device).uuid)
    every = dist_env.agree({"uuid": uuid, "node": dist_env.node}, "the ranks' GPUs", lambda values: values)
    uuids, nodes = [v["uuid"] for v in every], [v["node"] for v in every]
    shared = sharing.holders(uuids)
    report.figure("shared_gpus", len(shared))
    if shared and settings.emulated_nodes:
        report.figure("emulated", "yes: per-GPU figures measured once per GPU, stragglers weighed by ranks per GPU")
    return Judged(sharing.findings(uuids, nodes, dist_env.rank, dist_env.device.index, settings.emulated_nodes))
