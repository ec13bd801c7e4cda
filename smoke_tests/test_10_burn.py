"""The burn-in tier (--tier burn, after the fast tier's checks): every GPU of the node loaded at once for
--burn-seconds, with known-answer GEMMs in bf16, fp16 and fp8 (where the GPU has it), memory pattern passes and
host<->device copies checked throughout, and a sample of each GPU every second (stackproof/measure/burn.py).
The checks judge the soak over time (stackproof/judge/burn.py): a failure names the GPU and the second of the soak,
with its temperature and clocks then. The series go into report.json (tables burn_series and burn_bars) and the
HTML page plots them. On CPU ranks the same code runs small CPU GEMMs for a short soak."""

import contextlib
import functools
import socket

import pytest
import torch

from stackproof.judge import burn as rules
from stackproof.judge import per_gpu
from stackproof.judge.findings import Judged
from stackproof.judge.health import nvml_error_finding
from stackproof.judge.promise import SOAK, Needs
from stackproof.measure import burn, health, topology

pytestmark = pytest.mark.check(SOAK, Needs())

HOST = socket.gethostname()
SAY_EVERY_S = 10  # one progress line per this many seconds on stdout (the contract: at most one a second)


def _local(step):
    try:
        return step(), None
    except Exception as err:
        return None, err


def _model(dist_env) -> str:
    if not dist_env.is_gpu:
        return "CPU rank"
    props = torch.cuda.get_device_properties(dist_env.device)
    return f"{props.name} ({props.multi_processor_count} SMs)"


@pytest.fixture(scope="module")
def state():
    return {}


def _facts(dist_env, settings, nvml):
    """(this rank's GPU index and UUID, its sustained bar, the sampler): from NVML on a GPU rank."""
    if not dist_env.is_gpu:
        return None, "", rules.bars.Bar(None, "no GPU bar on CPU ranks (CPU GEMMs: throughput reported)"), \
            burn.Sampler()
    props = torch.cuda.get_device_properties(dist_env.device)
    uuid = str(props.uuid)
    torch.zeros(1, device=dist_env.device)
    handle = health.handle_of(nvml, uuid)
    gpu = topology.read_gpu(nvml, nvml.nvmlDeviceGetIndex(handle), settings.pci_devices)
    bar = rules.sustained_bar(props.multi_processor_count, gpu.max_sm_clock_mhz, (props.major, props.minor),
                              settings.burn_fraction)
    return gpu.index, gpu.uuid, bar, burn.Sampler(nvml, handle)


def _soak(state, dist_env, settings, report):
    """The soak, run once for the module by the first check that asks (every rank asks in the same check), with
    its series recorded in report.json and summarised on stdout."""
    if state:
        return state
    total = int(settings.burn_seconds)

    def progress(sample):
        if sample["t"] % SAY_EVERY_S == 0 or sample["t"] == total:
            who = "rank 0's GPU" if dist_env.is_gpu else "rank 0"
            report.say(f"# burn {sample['t']}/{total} s, {who}: {rules.moment(sample, total)}")

    def soak_here():
        with contextlib.ExitStack() as session:
            def prepare():  # NVML opened in here: a rank that cannot open it still meets the others below
                nvml = session.enter_context(topology.nvml_session()) if dist_env.is_gpu else None
                return _facts(dist_env, settings, nvml)

            prepared, error = _local(prepare)
            failed = dist_env.agree(error is not None, "every GPU ready to soak",
                                    decide=lambda failures: [r for r, f in enumerate(failures) if f])
            if error is not None:
                raise error
            if failed:
                raise RuntimeError(f"rank(s) {failed} could not start the soak (see their message)")
            index, uuid, bar, sampler = prepared
            plan = burn.plan_for(dist_env.device, settings.burn_seconds)
            result = burn.soak(dist_env.device, plan, sampler, progress if dist_env.is_main else None)
            return index, uuid, bar, sampler, result

    here, error = _local(soak_here)
    index, uuid, bar, sampler, result = here or (None, "", None, burn.Sampler(), None)
    samples = result.samples if result else []
    figures = rules.sustained(samples)
    model = _model(dist_env)
    peers = dist_env.agree({"model": model, "value": figures["last"]}, "the sustained throughputs",
                           decide=functools.partial(per_gpu.below_median_by_model, tolerance=settings.gpu_spread))
    row = {"host": HOST, "rank": dist_env.rank, "gpu": index, "uuid": uuid, "model": model}
    sag = settings.burn_sag if settings.burn_sag is not None else (rules.SAG_GPU if dist_env.is_gpu else None)
    bars_row = {**row, "bar_tflops": None if bar is None or bar.value is None else round(bar.value / 1e12, 1),
                "bar_source": "" if bar is None else bar.source,
                "first_tflops": figures["first"], "first_seconds": figures["first_seconds"],
                "last_tflops": figures["last"], "last_seconds": figures["last_seconds"],
                "sag_floor_tflops": None if sag is None or not figures["first"] else
                round((1 - sag) * figures["first"], 4),
                "peer_median_tflops": (peers["median"] or {}).get(model),
                "peer_floor_tflops": None if (peers["median"] or {}).get(model) is None else
                round((1 - settings.gpu_spread) * peers["median"][model], 4),
                **(result.limits if result else {}), "seconds": result.seconds if result else None,
                "gemms": result.gemms if result else 0, "checked": result.checked if result else 0}
    every = dist_env.gather({"series": [{**row, **s} for s in samples], "bars": bars_row}, "the burn-in series")
    if every is not None:
        report.table("burn_series", [s for rank in every for s in rank["series"]])
        report.table("burn_bars", [rank["bars"] for rank in every])
        _say_summary(report, [rank["bars"] for rank in every], [rank["series"] for rank in every], total)
    state.update(error=error, index=index, uuid=uuid, bar=bar, sampler=sampler, result=result, samples=samples,
                 figures=figures, peers=peers, model=model, sag=sag, total=total)
    return state


def _say_summary(report, rows, series, total):
    report.say(f"# burn-in: {total} s, every GPU at once; TFLOP/s of bf16 GEMMs, median over the seconds named\n"
               f"#{'host':>14} {'gpu':>4} {'first':>9} {'last':>9} {'bar':>8} {'sag':>6} {'max C':>6} "
               f"{'max W':>7} {'SM MHz':>13} {'reasons':>8} {'checked':>8}\n"
               f"#{'':>14} {'':>4} {'(TFLOP/s)':>9} {'(TFLOP/s)':>9} {'':>8} {'':>6} {'':>6} {'':>7} "
               f"{'(min-max)':>13}")
    for row, samples in zip(rows, series, strict=True):
        first, last = row["first_tflops"], row["last_tflops"]
        sms = [s["sm_mhz"] for s in samples if s.get("sm_mhz") is not None]
        reasons = rules.reasons_seen(samples)
        report.say(f"  {str(row['host'])[:14]:>13} {row['gpu'] if row['gpu'] is not None else '-':>4} "
                   f"{_num(first):>9} {_num(last):>9} {_num(row['bar_tflops']):>8} "
                   f"{f'{last / first - 1:+.1%}' if first and last else '-':>6} "
                   f"{_num(rules.peak(samples, 'temp_c')):>6} {_num(rules.peak(samples, 'power_w')):>7} "
                   f"{f'{min(sms)}-{max(sms)}' if sms else '-':>13} "
                   f"{hex(reasons) if reasons is not None else '-':>8} {row['checked']:>8}")


def _num(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def _where(s) -> str:
    gpu = f"GPU {s['index']} ({s['uuid']})" if s["index"] is not None else "CPU rank"
    return f"{HOST} {gpu}"


def _soaked(state, dist_env, settings, report):
    s = _soak(state, dist_env, settings, report)
    if s["error"] is not None:
        raise s["error"]
    return s


def test_gemms_give_known_answers_throughout(state, dist_env, settings, report):
    s = _soaked(state, dist_env, settings, report)
    result = s["result"]
    wrong = [w for w in result.wrong if w["what"] == "known-answer GEMM"]
    findings = rules.wrong_answers(s["index"], s["uuid"], wrong, s["samples"], s["total"])
    report.figure("gemms", result.gemms)
    report.figure("known_answers_checked", result.checked)
    report.figure("checked_share", f"1 in {result.plan.load_gemms + 1}")
    report.figure("dtypes", ", ".join(result.dtypes))
    for dtype, why in result.not_run.items():
        report.figure(f"not_run[{dtype}]", why)
    report.figure("soak", result.seconds, "s")
    # A second without a check had no batch finish in it: the GPU stalled, which the throughput check judges
    # (a second without a finished GEMM counts as 0 TFLOP/s there); here it is said.
    quiet = [x["t"] for x in s["samples"] if not x["checked"]]
    report.figure("seconds_unchecked", ", ".join(map(str, quiet[:10])) + (" ..." if len(quiet) > 10 else "")
                  if quiet else "none")
    if not (findings or result.checked):
        findings = [rules.too_short("at least one batch of known-answer GEMMs",
                                    "the soak ended before any known-answer GEMM was checked")]
    return Judged(findings, hint=rules.GEMM_FIX, where=_where(s))


def test_memory_and_copies_hold_their_data(state, dist_env, settings, report):
    s = _soaked(state, dist_env, settings, report)
    result = s["result"]
    wrong = [w for w in result.wrong if w["what"] != "known-answer GEMM"]
    findings = rules.wrong_answers(s["index"], s["uuid"], wrong, s["samples"], s["total"])
    report.figure("memory_checked", round(result.memory_bytes_checked / burn.GiB, 2), "GiB")
    report.figure("pattern_buffer", round(result.plan.memory_bytes / burn.GiB, 3), "GiB")
    report.figure("copies_checked", round(result.copy_bytes_checked / burn.GiB, 2), "GiB")
    if not (findings or result.memory_bytes_checked):
        findings = [rules.too_short("a pass over the whole pattern buffer",
                                    "the soak ended before any memory chunk was verified")]
    return Judged(findings, hint=rules.DATA_FIX, where=_where(s))


@pytest.mark.check(SOAK, Needs(),
                   optional="CPU ranks share the host's cores: judged only with --burn-sag",
                   optional_on=("cpu",), promised_by="burn_sag")
def test_throughput_holds_over_time(state, dist_env, settings, report):
    s = _soaked(state, dist_env, settings, report)
    figures, bar = s["figures"], s["bar"]
    # Per GPU (name@host:gpu): what a baseline of known-good burn runs holds each GPU to (judge/baseline.py).
    for name, value in (("burn_first", figures["first"]), ("burn_sustained", figures["last"])):
        if value is not None:
            report.figure(f"{name}@{HOST}:{s['index']}" if s["index"] is not None else name, round(value, 4),
                          "TFLOP/s")
    report.figure("first_seconds", figures["first_seconds"])
    report.figure("last_seconds", figures["last_seconds"])
    report.figure("burn_sustained_bar", "none" if bar.value is None else round(bar.value / 1e12, 1), "TFLOP/s")
    findings = rules.throughput(s["index"], s["uuid"], s["samples"], bar, s["sag"], s["total"])
    if s["sag"] is None and not findings:
        pytest.skip(f"CPU ranks share the host's cores: throughput reported ({figures['first']} then "
                    f"{figures['last']} TFLOP/s), judged only with --burn-sag")
    return Judged(findings, hint=rules.THROUGHPUT_HINT, where=_where(s))


# CPU ranks share the host's cores: no rank is held to the others. The job's GPUs are the peers (those of
# another model have their own median).
@pytest.mark.check(SOAK, Needs(gpu=True, ranks=2))
def test_no_gpu_lags_its_peers(state, dist_env, settings, report):
    s = _soaked(state, dist_env, settings, report)
    median = (s["peers"]["median"] or {}).get(s["model"])
    if median is not None:
        report.figure("median", round(median, 4), "TFLOP/s")
    findings = rules.behind_peers(s["index"], s["uuid"], s["samples"], median, settings.gpu_spread, s["model"],
                                  s["total"]) if median is not None else []
    return Judged(findings, hint=rules.THROUGHPUT_HINT, where=_where(s))


@pytest.mark.check(SOAK, Needs(gpu=True))  # NVML's clocks and temperature
def test_clocks_and_temperature_hold(state, dist_env, settings, report):
    s = _soaked(state, dist_env, settings, report)
    samples, limits = s["samples"], s["result"].limits
    findings = rules.clocks(s["index"], s["uuid"], samples, s["total"])
    findings += rules.temperature(s["index"], s["uuid"], samples, limits.get("max_temp_c"), s["total"])
    findings += [nvml_error_finding(s["index"], s["uuid"], what, error) for what, error in s["sampler"].errors.items()]
    for name, key, unit in (("max_temp", "temp_c", "C"), ("max_power", "power_w", "W")):
        report.figure(name, rules.peak(samples, key) if rules.peak(samples, key) is not None else "n/a", unit)
    report.figure("max_operating_temp", limits.get("max_temp_c") or "n/a", "C")
    report.figure("power_limit", limits.get("power_limit_w") or "n/a", "W")
    reasons = rules.reasons_seen(samples)
    report.figure("clock_event_reasons_seen", "n/a" if reasons is None else hex(reasons))
    return Judged(findings, where=_where(s), hint="check cooling (fans, airflow, inlet temperature) and the power "
                  "supplies of the GPU named; nvidia-smi -q -d PERFORMANCE,TEMPERATURE shows the same reasons")

