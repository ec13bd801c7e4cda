"""The health counters DCGM watches, judged with DCGM's rules where it has one: pure functions from what NVML and
sysfs answered (a CounterReading, recorded by stackproof/measure/counters.py) to findings. None in a reading means
the GPU or driver does not support it (NVML NotSupported or FunctionNotFound, an nvidia-ml-py without the call,
no AER in sysfs): reported as "not supported", never a finding.

DCGM's rules (NVIDIA/DCGM, modules/health/DcgmHealthWatch.cpp and DcgmGPUHardwareLimits.h):
  - PCIe replays: MonitorPcie warns above DCGM_LIMIT_MAX_PCIREPLAY_RATE = 8 replays in the last minute. That
    figure is one link's; replays scale with the bits moved, so the limit here is per lane, from the bit error
    rate PCIe specifies (1e-12): lanes x GT/s x 1e9 x 1e-12 x 60 a minute (31 at Gen5 x16, 8 at Gen3 x16 where
    DCGM's constant came from), never below DCGM's 8.
  - Volatile DBE: MonitorMemVolatileDbes fails on any (judge/health.py already does).
  - Retired pages: MonitorMemSbeDbeRetiredPages fails when SBE + DBE retired pages >= DCGM_LIMIT_MAX_RETIRED_PAGES
    (63), and past DCGM_LIMIT_MAX_RETIRED_PAGES_SOFT_LIMIT (15) DBE pages when they keep coming (one reading
    cannot tell, so past 15 it is triage).
  - Row remapping: MonitorMemRowRemapFailures fails on a remap failure (judge/health.py); 512 remapped rows is
    what an HBM GPU holds in spare (NVIDIA's A100/H100 memory error management guide), so >= 512 uncorrectable
    remaps warns (triage): the GPU is out of spares for the next one.
  - SBE: DCGM_LIMIT_MAX_SBE_RATE = 10 ("dummy value until a real one is determined"); here: more than 10 a minute
    climbing during the run, or SBE_VOLATILE_LIMIT since the driver loaded, is triage (corrected errors are
    corrected; a rate that high precedes uncorrectable ones).
  - NVLink replay/recovery errors fail (DCGM_LIMIT_MAX_NVLINK_ERROR = 1; judge/health.py).
"""

from __future__ import annotations

import dataclasses

from stackproof.judge.findings import RESET, RMA, Finding

PCIE_BIT_ERROR_RATE = 1e-12  # the PCIe base specification's link BER
DCGM_PCIE_REPLAYS_PER_MINUTE = 8  # DCGM_LIMIT_MAX_PCIREPLAY_RATE
PCIE_GT_PER_S = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}
RETIRED_PAGES_LIMIT = 63  # DCGM_LIMIT_MAX_RETIRED_PAGES
RETIRED_DBE_SOFT_LIMIT = 15  # DCGM_LIMIT_MAX_RETIRED_PAGES_SOFT_LIMIT
REMAPPED_ROWS_SPARE = 512
SBE_RATE_PER_MINUTE = 10  # DCGM_LIMIT_MAX_SBE_RATE
SBE_VOLATILE_LIMIT = 1000  # corrected errors since the driver loaded: a healthy H200 counts 0
POWER_CAP_TOLERANCE = 0.01  # an enforced limit this far under the default is someone's cap
FABRIC_STATE_COMPLETED, FABRIC_STATE_NOT_SUPPORTED = 3, 0
RECOVERY_ACTIONS = {0: "none", 1: "GPU reset", 2: "node reboot", 3: "drain peer-to-peer", 4: "drain and reset",
                    5: "recover the IMEX domain", 6: "bus reset", 7: "system reboot"}


@dataclasses.dataclass
class CounterReading:
    """One reading of the counters (None: not supported by this GPU or driver)."""
    seconds: float = 0.0  # monotonic time of the reading
    pcie_replays: int | None = None
    pcie_gen: int | None = None  # the link's max generation and width (the replay limit scales with them)
    pcie_width: int | None = None
    sbe_volatile: int | None = None
    sbe_aggregate: int | None = None
    dbe_aggregate: int | None = None
    retired_sbe_pages: int | None = None
    retired_dbe_pages: int | None = None
    remapped_uncorrectable: int | None = None
    power_enforced_mw: int | None = None
    power_default_mw: int | None = None
    app_clocks_mhz: dict[str, int | None] = dataclasses.field(default_factory=dict)  # {"sm"|"mem": MHz}
    default_app_clocks_mhz: dict[str, int | None] = dataclasses.field(default_factory=dict)
    fabric_state: int | None = None
    fabric_status: int | None = None  # an NVML return code: 0 is success
    recovery_action: int | None = None
    ecc_mode: tuple[int, int] | None = None  # (current, pending)
    mig_mode: tuple[int, int] | None = None
    aer: dict[str, int] | None = None  # {"correctable"|"nonfatal"|"fatal": TOTAL_ERR_*}
    errors: dict[str, str] = dataclasses.field(default_factory=dict)  # {what: "NVML error X"} (judged elsewhere)


def replay_limit_per_minute(gen: int | None, width: int | None) -> float:
    """PCIe replays a minute the link may have at its bit error rate (see the module's note), >= DCGM's 8."""
    if not gen or not width:
        return DCGM_PCIE_REPLAYS_PER_MINUTE
    per_lane = PCIE_GT_PER_S.get(gen, 64.0) * 1e9 * PCIE_BIT_ERROR_RATE * 60
    return max(DCGM_PCIE_REPLAYS_PER_MINUTE, round(per_lane * width, 1))


def _per_minute(before: int | None, after: int | None, seconds: float) -> float | None:
    """A counter's climb as a rate over at least a minute (DCGM's window: a short run is not extrapolated)."""
    if before is None or after is None:
        return None
    return max(0, after - before) / max(seconds / 60, 1.0)


def _watts(milliwatts: int | None) -> str:
    return "not supported" if milliwatts is None else f"{milliwatts / 1000:g}"


def _or_na(value) -> object:
    return "n/a" if value is None else value


def judge(gpu_index: int, uuid: str, now: CounterReading, before: CounterReading | None = None) -> list[Finding]:
    """The counters' findings at this reading, and their climb since `before` (the run's first reading)."""
    found: list[Finding] = []

    def finding(check, expected, what, category, severity, action):
        found.append(Finding(gpu_index, uuid, check, expected, what, category, severity, action))

    retired = [n for n in (now.retired_sbe_pages, now.retired_dbe_pages) if n is not None]
    if retired and sum(retired) >= RETIRED_PAGES_LIMIT:
        finding("retired pages", f"fewer than {RETIRED_PAGES_LIMIT} (DCGM's limit)",
                f"{now.retired_sbe_pages or 0} for multiple SBEs + {now.retired_dbe_pages or 0} for DBEs",
                "gpu-hardware", "isolate", RMA)
    elif (now.retired_dbe_pages or 0) > RETIRED_DBE_SOFT_LIMIT:
        finding("retired pages (DBE)", f"at most {RETIRED_DBE_SOFT_LIMIT} (DCGM's soft limit)",
                f"{now.retired_dbe_pages} pages retired for double-bit errors", "gpu-hardware", "triage",
                "watch the count: more than one a week past this limit fails DCGM's health check; " + RMA)
    if (now.remapped_uncorrectable or 0) >= REMAPPED_ROWS_SPARE:
        finding("remapped rows", f"fewer than {REMAPPED_ROWS_SPARE} rows remapped for uncorrectable errors",
                f"{now.remapped_uncorrectable} (the spare rows are used up)", "gpu-hardware", "triage", RMA)
    if (now.sbe_volatile or 0) >= SBE_VOLATILE_LIMIT:
        finding("corrected ECC errors", f"fewer than {SBE_VOLATILE_LIMIT} since the driver loaded",
                f"{now.sbe_volatile} single-bit errors (aggregate {_or_na(now.sbe_aggregate)})",
                "gpu-hardware", "triage", "a GPU correcting this many errors is failing: drain it, run "
                "dcgmi diag -r 3, and " + RESET)
    if (now.dbe_aggregate or 0) > 0:
        finding("uncorrected ECC errors in the GPU's life", "0 (aggregate, kept across resets)",
                f"{now.dbe_aggregate}", "gpu-hardware", "triage",
                "check the remapped rows / retired pages cover them (nvidia-smi -q -d ROW_REMAPPER,PAGE_RETIREMENT); "
                "if they keep coming, " + RMA)
    if before is not None:
        elapsed = now.seconds - before.seconds
        sbe = _per_minute(before.sbe_volatile, now.sbe_volatile, elapsed)
        if sbe is not None and sbe > SBE_RATE_PER_MINUTE:
            finding("corrected ECC error rate", f"at most {SBE_RATE_PER_MINUTE} a minute (DCGM's SBE rate)",
                    f"{now.sbe_volatile - before.sbe_volatile} during the run ({sbe:.0f} a minute)", "gpu-hardware",
                    "triage", "drain the GPU and run dcgmi diag -r 3; " + RESET)
        replays = _per_minute(before.pcie_replays, now.pcie_replays, elapsed)
        limit = replay_limit_per_minute(now.pcie_gen, now.pcie_width)
        if replays is not None and replays > limit:
            finding("PCIe replays", f"at most {limit:g} a minute (1e-12 bit error rate on gen{now.pcie_gen} "
                    f"x{now.pcie_width}; DCGM warns above 8)", f"{now.pcie_replays - before.pcie_replays} during "
                    f"the run ({replays:.0f} a minute; {now.pcie_replays} since the driver loaded)",
                    "interconnect", "triage", "reseat the GPU and check its riser / cable and the slot's signal "
                    "integrity settings (lspci -vv: the link's error status); if it recurs, RMA the riser or GPU")
    default, enforced = now.power_default_mw, now.power_enforced_mw
    if default and enforced is not None and enforced < default * (1 - POWER_CAP_TOLERANCE):
        finding("power limit", f"the board's default {default / 1000:.0f} W", f"{enforced / 1000:.0f} W enforced "
                f"({enforced / default:.0%} of the default)", "configuration", "triage",
                f"raise it back (nvidia-smi -i <GPU> -pl {default / 1000:.0f}), or find what caps it (a power "
                "policy, nvidia-smi -q -d POWER)")
    for clock, mhz in now.app_clocks_mhz.items():
        want = now.default_app_clocks_mhz.get(clock)
        if mhz is not None and want and mhz < want:
            finding(f"application clocks ({clock})", f"the default {want} MHz", f"{mhz} MHz", "configuration",
                    "triage", "reset them (nvidia-smi -i <GPU> -rac) or unlock the clocks (nvidia-smi -rgc -rmc)")
    if now.fabric_state not in (None, FABRIC_STATE_NOT_SUPPORTED, FABRIC_STATE_COMPLETED) or (
            now.fabric_state == FABRIC_STATE_COMPLETED and now.fabric_status):
        finding("NVLink fabric", "registered with the fabric manager (state completed, status success)",
                f"state {now.fabric_state}, status {now.fabric_status}", "interconnect", "reset",
                "start nvidia-fabricmanager (systemctl status nvidia-fabricmanager) and check the NVSwitch trays; "
                "then reset the GPU")
    if now.recovery_action:
        finding("recovery action", "none", RECOVERY_ACTIONS.get(now.recovery_action, str(now.recovery_action)),
                "gpu-hardware", "reset" if now.recovery_action in (1, 2, 4, 6, 7) else "triage",
                f"the driver asks for: {RECOVERY_ACTIONS.get(now.recovery_action, 'see nvidia-smi -q')}; " + RESET)
    for what, mode, fix in (("ECC mode", now.ecc_mode, "reset the GPU (or reboot) to apply it"),
                            ("MIG mode", now.mig_mode, "reset the GPU (nvidia-smi -i <GPU> -r) to apply it")):
        if mode is not None and mode[0] != mode[1]:
            finding(f"{what} pending", "current = pending", f"current {mode[0]}, pending {mode[1]}",
                    "configuration", "reset", fix)
    if now.aer:
        for kind, severity in (("fatal", "reset"), ("nonfatal", "triage")):
            if now.aer.get(kind):
                finding(f"PCIe AER {kind} errors", "0 since boot", f"{now.aer[kind]}", "interconnect", severity,
                        "check the slot, riser and cable (lspci -vv, the kernel log's AER lines); reboot to clear")
    return found


def readings(now: CounterReading, before: CounterReading | None = None) -> dict[str, object]:
    """The counters as the report shows them ("not supported" where the GPU or driver lacks one)."""
    def shown(value):
        return "not supported" if value is None else value

    clocks = ", ".join(f"{c} {m} MHz (default {now.default_app_clocks_mhz.get(c)})"
                       for c, m in now.app_clocks_mhz.items() if m is not None)
    return {
        "pcie_replays": shown(now.pcie_replays),
        "pcie_replay_limit_per_min": replay_limit_per_minute(now.pcie_gen, now.pcie_width),
        "ecc_sbe_volatile": shown(now.sbe_volatile), "ecc_sbe_aggregate": shown(now.sbe_aggregate),
        "ecc_dbe_aggregate": shown(now.dbe_aggregate),
        "retired_pages": "not supported" if now.retired_sbe_pages is None and now.retired_dbe_pages is None else
        f"{now.retired_sbe_pages or 0} SBE, {now.retired_dbe_pages or 0} DBE",
        "power_limit_w": "not supported" if now.power_enforced_mw is None else
        f"{now.power_enforced_mw / 1000:g} (default {_watts(now.power_default_mw)})",
        "app_clocks": clocks or "not supported",
        "fabric_state": "not supported" if now.fabric_state in (None, FABRIC_STATE_NOT_SUPPORTED) else now.fabric_state,
        "recovery_action": "not supported" if now.recovery_action is None
        else RECOVERY_ACTIONS.get(now.recovery_action, now.recovery_action),
        "ecc_mode_pending": shown(now.ecc_mode and now.ecc_mode[1]),
        "mig_mode": shown(now.mig_mode and now.mig_mode[0]),
        "pcie_aer": "not supported" if now.aer is None else ", ".join(f"{k}={v}" for k, v in now.aer.items()),
    }
