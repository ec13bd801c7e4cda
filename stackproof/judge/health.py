"""Health rules: pure functions from what NVML and the kernel log answered about one GPU (a HealthReading,
recorded by stackproof/measure/health.py) to findings that name the GPU, with a category and a severity as NVIDIA
DCGM uses them (isolate: take the GPU out of service; reset: a GPU reset / reboot clears it; triage: someone
must look) and the fix. NVML answering NotSupported means the GPU lacks the feature (an H200 remaps rows instead
of retiring pages) and is no finding; any other NVML error is one ("n/a: NVML error X")."""

from __future__ import annotations

import dataclasses
import datetime
import re

from stackproof.judge.findings import RESET, RMA, Finding

GiB = 1 << 30

# NVML's clock-event reason bits (nvmlClocksEventReason*), the ones that mean the GPU is held back by heat or
# power rather than by choice (idle 0x1, application clocks 0x2, a software power cap 0x4 someone set).
HW_SLOWDOWN, SW_THERMAL, HW_THERMAL, HW_POWER_BRAKE = 0x8, 0x20, 0x40, 0x80
COOLING = "check cooling (fans, airflow, inlet temperature)"
CLOCK_TROUBLE = {
    HW_SLOWDOWN: ("HW slowdown", "the board asserts slowdown (heat or power): check cooling and the power supplies"),
    HW_THERMAL: ("HW thermal slowdown", COOLING),
    HW_POWER_BRAKE: ("HW power brake", "the system asserted the power brake: check the power supplies and the chassis"),
    SW_THERMAL: ("SW thermal slowdown", COOLING),
}

# Memory in use on the GPU beyond this run's own processes, as a fraction of the GPU's memory: the driver's own
# reservation is about 0.4% on an H200 (645 MB of 150.8 GB, recorded idle with no process), so 5% is someone's
# data, not the driver's.
MEMORY_IN_USE_FRACTION = 0.05

# XIDs, from NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors, resolution buckets): (meaning, category,
# severity, fix). Severity follows the catalog's immediate action: RESET_GPU / reboot -> reset; a GPU that is
# gone or cannot retire memory -> isolate; investigate -> triage.
XIDS = {
    48: ("double-bit ECC error (DBE)", "gpu-hardware", "reset", RESET),
    61: ("internal micro-controller breakpoint/warning", "gpu-hardware", "reset", RESET),
    62: ("internal micro-controller halt", "gpu-hardware", "reset", RESET),
    63: ("ECC page retirement / row remapping recorded, pending a GPU reset", "gpu-hardware", "reset", RESET),
    64: ("ECC page retirement / row remapping failure", "gpu-hardware", "isolate", RMA),
    74: ("NVLink error", "interconnect", "reset",
         "reset the GPU; if the link errors again, check the NVLink / NVSwitch tray: " + RMA),
    79: ("GPU has fallen off the bus", "gpu-hardware", "isolate",
         "drain the node and reboot; check the slot, riser and power; if it recurs, " + RMA),
    92: ("high single-bit ECC error rate", "gpu-hardware", "triage", "watch the ECC counters; reset the GPU; " + RMA),
    94: ("contained ECC error (the application was stopped)", "gpu-hardware", "reset", RESET),
    95: ("uncontained ECC error", "gpu-hardware", "reset", RESET),
    119: ("GSP RPC timeout", "gpu-hardware", "reset", RESET),
    120: ("GSP error", "gpu-hardware", "reset", RESET),
    121: ("C2C link error", "interconnect", "reset", RESET),
    140: ("unrecovered ECC error", "gpu-hardware", "reset", RESET),
}
# XIDs an application causes (bad kernel, page fault, stopped process): the catalog's immediate action is
# RESTART_APP, so they are readings, never held against the GPU (a tenant's bad kernel must not drain the node for
# every later tenant).
APPLICATION_XIDS = {8: "GPU stopped processing (idle timeout)", 13: "graphics engine exception",
                    31: "GPU memory page fault", 43: "GPU stopped processing",
                    45: "preemptive cleanup, due to a previous error", 109: "context switch timeout"}
# An XID in neither table: someone looks it up; unclassified never drains (judge/policy.py).
UNKNOWN_XID = ("not in stackproof's table", "unclassified", "triage",
               "look the XID up in NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors) and act on its "
               "resolution bucket")

# "NVRM: Xid (PCI:0000:18:00): 79, pid=..., GPU has fallen off the bus."
KERNEL_XID = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+),?(.*)")
# The driver's line when its kernel module loads (at boot, or reloaded after an upgrade or a reset of all GPUs).
DRIVER_LOADED = "NVRM: loading NVIDIA"
# The kernel log's stamps: dmesg's "[  123.456789] " (seconds since boot), /dev/kmsg's "6,812,123456789,-;"
# (microseconds since boot), journalctl -o short-unix's "1764627123.456789 host kernel: " (wall time).
DMESG_STAMP = re.compile(r"^\[\s*(\d+\.\d+)\]\s?(.*)$")
KMSG_STAMP = re.compile(r"^\d+,\d+,(\d+),[^;]*;(.*)$", re.S)
JOURNAL_STAMP = re.compile(r"^(\d+\.\d+) \S+ kernel: ?(.*)$")


@dataclasses.dataclass(frozen=True)
class Process:
    pid: int
    name: str  # "n/a" where the name cannot be read
    used_bytes: int | None


@dataclasses.dataclass(frozen=True)
class Xid:
    xid: int
    source: str  # "kernel log" | "NVML event"
    text: str = ""
    when: float | None = dataclasses.field(default=None, compare=False)  # wall time, where the log says


@dataclasses.dataclass
class KernelLog:
    """The kernel log as read: (wall time or None, text) per record, where it came from, or why it was not read."""
    records: list[tuple[float | None, str]]
    source: str
    error: str | None = None  # None: read (an empty log is a reading: nothing matched)


def timed(line: str, booted_at: float) -> tuple[float | None, str]:
    """A saved log's line with its wall time: dmesg's boot-relative stamp counted from `booted_at`, journalctl's
    wall time as it is; a line with no stamp has no time (and is judged whatever the watermark)."""
    if match := DMESG_STAMP.match(line):
        return booted_at + float(match.group(1)), match.group(2)
    if match := JOURNAL_STAMP.match(line):
        return float(match.group(1)), match.group(2)
    return None, line


def kmsg_record(record: str, booted_at: float) -> tuple[float | None, str]:
    """One /dev/kmsg record ("prio,seq,usec,flags;text", continuation lines after it) with its wall time."""
    if match := KMSG_STAMP.match(record):
        return booted_at + int(match.group(1)) / 1e6, match.group(2).split("\n", 1)[0]
    return None, record.rstrip("\n")


def journal_record(line: str) -> tuple[float | None, str]:
    """One line of journalctl -o short-unix, with its wall time."""
    if match := JOURNAL_STAMP.match(line):
        return float(match.group(1)), match.group(2)
    return None, line


@dataclasses.dataclass
class HealthReading:
    """What NVML answered about one GPU at rest (None: not supported by the GPU)."""
    remapped_rows: tuple[int, int, int, int] | None = None  # (corrected, uncorrected, pending, failure)
    retired_pages_pending: bool | None = None
    ecc_uncorrected_volatile: int | None = None
    clock_event_reasons: int | None = None
    nvlink_errors: dict[int, dict[str, int | None]] = dataclasses.field(default_factory=dict)  # link: {counter: n}
    temperature_c: int | None = None
    slowdown_c: int | None = None
    processes: list[Process] = dataclasses.field(default_factory=list)
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    xids: list[Xid] = dataclasses.field(default_factory=list)  # the kernel log's, after the watermark
    kernel_log: str = "n/a"  # where the XIDs were read from
    kernel_log_error: str | None = None  # why the kernel log was not read (None: it was)
    nvml_errors: dict[str, str] = dataclasses.field(default_factory=dict)  # {what was asked: "NVML error X"}
    # The last look at this GPU (measure/watermark.py): its counters (None: this is the first reading, which
    # judges no counter as old evidence) and the time the kernel log was judged up to (None: never).
    nvlink_errors_before: dict[int, dict[str, int]] | None = None
    looked_at_before: float | None = None
    state_problem: str = ""  # the state folder could not be read or written


def kernel_xids(lines: list[str] | list[tuple[float | None, str]], pci_bus_id: str | None,
                since: float | None = None) -> list[Xid]:
    """The XIDs the kernel log names for the GPU at this PCI address (NVML's "00000000:18:00.0"; the driver
    prints "0000:18:00"), logged after `since` (the last look's watermark; a record without a time counts) and
    after the driver last loaded (which reset every GPU)."""
    if not pci_bus_id:
        return []
    domain, bus, rest = pci_bus_id.split(":", 2)
    want = f"{int(domain, 16):04x}:{bus}:{rest.split('.')[0]}".lower()
    found = []
    for record in lines:
        when, line = record if isinstance(record, tuple) else (None, record)
        if DRIVER_LOADED in line:
            found = []  # the driver was loaded again: every GPU was reset since the XIDs before this line
            continue
        if since is not None and when is not None and when <= since:
            continue
        match = KERNEL_XID.search(line)
        if match and match.group(1).lower().removesuffix(".0") == want:
            found.append(Xid(int(match.group(2)), "kernel log", match.group(3).strip(" ,"), when))
    return found


def clock_trouble(reasons: int | None) -> list[tuple[str, str]]:
    """(name, action) of each clock-event reason set in `reasons` that means heat or power holds the GPU back."""
    return [how for bit, how in CLOCK_TROUBLE.items() if reasons is not None and reasons & bit]


def clock_findings(gpu_index: int, uuid: str, reasons: int | None, when: str) -> list[Finding]:
    return [Finding(gpu_index, uuid, f"clock-event reasons {when}", f"no {name}",
                    f"{name} active (reasons {hex(reasons)})", "gpu-hardware", "triage", action)
            for name, action in clock_trouble(reasons)]


def xid_findings(gpu_index: int, uuid: str, xids: list[Xid]) -> list[Finding]:
    """One finding per XID the catalog holds against the GPU (application XIDs are readings only); an XID not in
    the table is one to look up."""
    found, seen = [], set()
    for event in xids:
        if event.xid in APPLICATION_XIDS or (event.xid, event.source) in seen:
            continue
        seen.add((event.xid, event.source))
        meaning, category, severity, action = XIDS.get(event.xid, UNKNOWN_XID)
        count = sum(e.xid == event.xid and e.source == event.source for e in xids)
        found.append(Finding(gpu_index, uuid, f"XID {event.xid}", f"no XID ({event.source})",
                             f"XID {event.xid}: {meaning}" + (f" (x{count})" if count > 1 else "")
                             + (f", logged{_at(event.when)}" if event.source == "kernel log" and event.when else "")
                             + (f": {event.text}" if event.text else ""), category, severity, action))
    return found


def foreign_processes(reading: HealthReading, own_pids: set[int], own_count: int) -> list[Process]:
    """The processes on the GPU that are not this run's. NVML lists pids as the host numbers them: inside a
    container with its own PID namespace none of ours matches, and then the `own_count` smallest (a rank's
    context) are taken for ours, so a leftover holding more memory still shows."""
    procs = reading.processes
    if any(p.pid in own_pids for p in procs) or not own_count:
        return [p for p in procs if p.pid not in own_pids]
    by_size = sorted(procs, key=lambda p: p.used_bytes or 0)
    return by_size[own_count:]


def judge(gpu_index: int, uuid: str, ecc_enabled: bool | None, reading: HealthReading, own_pids: set[int],
          own_count: int = 1, job: str | None = None) -> list[Finding]:
    """Every finding about this GPU's health at rest. `own_pids`: this run's processes on the node; `own_count`:
    how many of them use this GPU (its rank); `job`: the job this GPU was given to (a Prolog's), which another
    process holding it keeps off the node."""
    found: list[Finding] = []

    def finding(check, expected, what, category, severity, action):
        found.append(Finding(gpu_index, uuid, check, expected, what, category, severity, action))

    if ecc_enabled is False:
        finding("ECC mode", "enabled", "disabled (memory errors go undetected)", "configuration", "reset",
                "enable it (nvidia-smi -i <GPU> -e 1) and reset the GPU or reboot")
    remapped = reading.remapped_rows
    if remapped and remapped[3]:
        finding("row remapping", "no failed remap", "a row remap failed (no spare rows left)", "gpu-hardware",
                "isolate", RMA)
    elif remapped and remapped[2]:
        finding("row remapping", "no remap pending", "a row remap is pending until the next GPU reset",
                "gpu-hardware", "reset", RESET)
    if reading.retired_pages_pending:
        finding("page retirement", "no page retirement pending", "pages retired, pending a GPU reset",
                "gpu-hardware", "reset", RESET)
    if reading.ecc_uncorrected_volatile:
        finding("uncorrected ECC", "0 uncorrected ECC errors since the driver loaded",
                f"{reading.ecc_uncorrected_volatile}", "gpu-hardware", "reset", RESET)
    found += clock_findings(gpu_index, uuid, reading.clock_event_reasons, "at rest")

    # CRC flit/data errors are corrected by the link's own retry: a healthy H200 counted thousands of CRC data
    # errors, climbing with traffic, while replay and recovery stayed 0. DCGM judges CRC by its rate, which one
    # reading cannot give; so CRC counts are reported, and replays and recoveries (the link failing its retry, or
    # retraining) fail, counted since the node's previous reading: errors once, months ago, are not held against
    # every later run, and the first reading only sets the baseline.
    for counter, grown in nvlink_growth(reading).items():
        finding(f"NVLink {counter} errors", f"0 new since the last look{_at(reading.looked_at_before)}",
                ", ".join(f"link {link}: +{count}" for link, count in grown.items()), "interconnect", "triage",
                "reset the GPU (which clears the counters) and rerun; errors that come back mean a bad NVLink "
                "(baseboard / NVSwitch tray): RMA")

    if reading.temperature_c is not None and reading.slowdown_c and reading.temperature_c >= reading.slowdown_c:
        finding("temperature", f"below the slowdown threshold {reading.slowdown_c} C", f"{reading.temperature_c} C",
                "gpu-hardware", "triage", COOLING)

    # Someone else's process on the GPU: an alert, except where a job was given this GPU (a Prolog): then the
    # job must not start on a GPU it cannot fill, and the node is kept from it until the GPU is freed.
    held = ("gpu-hardware", "reset") if job else ("configuration", "triage")
    for_job = f" before job {job} starts on it" if job else " before the node takes work"
    others = foreign_processes(reading, own_pids, own_count)
    if others:
        pids = " ".join(str(p.pid) for p in others)
        finding("other processes on the GPU", "none but this run's ranks" + (f" (the GPU is job {job}'s)" if job
                                                                              else ""),
                "; ".join(f"pid {p.pid} ({p.name}) holding {_gib(p.used_bytes)}" for p in others), *held,
                f"free the GPU{for_job}: kill {pids} (a crashed job's leftover), or reset the GPU (nvidia-smi -r -i "
                f"{gpu_index}); nvidia-smi on the host names them" + ("; then resume the node" if job else ""))
    in_use, total = memory_in_use(reading, others), reading.memory_total_bytes
    if in_use is not None and total and in_use > MEMORY_IN_USE_FRACTION * total:
        finding("memory in use before the run", f"at most {MEMORY_IN_USE_FRACTION:.0%} of "
                f"{_gib(reading.memory_total_bytes)} used by others (the driver's own reservation)",
                f"{_gib(in_use)} in use beyond this run's processes", *held,
                f"free the GPU{for_job} (nvidia-smi shows who holds it; a process in another container shows there "
                f"only by its memory) or reset it (nvidia-smi -r -i {gpu_index})")
    found += xid_findings(gpu_index, uuid, reading.xids)
    if reading.kernel_log_error:
        # Not looked at is not a pass: the promise of this check says so, and nothing drains for it.
        finding("kernel log", "the kernel log read for this GPU's XIDs", f"not read: {reading.kernel_log_error}",
                "tool-error", "triage", "give the check the kernel log: /dev/kmsg readable (CAP_SYSLOG, or a "
                "privileged container), journalctl with the host's journal mounted, or --kernel-log FILE")
    if reading.state_problem:
        finding("health state", "the last look's watermark and counters, kept in the state folder",
                f"not kept: {reading.state_problem}", "configuration", "triage",
                "give --state-dir (STACKPROOF_STATE_DIR) a writable folder kept between runs (the DaemonSet: a "
                "hostPath); without it every look is a first one")
    for what, error in reading.nvml_errors.items():
        found.append(nvml_error_finding(gpu_index, uuid, what, error))
    return found


def nvlink_growth(reading: HealthReading) -> dict[str, dict[int, int]]:
    """{counter: {link: errors since the previous reading}} for the replay and recovery counters that grew. No
    previous reading: nothing (the baseline is set now). A counter below its previous reading was cleared (a GPU
    reset) since: all of it is new."""
    before = reading.nvlink_errors_before
    if before is None:
        return {}
    grown: dict[str, dict[int, int]] = {}
    for counter in ("replay", "recovery"):
        for link, counts in reading.nvlink_errors.items():
            now, then = counts.get(counter), before.get(link, {}).get(counter, 0)
            new = 0 if now is None else now - then if now >= then else now
            if new > 0:
                grown.setdefault(counter, {})[link] = new
    return grown


def _at(when: float | None) -> str:
    if when is None:
        return ""
    return f" ({datetime.datetime.fromtimestamp(when, datetime.timezone.utc).isoformat(timespec='seconds')})"


def memory_in_use(reading: HealthReading, others: list[Process]) -> int | None:
    """Memory used on the GPU beyond this run's processes."""
    if reading.memory_used_bytes is None:
        return None
    own = sum(p.used_bytes or 0 for p in reading.processes if p not in others)
    return max(0, reading.memory_used_bytes - own)


# What each NVML error says about the GPU; any other error: NVML cannot answer here (access, driver).
NVML_ERROR_HOW = {
    "GPU is lost": ("gpu-hardware", "isolate", "the GPU fell off the bus: " + RMA),
    "Corrupted infoROM": ("gpu-hardware", "isolate", "corrupted infoROM: " + RMA),
    "GPU requires restart": ("gpu-hardware", "reset", RESET),
}


def nvml_error_finding(gpu_index: int, uuid: str, what: str, error: str) -> Finding:
    """An NVML call that failed: its error says how bad it is."""
    category, severity, action = NVML_ERROR_HOW.get(error.removeprefix("NVML error "), (
        "configuration", "triage", "give the container NVML access (NVIDIA_DRIVER_CAPABILITIES including utility) "
        "and check the driver (nvidia-smi -q): an NVML that cannot answer hides the GPU's health"))
    return Finding(gpu_index, uuid, what, "an answer from NVML", f"n/a: {error}", category, severity, action)


def readings(reading: HealthReading, pcie: str, serial: str | None, pci_bus_id: str | None) -> dict[str, object]:
    """The reading as the report shows it ("n/a" where not applicable)."""
    rows = reading.remapped_rows
    crc = {name: sum(c.get(name) or 0 for c in reading.nvlink_errors.values())
           for name in ("CRC flit", "CRC data", "replay", "recovery")}

    def shown(value):
        return "n/a" if value is None else value

    return {
        "serial": serial or "n/a", "pci_bus_id": pci_bus_id or "n/a",
        "remapped_rows": "n/a" if rows is None else (
            f"{rows[0]} corrected, {rows[1]} uncorrected, pending={bool(rows[2])}, failed={bool(rows[3])}"),
        "retired_pages_pending": shown(reading.retired_pages_pending),
        "ecc_uncorrected_volatile": shown(reading.ecc_uncorrected_volatile),
        "clock_event_reasons": "n/a" if reading.clock_event_reasons is None else hex(reading.clock_event_reasons),
        "pcie": pcie,
        "nvlink_errors": ", ".join(f"{k}={v}" for k, v in crc.items()) if reading.nvlink_errors else "n/a",
        "temperature_c": shown(reading.temperature_c), "slowdown_c": shown(reading.slowdown_c),
        "processes": "; ".join(f"{p.pid} ({p.name}) {_gib(p.used_bytes)}" for p in reading.processes) or "none",
        "memory_used_gib": "n/a" if reading.memory_used_bytes is None else round(reading.memory_used_bytes / GiB, 2),
        "xids": ", ".join(f"{x.xid} ({x.source})" for x in reading.xids) or "none",
        "kernel_log": reading.kernel_log if not reading.kernel_log_error else f"not read ({reading.kernel_log_error})",
        "looked_at_before": "never (first look)" if reading.looked_at_before is None else _at(
            reading.looked_at_before).strip(" ()"),
    }


def _gib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / GiB:.1f} GiB"
