"""No PASS without a judgement: which checks each tier promises on each kind of host, and which of them a run
did not judge (docs/report-format.md, "What a run promises").

A check is judged when it passed or failed. A skipped check was not judged (no bar, no GPU, nothing to compare
with), and neither was a promised check that never ran. A run that judged no check at all, or left a promised
check unjudged, is not OK: exit 4, the run did not complete its proof. Not exit 1: no check found the machine
at fault, so nothing is to be drained for it (stackproof/act acts on exit 1 only).

`-k` (or pytest arguments after `--`) is a person choosing to prove less: the promise shrinks to the checks
the selection holds, and the checks it left out are named (`left_out`), not held against the run.

Pure: plain report.json data in, names out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from stackproof.errors import ConfigError

HOST_KINDS = ("gpu", "cpu")
JUDGED = ("passed", "failed")

# What each tier promises, by host kind: check names (module::check: every parametrization of it;
# module::check[params]: that one), or a module (`module::`: every check of it). The checks whose bars every
# machine of the kind has: on a GPU host its identity and health, silent data corruption, memory and host
# links; on CPU ranks, what gloo can judge.
# Not promised: checks whose bar may be absent for a reason that is not a fault (GEMM: no table for the GPU's
# architecture; busbw across nodes without --min-busbw; pairs of 2 CPU ranks; stragglers on shared cores).
_FAST_GPU = ("host::dev_shm_is_large_enough", "gpus::torch_sees_the_expected_gpus",
             "gpus::gpus_have_what_they_should", "gpus::driver_supports_the_image_cuda", "gpus::every_gpu_computes",
             "per_gpu::health_history", "per_gpu::sdc_digest", "per_gpu::hbm_bandwidth",
             "per_gpu::host_device_copies", "per_gpu::no_xid_during_the_run")
_FAST_CPU = ("host::dev_shm_is_large_enough",)
# The burn-in soak's checks. Not promised: the peers rule (one GPU of a model has none), and on CPU ranks the
# throughput (shared cores: judged only with --burn-sag) and the clocks (no NVML).
_BURN_CPU = ("burn::gemms_give_known_answers_throughout", "burn::memory_and_copies_hold_their_data")
_BURN_GPU = (*_BURN_CPU, "burn::throughput_holds_over_time", "burn::clocks_and_temperature_hold")
PROMISES: dict[tuple[str, str], tuple[str, ...]] = {
    ("fast", "gpu"): _FAST_GPU,
    ("fast", "cpu"): _FAST_CPU,
    ("burn", "gpu"): (*_FAST_GPU, *_BURN_GPU),
    ("burn", "cpu"): (*_FAST_CPU, *_BURN_CPU),
    ("full", "gpu"): (*_FAST_GPU, "collectives::", "ddp_resnet::", "compile::"),
    # What gloo does depends on the torch: averaging (older ones refuse AVG, none averages integers) and
    # reduce_scatter's other ops are judged where they run, promised only as sums.
    ("full", "cpu"): (*_FAST_CPU, "collectives::barrier", "collectives::all_reduce[sum-float32]",
                      "collectives::reduce_scatter[sum]", "collectives::reduce[sum]", "collectives::broadcast",
                      "collectives::all_gather", "ddp_resnet::", "compile::"),
}
# Promised when its setting is given, on every host and tier: a person asked for this bar.
PROMISED_BY_SETTING = {"spec": "node_spec::matches_the_spec"}


def host_kind(world: Mapping[str, Any]) -> str:
    """GPU ranks run NCCL; CPU ranks gloo."""
    return "gpu" if world.get("backend") == "nccl" else "cpu"


def base_name(name: str) -> str:
    """collectives::all_reduce[sum-float32] -> collectives::all_reduce."""
    return name.split("[", 1)[0]


def covers(promise: str, name: str) -> bool:
    if promise.endswith("::"):
        return name.startswith(promise)
    return name == promise if "[" in promise else base_name(name) == promise


def promises(tier: str, kind: str, settings: Mapping[str, Any]) -> tuple[str, ...]:
    given = tuple(check for setting, check in PROMISED_BY_SETTING.items() if settings.get(setting))
    return PROMISES[(tier, kind)] + given


def narrowed(settings: Mapping[str, Any]) -> bool:
    """A person selected the checks: -k, or pytest's own arguments after --."""
    return bool(settings.get("select")) or bool(settings.get("pytest_args"))


def unjudged(checks: Iterable[tuple[str, str, str]], planned: Iterable[str], settings: Mapping[str, Any],
             world: Mapping[str, Any]) -> list[str]:
    """The promised checks this run did not judge, each with why: `name: skipped: <reason>` or `name: not run`.
    `checks`: (name, outcome, message) of every check that reported; `planned`: the selected checks' names."""
    checks, planned = list(checks), list(planned)
    said = []
    for promise in promises(str(settings.get("tier", "full")), host_kind(world), settings):
        mine = [c for c in checks if covers(promise, c[0])]
        if not mine and not any(covers(promise, name) for name in planned):
            if not narrowed(settings):
                said.append(f"{promise.removesuffix('::')}: not in this run's suite")
            continue
        said += [f"{name}: skipped: {message.splitlines()[0] if message else 'no reason given'}"
                 for name, outcome, message in mine if outcome not in JUDGED]
    return said


def left_out(planned: Iterable[str], settings: Mapping[str, Any], world: Mapping[str, Any]) -> list[str]:
    """The promised checks a -k selection left out (said in the report; not held against the run)."""
    if not narrowed(settings):
        return []
    planned = list(planned)
    return [promise.removesuffix("::") for promise in promises(str(settings.get("tier", "full")), host_kind(world),
                                                               settings)
            if not any(covers(promise, name) for name in planned)]


def nothing_judged(checks: Iterable[tuple[str, str, str]]) -> str | None:
    """Why no check was judged (every one skipped), or None."""
    checks = list(checks)
    if not checks or any(outcome in JUDGED for _, outcome, _ in checks):
        return None
    name, _, message = checks[0]
    return f"every check skipped, e.g. {name}: {message.splitlines()[0] if message else 'no reason given'}"


def require_known_good(source: str, report: Mapping[str, Any], made: str) -> None:
    """A report a baseline or spec is made from must be of a complete run where every check passed: one made
    from failing runs would hold later runs to a broken machine. Anything else is refused (exit 2), naming the
    field that is not so: `complete` first (a run still going, or stopped, says OK nowhere it can be trusted)."""
    said = f"{report.get('verdict')!r} (exit code {report.get('exit_code')}: {report.get('message')})"
    if report.get("complete") is not True:
        field, expected, found = ("complete", "true (a run that finished and wrote its final verdict)",
                                  f"{report.get('complete')!r}: the run was still going or was stopped, verdict "
                                  + said)
    elif report.get("verdict") != "OK":
        field, expected, found = "verdict", "OK (a complete run where every check passed)", said
    elif report.get("exit_code") != 0:
        field, expected, found = "exit_code", "0 (every check ran and passed)", said
    else:
        return
    raise ConfigError(f"{source}: field '{field}': expected {expected}, found {found}; a {made} made from failing "
                      "runs (or unfinished ones) would hold later runs to a broken machine; fix: leave this report "
                      "out (or run the node again to the end)")
