"""One GPU's health history from NVML (nvidia-ml-py), as findings a fleet tool can act on.

Each finding names the GPU (index + UUID), what was expected, what was found, a category and a severity as
NVIDIA DCGM uses them (isolate: take the GPU out of service; reset: a GPU reset / reboot clears it; triage:
someone must look), and the action. NVML answering NotSupported means the GPU lacks the feature (an H200
remaps rows instead of retiring pages) and is no finding; any other NVML error is one ("n/a: NVML error X").
"""

from __future__ import annotations

import dataclasses
import time

from stackproof.judge.findings import RESET, RMA, Finding, worst  # noqa: F401 (worst: the checks' import)
from stackproof.suite import topology


@dataclasses.dataclass
class Checkup:
    findings: list[Finding]
    readings: dict[str, object]  # what NVML answered, for the report ("n/a" where not applicable)


def _nvml_error_finding(nvml, gpu: topology.Gpu, what: str, error: str) -> Finding:
    """An NVML call that failed: its error says how bad it is."""
    by_error = {
        f"NVML error {nvml.NVMLError(code)}": how for code, how in (
            (nvml.NVML_ERROR_GPU_IS_LOST, ("gpu-hardware", "isolate", "the GPU fell off the bus: " + RMA)),
            (nvml.NVML_ERROR_CORRUPTED_INFOROM, ("gpu-hardware", "isolate", "corrupted infoROM: " + RMA)),
            (nvml.NVML_ERROR_RESET_REQUIRED, ("gpu-hardware", "reset", RESET)))}
    category, severity, action = by_error.get(error, (
        "configuration", "triage", "give the container NVML access (NVIDIA_DRIVER_CAPABILITIES including utility) "
        "and check the driver (nvidia-smi -q): an NVML that cannot answer hides the GPU's health"))
    return Finding(gpu.index, gpu.uuid, what, "an answer from NVML", f"n/a: {error}", category, severity, action)


def clock_trouble(nvml, reasons: int | None) -> list[tuple[str, str]]:
    """(name, action) of each clock-event reason set in `reasons` that means the GPU is held back by heat or
    power, not by choice (idle, application clocks, a software power cap someone set)."""
    cooling = "check cooling (fans, airflow, inlet temperature)"
    trouble = {
        nvml.nvmlClocksEventReasonHwSlowdown: ("HW slowdown", "the board asserts slowdown (heat or power): "
                                               "check cooling and the power supplies"),
        nvml.nvmlClocksEventReasonHwThermalSlowdown: ("HW thermal slowdown", cooling),
        nvml.nvmlClocksEventReasonHwPowerBrakeSlowdown: ("HW power brake", "the system asserted the power brake: "
                                                         "check the power supplies and the chassis"),
        nvml.nvmlClocksEventReasonSwThermalSlowdown: ("SW thermal slowdown", cooling),
    }
    return [how for bit, how in trouble.items() if reasons is not None and reasons & bit]


def examine(nvml, handle, gpu: topology.Gpu) -> Checkup:
    """Every health record NVML keeps for this GPU. `gpu` is what topology.read_gpu found for the same handle:
    its NVML errors are findings too."""
    errors: dict[str, str] = {}
    findings: list[Finding] = []
    readings: dict[str, object] = {"serial": gpu.serial or "n/a", "pci_bus_id": gpu.pci_bus_id or "n/a"}

    def ask(what, call, *args):
        return topology.optional(nvml, errors, what, call, handle, *args)

    def finding(check, expected, found, category, severity, action):
        findings.append(Finding(gpu.index, gpu.uuid, check, expected, found, category, severity, action))

    remapped = ask("remapped rows", nvml.nvmlDeviceGetRemappedRows)  # (corrected, uncorrected, pending, failure)
    readings["remapped_rows"] = "n/a" if remapped is None else (
        f"{remapped[0]} corrected, {remapped[1]} uncorrected, pending={bool(remapped[2])}, failed={bool(remapped[3])}")
    if remapped and remapped[3]:
        finding("row remapping", "no failed remap", "a row remap failed (no spare rows left)", "gpu-hardware",
                "isolate", RMA)
    elif remapped and remapped[2]:
        finding("row remapping", "no remap pending", "a row remap is pending until the next GPU reset",
                "gpu-hardware", "reset", RESET)

    pages_pending = ask("retired pages pending", nvml.nvmlDeviceGetRetiredPagesPendingStatus)
    readings["retired_pages_pending"] = "n/a" if pages_pending is None else bool(pages_pending)
    if pages_pending:
        finding("page retirement", "no page retirement pending", "pages retired, pending a GPU reset",
                "gpu-hardware", "reset", RESET)

    ecc = ask("volatile uncorrected ECC", nvml.nvmlDeviceGetTotalEccErrors, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
              nvml.NVML_VOLATILE_ECC)
    readings["ecc_uncorrected_volatile"] = "n/a" if ecc is None else ecc
    if ecc:
        finding("uncorrected ECC", "0 uncorrected ECC errors since the driver loaded", f"{ecc}", "gpu-hardware",
                "reset", RESET)

    reasons = ask("clock-event reasons", nvml.nvmlDeviceGetCurrentClocksEventReasons)
    readings["clock_event_reasons"] = "n/a" if reasons is None else hex(reasons)
    for name, action in clock_trouble(nvml, reasons):
        finding("clock-event reasons", f"no {name}", f"{name} active (reasons {hex(reasons)})", "gpu-hardware",
                "triage", action)

    # The link's width is compared at rest: it does not narrow to save power. Its generation does (an idle
    # GPU reads gen 1), so the generation is compared under load only (pcie_under_load, during the copies).
    readings["pcie"] = f"gen{gpu.pcie_gen_current} x{gpu.pcie_width_current} (max gen{gpu.pcie_gen} x{gpu.pcie_width})"
    if gpu.pcie_width_current is not None and gpu.pcie_width and gpu.pcie_width_current < gpu.pcie_width:
        finding("PCIe link width", f"x{gpu.pcie_width}", f"x{gpu.pcie_width_current} (downtrained)", "interconnect",
                "triage", "reseat the GPU / riser and check the slot (lspci -vv: LnkSta vs LnkCap)")

    # CRC flit/data errors are corrected by the link's own retry: a healthy H200 here counted thousands of CRC
    # data errors, climbing with traffic, while replay and recovery stayed 0. DCGM judges CRC by its rate, which
    # one reading cannot give; so CRC counts are reported, and replays and recoveries (the link failing its
    # retry, or retraining) fail.
    counters = {"CRC flit": nvml.NVML_NVLINK_ERROR_DL_CRC_FLIT, "CRC data": nvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
                "replay": nvml.NVML_NVLINK_ERROR_DL_REPLAY, "recovery": nvml.NVML_NVLINK_ERROR_DL_RECOVERY}
    failing = ("replay", "recovery")
    links = topology.nvlinks_up(nvml, handle, errors)
    totals = {}
    for name, counter in counters.items():
        per_link = {link: ask(f"NVLink {link} {name} errors", nvml.nvmlDeviceGetNvLinkErrorCounter, link, counter)
                    for link in links}
        bad = {link: count for link, count in per_link.items() if count}
        totals[name] = sum(bad.values())
        if bad and name in failing:
            finding(f"NVLink {name} errors", "0 since the counters were last cleared",
                    ", ".join(f"link {link}: {count}" for link, count in bad.items()), "interconnect", "triage",
                    "reset the GPU (which clears the counters) and rerun; errors that come back mean a bad NVLink "
                    "(baseboard / NVSwitch tray): RMA")
    readings["nvlink_errors"] = ", ".join(f"{name}={total}" for name, total in totals.items()) if links else "n/a"

    temperature = ask("temperature", nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU)
    slowdown = ask("slowdown temperature", nvml.nvmlDeviceGetTemperatureThreshold,
                   nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
    readings["temperature_c"] = "n/a" if temperature is None else temperature
    readings["slowdown_c"] = "n/a" if slowdown is None else slowdown
    if temperature is not None and slowdown and temperature >= slowdown:
        finding("temperature", f"below the slowdown threshold {slowdown} C", f"{temperature} C", "gpu-hardware",
                "triage", "check cooling (fans, airflow, inlet temperature)")

    for what, error in {**gpu.nvml_errors, **errors}.items():
        findings.append(_nvml_error_finding(nvml, gpu, what, error))
    return Checkup(findings, readings)


def pcie_under_load(gpu: topology.Gpu, gen_now: int | None, width_now: int | None) -> Finding | None:
    """The PCIe link as read while a copy runs over it: then the generation too must be the max it trains to."""
    if gen_now is None or width_now is None or not gpu.pcie_gen:
        return None
    if gen_now >= gpu.pcie_gen and width_now >= gpu.pcie_width:
        return None
    return Finding(gpu.index, gpu.uuid, "PCIe link under load", f"gen{gpu.pcie_gen} x{gpu.pcie_width}",
                   f"gen{gen_now} x{width_now} while copying (downtrained)", "interconnect", "triage",
                   "reseat the GPU / riser, check the slot's BIOS link-speed setting (lspci -vv: LnkSta vs LnkCap)")


def handle_of(nvml, uuid: str):
    """NVML's handle for the GPU torch knows by this UUID (NVML's index may differ from CUDA's inside a
    container or under CUDA_VISIBLE_DEVICES; the UUID does not)."""
    return nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")


def pcie_link_now(nvml, handle, errors: dict[str, str]) -> tuple[int | None, int | None]:
    """The PCIe generation and width the link runs at this moment."""
    return (topology.optional(nvml, errors, "current PCIe generation", nvml.nvmlDeviceGetCurrPcieLinkGeneration,
                              handle),
            topology.optional(nvml, errors, "current PCIe width", nvml.nvmlDeviceGetCurrPcieLinkWidth, handle))


def pcie_link_under_load(nvml, handle, errors: dict[str, str], gpu: topology.Gpu, tries: int = 5,
                         pause_s: float = 0.01) -> tuple[int | None, int | None]:
    """The link read while copies run: a link still ramping up from idle gets a few short pauses (the copies
    queued behind this call last about 0.1 s) to reach its max before it counts as downtrained."""
    for attempt in range(tries):
        gen, width = pcie_link_now(nvml, handle, errors)
        if gen is None or width is None or (gen >= gpu.pcie_gen and width >= gpu.pcie_width) or attempt == tries - 1:
            return gen, width
        time.sleep(pause_s)
    return None, None
