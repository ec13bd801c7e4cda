"""The burn-in soak on one device (one rank, its GPU, or a CPU rank): back-to-back bf16 GEMMs for a set time, with
known-answer GEMMs in every training dtype, memory pattern passes and host<->device copies interleaved, and a
1 Hz sample of what the device did and how it ran (NVML: power, temperature, SM and memory clocks, clock-event
reasons). It records; stackproof/judge/burn.py decides.

The work is queued in batches, at most two in flight, so the GPU never waits on the host: each batch is
`load_gemms` timed bf16 GEMMs (between two CUDA events: the throughput), one known-answer GEMM (the dtypes in
turn), one chunk of the memory pattern (verified against the pattern written on the chunk's previous pass, then
rewritten with a fresh one) and one copy each way. Results are counted on the device and copied to pinned host
memory without a sync; the host reads them once the batch's end event has passed. On a CPU rank the same code
runs synchronously, timed by the host's clock.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

GiB, MiB = 1 << 30, 1 << 20
GEMM_CHECK_NONZEROS = 128  # per row of A: every partial sum of A @ B is a whole number of at most 128, exact in bf16
CHECK_VECTORS = 2  # Freivalds' identity on this many +-1 vectors: a wrong element escapes one with probability 1/2
PATTERN_MULTIPLIER = -1640531535  # 2654435761 (Knuth's multiplicative hash) as an int32: neighbours differ widely
IN_FLIGHT = 2  # batches queued ahead of the one the host reads back


@dataclasses.dataclass(frozen=True)
class SoakPlan:
    seconds: float
    n: int  # GEMM size: n x n x n
    load_gemms: int  # timed bf16 GEMMs per batch
    memory_bytes: int  # the pattern buffer, passed over chunk by chunk
    memory_chunk_bytes: int
    copy_bytes: int  # each way, per batch

    @property
    def gemm_flop(self) -> int:
        return 2 * self.n**3


def plan_for(device: torch.device, seconds: float) -> SoakPlan:
    """A GPU: 8192^3 (the size whose healthy sustained rate is known), a batch of about 60 ms on an H200, a
    pattern buffer of a tenth of the GPU's memory up to 16 GiB. A CPU rank: small sizes, same code, and a buffer of
    two chunks, so its memory is verified from the third batch on (eight chunks left a 5 s soak on a loaded 2-core
    host verifying none)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        memory = min(16 * GiB, total // 10 // GiB * GiB or total // 10)
        return SoakPlan(seconds, n=8192, load_gemms=32, memory_bytes=memory,
                        memory_chunk_bytes=min(GiB, memory), copy_bytes=64 * MiB)
    return SoakPlan(seconds, n=256, load_gemms=8, memory_bytes=8 * MiB, memory_chunk_bytes=4 * MiB,
                    copy_bytes=4 * MiB)


# --- Known-answer GEMMs ----------------------------------------------------------------------------------------

def fp8_dtype(device: torch.device) -> torch.dtype | None:
    """float8_e4m3fn where the device has fp8 tensor cores (sm_89 and later) and this torch can multiply it."""
    if device.type != "cuda" or not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return None
    return torch.float8_e4m3fn if torch.cuda.get_device_capability(device) >= (8, 9) else None


class KnownAnswerGemm:
    """One dtype's n^3 GEMM on whole-number operands whose product is exact in every dtype (A: about 128 entries
    of +-1 per row, B: +-1, so every partial sum is a whole number <= 128), checked by Freivalds' identity: (A B) X
    must equal A (B X) for +-1 vectors X, computed once; both sides in float64 (exact, and never TF32).
    `issue()` queues the GEMM and the check on the device and returns a device tensor [wrong rows, first wrong
    row] (no sync)."""

    def __init__(self, device: torch.device, n: int, dtype: torch.dtype, seed: int):
        generator = torch.Generator(device=device).manual_seed(seed)

        def signs(*shape):
            return torch.randint(0, 2, shape, device=device, generator=generator, dtype=torch.int8).float() * 2 - 1

        keep = torch.rand(n, n, device=device, generator=generator) < min(1.0, GEMM_CHECK_NONZEROS / n)
        a, b = signs(n, n) * keep, signs(n, n)
        self.x = signs(n, CHECK_VECTORS).double()
        self.want = a.double() @ (b.double() @ self.x)
        self.dtype, self.name = dtype, str(dtype).removeprefix("torch.")
        self.scaled = dtype.itemsize == 1  # fp8: torch._scaled_mm, B column-major, unit scales
        self.a = a.to(dtype)
        self.b = b.to(dtype).t().contiguous().t() if self.scaled else b.to(dtype)
        self.out = torch.empty(n, n, device=device, dtype=torch.bfloat16 if self.scaled else dtype)
        self.one = torch.ones((), device=device, dtype=torch.float32)
        self.rows = torch.arange(n, device=device)

    def product(self) -> torch.Tensor:
        if self.scaled:
            found = torch._scaled_mm(self.a, self.b, scale_a=self.one, scale_b=self.one, out_dtype=torch.bfloat16)
            return found[0] if isinstance(found, tuple) else found  # older torch: (out, amax)
        return torch.matmul(self.a, self.b, out=self.out)

    def issue(self) -> torch.Tensor:
        wrong = (self.product().double() @ self.x != self.want).any(dim=1)
        first = torch.where(wrong, self.rows, len(self.rows)).min()
        return torch.stack((wrong.sum(), first))


# --- Memory pattern and copies -----------------------------------------------------------------------------------

def pattern(count: int, seed: int, device: torch.device) -> torch.Tensor:
    """int32 values that differ from their neighbours and from one seed to the next: a fresh pattern per pass
    (and per chunk)."""
    index = torch.arange(count, dtype=torch.int32, device=device)
    return (index ^ seed) * PATTERN_MULTIPLIER


class MemoryPattern:
    """A buffer passed over chunk by chunk: each visit verifies what the chunk's previous pass wrote (it sat in
    memory, under load and heat, since) and writes a fresh pattern."""

    def __init__(self, device: torch.device, nbytes: int, chunk_bytes: int):
        self.device, self.chunk = device, chunk_bytes // 4
        self.chunks = max(1, nbytes // chunk_bytes)
        self.buffer = torch.empty(self.chunks * self.chunk, dtype=torch.int32, device=device)

    def issue(self, visit: int) -> tuple[torch.Tensor | None, int]:
        """(device count of wrong words, or None on a chunk's first pass; bytes verified)."""
        chunk, lap = visit % self.chunks, visit // self.chunks
        view = self.buffer[chunk * self.chunk:(chunk + 1) * self.chunk]

        def seed(lap: int) -> int:
            return lap * self.chunks + chunk + 1

        wrong = None
        if lap:
            wrong = (view != pattern(self.chunk, seed(lap - 1), self.device)).sum()
        view.copy_(pattern(self.chunk, seed(lap), self.device))
        return wrong, (self.chunk * 4 if lap else 0)


class Copies:
    """Host -> device and device -> host copies of two alternating patterns (a copy that did not happen leaves
    the other one behind): host -> device checked on the device, device -> host on the host once it has landed."""

    def __init__(self, device: torch.device, nbytes: int):
        pinned = device.type == "cuda"
        count = nbytes // 4
        self.host_source = [pattern(count, -1 - p, torch.device("cpu")) for p in range(2)]
        if pinned:
            self.host_source = [t.pin_memory() for t in self.host_source]
        self.device_source = [t.to(device) for t in self.host_source]
        self.device_dest = torch.empty(count, dtype=torch.int32, device=device)
        # One landing buffer per batch in flight: a later batch's copy must not overwrite one not yet read.
        self.host_dest = [torch.empty(count, dtype=torch.int32, pin_memory=pinned) for _ in range(IN_FLIGHT + 1)]
        self.nbytes = count * 4

    def issue(self, batch: int) -> tuple[torch.Tensor, int]:
        """(device count of wrong words host -> device, the landing buffer to check later)."""
        parity, landing = batch % 2, batch % len(self.host_dest)
        self.device_dest.copy_(self.host_source[parity], non_blocking=True)
        wrong = (self.device_dest != self.device_source[parity]).sum()
        self.host_dest[landing].copy_(self.device_source[parity], non_blocking=True)
        return wrong, landing

    def landed_wrong(self, batch: int, landing: int) -> int:
        found, want = self.host_dest[landing], self.host_source[batch % 2]
        return 0 if torch.equal(found, want) else int((found != want).sum())


# --- Timing ------------------------------------------------------------------------------------------------------

class _Mark:
    """A point in the device's work: a CUDA event, or (CPU, synchronous) the host's clock."""

    def __init__(self, device: torch.device):
        self.event = None
        if device.type == "cuda":
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record(torch.cuda.current_stream(device))
        else:
            self.at = time.perf_counter()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def seconds_since(self, earlier: _Mark) -> float:
        if self.event is not None:
            return earlier.event.elapsed_time(self.event) / 1e3
        return self.at - earlier.at


# --- The soak ----------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Sampler:
    """NVML readings of one GPU (none on a CPU rank). `errors`: {what was asked: "NVML error X"}, to be judged."""
    nvml: object | None = None
    handle: object | None = None
    errors: dict[str, str] = dataclasses.field(default_factory=dict)

    def _ask(self, what: str, call, *args):
        from stackproof.measure.topology import optional

        return optional(self.nvml, self.errors, what, call, self.handle, *args)

    def reasons(self) -> int | None:
        if self.nvml is None:
            return None
        return self._ask("clock-event reasons during the soak", self.nvml.nvmlDeviceGetCurrentClocksEventReasons)

    def reading(self) -> dict[str, float | int | None]:
        if self.nvml is None:
            return {"power_w": None, "temp_c": None, "sm_mhz": None, "mem_mhz": None}
        nvml = self.nvml
        power = self._ask("power during the soak", nvml.nvmlDeviceGetPowerUsage)
        return {"power_w": None if power is None else round(power / 1e3, 1),
                "temp_c": self._ask("temperature during the soak", nvml.nvmlDeviceGetTemperature,
                                    nvml.NVML_TEMPERATURE_GPU),
                "sm_mhz": self._ask("SM clock during the soak", nvml.nvmlDeviceGetClockInfo, nvml.NVML_CLOCK_SM),
                "mem_mhz": self._ask("memory clock during the soak", nvml.nvmlDeviceGetClockInfo,
                                     nvml.NVML_CLOCK_MEM)}

    def limits(self) -> dict[str, float | int | None]:
        """What the GPU should hold to: its power limit and max operating temperature (None where not reported)."""
        if self.nvml is None:
            return {"power_limit_w": None, "max_temp_c": None}
        nvml = self.nvml
        limit = self._ask("enforced power limit", nvml.nvmlDeviceGetEnforcedPowerLimit)
        hottest = self._ask("max operating temperature", nvml.nvmlDeviceGetTemperatureThreshold,
                            nvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX)
        if hottest is None:  # not every GPU reports it: the slowdown threshold is then the line not to reach
            hottest = self._ask("slowdown temperature", nvml.nvmlDeviceGetTemperatureThreshold,
                                nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
        return {"power_limit_w": None if limit is None else round(limit / 1e3, 1), "max_temp_c": hottest}


@dataclasses.dataclass
class Soak:
    """What one device did: a sample per second and every wrong answer, each with the second it happened in."""
    plan: SoakPlan
    dtypes: list[str]  # the known-answer GEMMs' dtypes
    not_run: dict[str, str]  # {dtype: why its known-answer GEMM could not run here}
    samples: list[dict]  # one per second: t, tflops, power_w, temp_c, sm_mhz, mem_mhz, reasons, checked, ...
    wrong: list[dict]  # {t, what, dtype, found}: a known answer, a memory word or a copy that came back wrong
    limits: dict
    gemms: int = 0
    checked: int = 0
    memory_bytes_checked: int = 0
    copy_bytes_checked: int = 0
    seconds: float = 0.0  # the soak's wall time


def _known_answer_gemms(device: torch.device, n: int) -> tuple[list[KnownAnswerGemm], dict[str, str]]:
    dtypes = [torch.bfloat16, torch.float16] + ([fp8] if (fp8 := fp8_dtype(device)) else [])
    made, not_run = [], {}
    for seed, dtype in enumerate(dtypes, 20260127):
        try:
            check = KnownAnswerGemm(device, n, dtype, seed)
            check.issue()  # the first call builds the kernel; a dtype this torch cannot multiply says so here
            made.append(check)
        except (RuntimeError, TypeError, NotImplementedError) as err:
            not_run[str(dtype).removeprefix("torch.")] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    if device.type != "cuda":
        not_run["float8_e4m3fn"] = "no fp8 GEMM on CPU ranks"
    elif fp8_dtype(device) is None:
        not_run["float8_e4m3fn"] = "this GPU has no fp8 tensor cores (sm_89 and later have)"
    return made, not_run


def soak(device: torch.device, plan: SoakPlan, sampler: Sampler,
         on_sample: Callable[[dict], None] | None = None) -> Soak:
    """Load the device for plan.seconds, as the module says; returns what it recorded."""
    checks, not_run = _known_answer_gemms(device, plan.n)
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(plan.n, plan.n, device=device, dtype=torch.bfloat16, generator=generator)
    b = torch.randn(plan.n, plan.n, device=device, dtype=torch.bfloat16, generator=generator)
    out = torch.empty_like(a)
    memory = MemoryPattern(device, plan.memory_bytes, plan.memory_chunk_bytes)
    copies = Copies(device, plan.copy_bytes)
    for _ in range(3):  # warm-up: cuBLAS picks its kernel before the clock starts
        torch.matmul(a, b, out=out)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result = Soak(plan, [c.name for c in checks], not_run, [], [], sampler.limits())
    host_counts = torch.zeros(IN_FLIGHT + 1, 4, dtype=torch.int64, pin_memory=device.type == "cuda")
    pending: list[dict] = []
    second = {"flop": 0, "gemm_s": 0.0, "reasons": 0, "checked": 0, "wrong": 0, "memory_bytes": 0}
    # A CPU rank computes as it queues: its batch has landed, and belongs to this second, not the next batch's.
    ahead = IN_FLIGHT - 1 if device.type == "cuda" else 0
    start = time.monotonic()
    batch = 0

    def queue(batch: int) -> dict:
        first = _Mark(device)
        for _ in range(plan.load_gemms):
            torch.matmul(a, b, out=out)
        timed = _Mark(device)
        check = checks[batch % len(checks)] if checks else None
        known = check.issue() if check else torch.zeros(2, dtype=torch.int64, device=device)
        memory_wrong, memory_bytes = memory.issue(batch)
        copy_wrong, landing = copies.issue(batch)
        counts = torch.stack((known[0], known[1], memory_wrong if memory_wrong is not None else known[0] * 0,
                              copy_wrong)).to(torch.int64)
        slot = host_counts[batch % len(host_counts)]
        slot.copy_(counts, non_blocking=True)
        return {"batch": batch, "first": first, "timed": timed, "end": _Mark(device), "slot": slot,
                "dtype": check.name if check else None, "memory_bytes": memory_bytes, "landing": landing}

    def read_back(done: dict) -> None:
        done["end"].wait()
        t = time.monotonic() - start
        sample_up_to(t)  # a batch that landed after a second ended counts in the next one
        at = min(int(t) + 1, max(1, int(plan.seconds)))  # the second it landed in, 1-based
        known_wrong, first_row, memory_wrong, copy_wrong = (int(v) for v in done["slot"].tolist())
        landed_wrong = copies.landed_wrong(done["batch"], done["landing"])
        second["flop"] += plan.load_gemms * plan.gemm_flop
        second["gemm_s"] += done["timed"].seconds_since(done["first"])
        result.gemms += plan.load_gemms + (1 if done["dtype"] else 0)
        if done["dtype"]:
            result.checked += 1
            second["checked"] += 1
        result.memory_bytes_checked += done["memory_bytes"]
        second["memory_bytes"] += done["memory_bytes"]
        result.copy_bytes_checked += 2 * copies.nbytes
        for what, count, detail in (
                ("known-answer GEMM", known_wrong, f"{known_wrong} of {plan.n} rows wrong (first row {first_row})"),
                ("memory pattern", memory_wrong, f"{memory_wrong} wrong 4-byte words in a "
                                                 f"{plan.memory_chunk_bytes // MiB} MiB chunk"),
                ("host-to-device copy", copy_wrong, f"{copy_wrong} wrong 4-byte words of {copies.nbytes // MiB} MiB"),
                ("device-to-host copy", landed_wrong, f"{landed_wrong} wrong 4-byte words of "
                                                      f"{copies.nbytes // MiB} MiB")):
            if count:
                second["wrong"] += 1
                result.wrong.append({"t": at, "what": what, "dtype": done["dtype"] if what.endswith("GEMM") else "",
                                     "found": detail})
        second["reasons"] |= sampler.reasons() or 0

    def take_sample(t: int) -> None:
        reading = sampler.reading()
        rate = second["flop"] / second["gemm_s"] if second["gemm_s"] else None
        sample = {"t": t, "tflops": None if rate is None else round(rate / 1e12, 4), **reading,
                  "reasons": second["reasons"] if sampler.nvml is not None else None,
                  "checked": second["checked"], "wrong": second["wrong"],
                  "memory_gib_checked": round(second["memory_bytes"] / GiB, 3)}
        result.samples.append(sample)
        second.update(flop=0, gemm_s=0.0, reasons=0, checked=0, wrong=0, memory_bytes=0)
        if on_sample is not None:
            on_sample(sample)

    def sample_up_to(elapsed: float) -> None:
        while len(result.samples) < min(int(elapsed), int(plan.seconds)):
            take_sample(len(result.samples) + 1)

    while True:
        elapsed = time.monotonic() - start
        sample_up_to(elapsed)
        if elapsed >= plan.seconds:
            break
        pending.append(queue(batch))
        batch += 1
        if len(pending) > ahead:
            read_back(pending.pop(0))
    while pending:
        read_back(pending.pop(0))
    if len(result.samples) < int(plan.seconds):  # the last second's batches landed after it ended
        take_sample(len(result.samples) + 1)
    elif result.samples:  # batches queued before the end that landed after it: their readings count in it
        last = result.samples[-1]
        last["checked"] += second["checked"]
        last["wrong"] += second["wrong"]
        if last["reasons"] is not None:
            last["reasons"] |= second["reasons"]
    result.seconds = round(time.monotonic() - start, 2)
    return result
