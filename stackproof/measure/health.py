"""One GPU's health as NVML and the kernel log record it: the reading (judge.health.HealthReading), handed to
stackproof/judge/health.py for judgement. Nothing here decides; every NVML error is kept in the reading to be
judged (never a silent pass, never a traceback)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
import subprocess
import time

from stackproof.judge import health as rules
from stackproof.judge.findings import Finding, worst  # noqa: F401 (worst: the checks' import)
from stackproof.measure import topology, watermark

KERNEL_LOG = "/dev/kmsg"
JOURNALCTL_TIMEOUT_S = 5.0
KMSG_MAX_RECORDS = 100_000  # the ring buffer holds far fewer; a bound so a read never spins
NVML_EVENTS_MAX = 64  # events drained per poll


@dataclasses.dataclass
class Checkup:
    findings: list[Finding]
    readings: dict[str, object]  # what NVML answered, for the report ("n/a" where not applicable)


def read_kernel_log(source: str = KERNEL_LOG, since: float | None = None) -> rules.KernelLog:
    """The kernel log's records, each with its wall time where the log keeps one, or why it could not be read.
    /dev/kmsg is read without blocking (each read returns one record, stamped in microseconds since boot); a
    regular file (a saved log, a test's fixture) is read whole; where /dev/kmsg is not readable (a container
    without CAP_SYSLOG), `journalctl -k` is asked, with a timeout, from `since` on. journalctl's own failure
    (no journal, no permission) is told apart from a log in which nothing matched: only exit 0 is a reading."""
    try:
        if stat.S_ISCHR(os.stat(source).st_mode):
            return rules.KernelLog(_read_kmsg(source), source)
        with open(source, errors="replace") as log:
            booted = _booted_at()
            return rules.KernelLog([rules.timed(line, booted) for line in log.read().splitlines()], source)
    except OSError as err:
        why = f"{source}: {err.strerror}"
    command = ["journalctl", "-k", "-b", "--no-pager", "-q", "-o", "short-unix"]
    if since is not None:
        command.append(f"--since=@{since:.6f}")
    try:
        done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=JOURNALCTL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        return rules.KernelLog([], "none", f"{why}; journalctl -k: {err}")
    if done.returncode != 0:
        said = done.stderr.strip().splitlines()
        return rules.KernelLog([], "none", f"{why}; journalctl -k exited {done.returncode}: "
                                           f"{said[-1][:200] if said else 'no words on stderr'}")
    return rules.KernelLog([rules.journal_record(line) for line in done.stdout.splitlines()], "journalctl -k")


def _booted_at() -> float:
    """The wall time this host booted, as the kernel log's boot-relative stamps count from."""
    return time.time() - time.clock_gettime(time.CLOCK_MONOTONIC)


def _read_kmsg(source: str) -> list[tuple[float | None, str]]:
    records = []
    booted = _booted_at()
    fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK)
    try:
        for _ in range(KMSG_MAX_RECORDS):
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:  # the end of the buffer
                break
            except OSError:  # EPIPE: a record was overwritten while reading; go on with the next
                continue
            if not record:
                break
            records.append(rules.kmsg_record(record.decode(errors="replace"), booted))
    finally:
        os.close(fd)
    return records


def _process_name(nvml, pid: int) -> str:
    try:
        return topology._text(nvml.nvmlSystemGetProcessName(pid)) or "n/a"
    except nvml.NVMLError:
        pass
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return "n/a"


def read_processes(nvml, handle, errors: dict[str, str]) -> list[rules.Process]:
    """Every compute and graphics process on the GPU, with the memory it holds."""
    found: dict[int, rules.Process] = {}
    for what, call in (("compute processes", nvml.nvmlDeviceGetComputeRunningProcesses),
                       ("graphics processes", nvml.nvmlDeviceGetGraphicsRunningProcesses)):
        for proc in topology.optional(nvml, errors, what, call, handle) or []:
            found.setdefault(proc.pid, rules.Process(proc.pid, _process_name(nvml, proc.pid), proc.usedGpuMemory))
    return list(found.values())


def read(nvml, handle, gpu: topology.Gpu, kernel_log: str = KERNEL_LOG,
         memory: watermark.Memory | None = None) -> rules.HealthReading:
    """Every health record NVML keeps for this GPU, and the kernel log's XIDs for its PCI address. `gpu` is what
    topology.read_gpu found for the same handle: its NVML errors are the reading's too. With `memory` (the
    node's state folder), the last look's watermark and counters come with the reading, and this look is kept
    as the next one's; without it, every look is a first one."""
    previous = memory.previous(gpu.uuid) if memory else watermark.Previous()
    reading = rules.HealthReading(nvlink_errors_before=previous.nvlink, looked_at_before=previous.looked_at,
                                  state_problem=previous.problem)
    errors = reading.nvml_errors

    def ask(what, call, *args):
        return topology.optional(nvml, errors, what, call, handle, *args)

    rows = ask("remapped rows", nvml.nvmlDeviceGetRemappedRows)
    reading.remapped_rows = None if rows is None else tuple(rows)
    pending = ask("retired pages pending", nvml.nvmlDeviceGetRetiredPagesPendingStatus)
    reading.retired_pages_pending = None if pending is None else bool(pending)
    reading.ecc_uncorrected_volatile = ask("volatile uncorrected ECC", nvml.nvmlDeviceGetTotalEccErrors,
                                           nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
    reading.clock_event_reasons = ask("clock-event reasons", nvml.nvmlDeviceGetCurrentClocksEventReasons)
    counters = {"CRC flit": nvml.NVML_NVLINK_ERROR_DL_CRC_FLIT, "CRC data": nvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
                "replay": nvml.NVML_NVLINK_ERROR_DL_REPLAY, "recovery": nvml.NVML_NVLINK_ERROR_DL_RECOVERY}
    for link in topology.nvlinks_up(nvml, handle, errors):
        reading.nvlink_errors[link] = {name: ask(f"NVLink {link} {name} errors", nvml.nvmlDeviceGetNvLinkErrorCounter,
                                                 link, counter) for name, counter in counters.items()}
    reading.temperature_c = ask("temperature", nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU)
    reading.slowdown_c = ask("slowdown temperature", nvml.nvmlDeviceGetTemperatureThreshold,
                             nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
    reading.processes = read_processes(nvml, handle, errors)
    info = ask("memory info", nvml.nvmlDeviceGetMemoryInfo)
    if info is not None:
        reading.memory_used_bytes, reading.memory_total_bytes = info.used, info.total
    looked_at = time.time()
    log = read_kernel_log(kernel_log, previous.looked_at)
    reading.kernel_log, reading.kernel_log_error = log.source, log.error
    reading.xids = rules.kernel_xids(log.records, gpu.pci_bus_id, since=previous.looked_at)
    if memory:
        # A log not read leaves the watermark where it was: what it holds is still to be judged. A state that
        # could not be read is said once and replaced by this look.
        kept = memory.keep(gpu.uuid, previous.looked_at if log.error else looked_at,
                           watermark.merged(previous.nvlink, reading.nvlink_errors))
        reading.state_problem = "; ".join(p for p in (previous.problem, kept) if p)
    for what, error in gpu.nvml_errors.items():
        errors.setdefault(what, error)
    return reading


def examine(nvml, handle, gpu: topology.Gpu, own_pids: set[int], kernel_log: str = KERNEL_LOG,
            own_count: int = 1, memory: watermark.Memory | None = None, job: str | None = None) -> Checkup:
    """The GPU's health reading, judged (since the last look, with `memory`; for `job`, a Prolog's)."""
    reading = read(nvml, handle, gpu, kernel_log, memory)
    pcie = f"gen{gpu.pcie_gen_current} x{gpu.pcie_width_current} (max gen{gpu.pcie_gen} x{gpu.pcie_width})"
    return Checkup(rules.judge(gpu.index, gpu.uuid, gpu.ecc_enabled, reading, own_pids, own_count, job),
                   rules.readings(reading, pcie, gpu.serial, gpu.pci_bus_id))


class XidWatch:
    """NVML's XID events for one GPU while the run goes on: registered when made, drained by `events()` (a
    short wait, never a hang). A GPU or driver without event support yields a reading that says so."""

    def __init__(self, nvml, handle, wait_ms: int = 10):
        self.nvml, self.handle, self.wait_ms = nvml, handle, wait_ms
        self.errors: dict[str, str] = {}
        self.events_set = None
        try:
            self.events_set = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self.events_set)
        except nvml.NVMLError_NotSupported:
            self.close()
        except nvml.NVMLError as err:
            self.errors["XID event registration"] = f"NVML error {err}"
            self.close()

    @property
    def live(self) -> bool:
        """Whether NVML has watched every XID of the GPU since this watch began (events supported, no error)."""
        return self.events_set is not None and not self.errors

    def events(self) -> list[rules.Xid]:
        if self.events_set is None:
            return []
        found = []
        for _ in range(NVML_EVENTS_MAX):
            try:
                event = self.nvml.nvmlEventSetWait_v2(self.events_set, self.wait_ms)
            except self.nvml.NVMLError_Timeout:
                break
            except self.nvml.NVMLError as err:
                self.errors["XID events"] = f"NVML error {err}"
                break
            if event.eventType & self.nvml.nvmlEventTypeXidCriticalError:
                found.append(rules.Xid(int(event.eventData), "NVML event", when=time.time()))
        return found

    def close(self) -> None:
        if self.events_set is not None:
            with contextlib.suppress(self.nvml.NVMLError):
                self.nvml.nvmlEventSetFree(self.events_set)
        self.events_set = None


def handle_of(nvml, uuid: str):
    """NVML's handle for the GPU torch knows by this UUID (NVML's index may differ from CUDA's inside a
    container or under CUDA_VISIBLE_DEVICES; the UUID does not)."""
    return nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")


def pcie_link_now(nvml, handle, errors: dict[str, str]) -> tuple[int | None, int | None]:
    """The PCIe generation and width the link runs at this moment."""
    return (topology.optional(nvml, errors, "current PCIe generation", nvml.nvmlDeviceGetCurrPcieLinkGeneration,
                              handle),
            topology.optional(nvml, errors, "current PCIe width", nvml.nvmlDeviceGetCurrPcieLinkWidth, handle))


def pcie_link_under_load(nvml, handle, errors: dict[str, str], target: tuple[int, int], tries: int = 5,
                         pause_s: float = 0.01) -> tuple[int | None, int | None]:
    """The link read while copies run: a link still ramping up from idle gets a few short pauses (the copies
    queued behind this call last about 0.1 s) to reach `target`, the (generation, width) the caller expects
    (judge/bars.py pcie_expected), before it counts as downtrained."""
    gen_max, width_max = target
    for attempt in range(tries):
        gen, width = pcie_link_now(nvml, handle, errors)
        if gen is None or width is None or (gen >= gen_max and width >= width_max) or attempt == tries - 1:
            return gen, width
        time.sleep(pause_s)
    return None, None


def clock_reasons_while_busy(nvml, handle, errors: dict[str, str], busy, pause_s: float = 0.005,
                             most: int = 2000) -> tuple[int | None, int]:
    """The clock-event reasons read again and again while `busy()` is true (the GPU still runs the work queued
    before this call), OR-ed together: a slowdown anywhere in the sustained load shows. (reasons, samples)."""
    seen, samples = None, 0
    while samples < most:
        reasons = topology.optional(nvml, errors, "clock-event reasons under load",
                                    nvml.nvmlDeviceGetCurrentClocksEventReasons, handle)
        samples += 1
        if reasons is None:
            return seen, samples
        seen = reasons | (seen or 0)
        if not busy():
            break
        time.sleep(pause_s)
    return seen, samples
