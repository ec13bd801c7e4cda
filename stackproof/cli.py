"""The command line: `stackproof validate` proves a machine + image; `stackproof healthcheck` / `act` drain or
taint a node that failed; `stackproof baseline`, `spec` and `report` turn reports into a baseline, a node spec
and an HTML page; `stackproof bench` prints figures; `stackproof images ...` keeps the matrix, locks and build
plan consistent; `stackproof attest` signs a run's result onto its image digest and `stackproof verify-image`
refuses an image without a passing result for this node's class. Errors print one line (what was expected,
what was found, the fix), no traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from stackproof import __version__, files, pipes
from stackproof.errors import HEALTHCHECK_EXIT_HELP, ConfigError, Exit, StackproofError
from stackproof.report import outputs
from stackproof.run.config import ValidateConfig
from stackproof.run.launch_env import LAUNCHED_ENV, RUN_ENDS_ENV
from stackproof.run.local_ranks import LEAVING_FD_ENV
from stackproof.settings import argument, parse_seconds, parse_signal

EXIT_CODES_HELP = "exit codes: " + ", ".join(f"{int(code)} {code.meaning}" for code in Exit)
ENVIRONMENT_HELP = ("environment: " + ", ".join(f"{name} (as {flag})" for name, flag in
                                                ValidateConfig.environment().items())
                    + f"; a flag given wins. {LAUNCHED_ENV}, {RUN_ENDS_ENV} (when it stops them) and {LEAVING_FD_ENV} "
                    "(where a rank says it leaves) are set by the launcher that starts the ranks.")


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag exits with stackproof's usage code and one line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"{self.prog}: {message} (see: {self.prog} --help)", file=sys.stderr)
        sys.exit(Exit.USAGE)


def _validate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="run the validation suite on every visible GPU (or 2 CPU ranks)",
                       description="Run the suite on every visible GPU (one rank each, NCCL) or on CPU ranks (gloo). "
                                   "Under torchrun or srun, run as the rank given. " + EXIT_CODES_HELP + ".",
                       epilog=ENVIRONMENT_HELP)
    ValidateConfig.add_arguments(p)


def _verdict_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verdict", help="settle and print a run's verdict (for launchers: scripts/torchrun, "
                                       "scripts/slurm's srun mode); exits with its code",
                       description="Read <reports>/report.json, add what the launcher saw, print the table and "
                                   "the verdict, and exit with its code. " + EXIT_CODES_HELP + ".")
    p.add_argument("--reports", type=Path, required=True, metavar="DIR", help="the run's reports folder")
    p.add_argument("--launcher-exit", type=int, metavar="RC", help="the exit code of torchrun / srun")
    p.add_argument("--timed-out", type=argument(parse_seconds), metavar="S",
                   help="the launcher stopped the run after S seconds")
    p.add_argument("--interrupted", type=argument(parse_signal), metavar="SIGNAL",
                   help="the launcher was interrupted by SIGNAL (SIGTERM, TERM or 15)")


# healthcheck keeps its runs (report/folders.py): the run that drained a node outlives the hourly ones after it.
HEALTHCHECK_DEFAULTS = {"tier": "fast", "keep_runs": 20}


def _act_parsers(sub: argparse._SubParsersAction) -> None:
    from stackproof.act.config import ActConfig

    p = sub.add_parser("healthcheck", help="validate this node (tier fast by default), then drain (Slurm) or "
                                           "label/taint (Kubernetes) it if a check failed",
                       description="For Slurm's HealthCheckProgram or Prolog, or a Kubernetes DaemonSet: run "
                                   "validate on this node (--tier fast unless given), then act as the policy table "
                                   "says (docs/act.md): a hardware failure drains / taints the node (within "
                                   "--max-drained); an image, pins or settings failure, bad input, the tool's own "
                                   "timeout or an interruption are reported and alerted on, never acted on. "
                                   + HEALTHCHECK_EXIT_HELP + ".",
                       epilog=ENVIRONMENT_HELP)
    ActConfig.add_arguments(p.add_argument_group("acting on the verdict"))
    ValidateConfig.add_arguments(p.add_argument_group("validate's settings"), defaults=HEALTHCHECK_DEFAULTS)
    p.set_defaults(**HEALTHCHECK_DEFAULTS)
    p = sub.add_parser("act", help="act on a finished run's report.json (every node it names)",
                       description="Read <reports>/report.json and act on each failed node it names, with the "
                                   "policy of healthcheck (docs/act.md). Exit 0 when done (acting or not), 2 when "
                                   "the report cannot be read or any node's action failed (every node is tried).")
    p.add_argument("--reports", type=Path, required=True, metavar="DIR", help="the run's reports folder")
    ActConfig.add_arguments(p, hidden=ActConfig.HEALTHCHECK_ONLY)


def _baseline_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("baseline", help="make a baseline (median of each figure per GPU model and topology) from "
                                        "known-good reports, for validate --baseline",
                       description="Read passing report.json files (or reports folders) and write the median of "
                                   "each figure, per GPU model and topology, for `validate --baseline` (see "
                                   "docs/baseline.md). Failing reports and other schemas are refused (exit 2).")
    p.add_argument("reports", nargs="+", type=Path, metavar="REPORT", help="report.json files or reports folders")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="FILE", help="the baseline JSON to write")


def _spec_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("spec", help="make a node spec (GPU count and model, memory, NVLinks, PCIe, ECC, "
                                    "persistence, MIG, driver, VBIOS, power limit) from known-good reports, for "
                                    "validate --spec",
                       description="Read passing report.json files (or reports folders) of GPU runs and write "
                                   "what each kind of node (GPU model, GPUs per node) should be, for `validate "
                                   "--spec` (see docs/spec.md). Failing reports, CPU runs and values that differ "
                                   "between the runs are refused (exit 2).")
    p.add_argument("reports", nargs="+", type=Path, metavar="REPORT", help="report.json files or reports folders")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="FILE", help="the spec JSON to write")


def _report_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="one self-contained HTML page of runs: verdicts, checks, nodes, busbw and "
                                      "per-GPU plots (needs stackproof[report])",
                       description="Draw report.json files (or reports folders) as one self-contained HTML page "
                                   "(see docs/report-html.md). Needs the extra: pip install 'stackproof[report]'.")
    p.add_argument("reports", nargs="+", type=Path, metavar="REPORT", help="report.json files or reports folders")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="FILE", help="the HTML file to write")
    p.add_argument("--reference", type=Path, metavar="FILE", action="append", default=[],
                   help="an nccl-tests all_reduce_perf stdout to draw beside the sweep (repeatable: e.g. eager "
                        "and -G)")


def _images_parser(sub: argparse._SubParsersAction) -> None:
    from stackproof.images import bake

    p = sub.add_parser("images", help="the image matrix, its locks and the build plan")
    images = p.add_subparsers(dest="images_command", required=True, metavar="{list,check,lock,bake}")
    images.add_parser("list", help="the images of images/matrix.toml, one line each")
    check = images.add_parser("check", help="matrix vs locks vs torch's wheel metadata; exit 2 on any disagreement")
    check.add_argument("--offline", action="store_true", help="skip the metadata read from PyPI")
    check.add_argument("names", nargs="*", metavar="IMAGE", help="only these images (default: all)")
    lock = images.add_parser("lock", help="regenerate hashed locks with uv from the matrix")
    lock.add_argument("names", nargs="*", metavar="IMAGE", help="only these images (default: all + validation)")
    bake.add_arguments(images.add_parser("bake", help="write the bake file of matrix values (build/images.bake.json)"))


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    from stackproof.bench.parallel import ParallelBench
    from stackproof.bench.resnet import ResnetBench

    p = sub.add_parser("bench", help="benchmarks that print figures (no verdict)")
    bench = p.add_subparsers(dest="bench_command", required=True, metavar="{resnet,parallel}", parser_class=_Parser)
    ResnetBench.add_arguments(bench.add_parser(
        "resnet", help="ResNet-50 DDP training img/s on 1..N GPUs, eager and --compile",
        description="ResNet-50 (torchvision) under DDP, bf16 autocast, channels_last, synthetic data on the device: "
                    "img/s per GPU, the total, scaling from one GPU, and torch.compile's compile time."))
    ParallelBench.add_arguments(bench.add_parser(
        "parallel", help="DataParallel beside DDP on every visible GPU: img/s, each GPU's peak memory, step split",
        description="ResNet-50 under DataParallel (one process over every visible GPU) and under DDP (one rank "
                    "per GPU): img/s, each GPU's peak memory, forward/backward/optimizer time; a table, "
                    "-o JSON and --plot SVG. On one GPU it runs both and says a comparison needs 2+."))


def _attest_parsers(sub: argparse._SubParsersAction) -> None:
    from stackproof.images.attest import PREDICATE_TYPE
    from stackproof.images.attest_config import AttestConfig, VerifyImageConfig

    p = sub.add_parser("attest", help="sign a validation run's result on its image digest (in-toto test-result, "
                                      "per node class) and attach it in the registry (cosign, no tlog)",
                       description=f"Read <reports>/report.json and attach to the image digest the run ran in a "
                                   f"signed {PREDICATE_TYPE} statement: PASSED or FAILED (a run that was not OK is "
                                   "attested FAILED), the node class, the stackproof version, the spec and baseline "
                                   "digests, the node, the time and the check names (docs/attest.md). Exit 0 "
                                   "attested, 1 cosign or the registry failed (no registry answers), 2 bad input "
                                   "(no image digest, an image the registry does not hold, a key cosign cannot "
                                   "use or a wrong COSIGN_PASSWORD, a record that does not say its node class, "
                                   "cosign not the pinned version).")
    AttestConfig.add_arguments(p)
    p = sub.add_parser("verify-image", help="exit 0 only when an image digest holds a signed PASSED result for "
                                            "this node class (else exit 1, one line saying what is missing)",
                       description="Verify the test results attached to REF with cosign (the key, the statement's "
                                   "shape) and decide here: the newest result for the node class must be PASSED, "
                                   "no older than --max-age. Exit 0 proven; 1 refused, with one line: no "
                                   "attestation, wrong key, wrong class, FAILED, too old, digest mismatch (a "
                                   "REPO:TAG@sha256:... whose tag moved), no such image, registry unreachable; 2 "
                                   "bad input (a key cosign cannot use; docs/attest.md).")
    p.add_argument("reference", metavar="REF", help="REPO:TAG, REPO@sha256:... or REPO:TAG@sha256:...")
    VerifyImageConfig.add_arguments(p)
    sub.add_parser("node-class", help="print this node's class (GPU model x count, driver, CUDA, NICs) as "
                                      "verify-image --node-class takes it",
                   description="This node's class from NVML and sysfs, one line (docs/attest.md).")


def _warm_agent_parser(sub: argparse._SubParsersAction) -> None:
    from stackproof.run.warm import DEFAULT_SOCKET, SOCKET_ENV

    p = sub.add_parser("warm-agent", help="stay resident with torch imported (CUDA untouched) and fork one node's "
                                          "ranks on request: validate and healthcheck start in milliseconds",
                       description="A warm start for validate/healthcheck on this node (stackproof/run/warm.py, "
                                   "deploy/systemd/stackproof-warm-agent.service). Run it unprivileged; it holds "
                                   "no GPU memory and no CUDA context while idle. Stop it with SIGTERM.")
    p.add_argument("--socket", default=None, metavar="PATH",
                   help=f"where to listen (default: ${SOCKET_ENV}, else {DEFAULT_SOCKET}); mode 0660")
    p.add_argument("--group", default=None, metavar="GROUP", help="the socket's group (who may ask it)")


# Each command's parser, built only when its command is the one given (`stackproof healthcheck ...` imports neither
# the image tooling nor the benchmarks: tenths of a second on every Prolog and every rank); all of them for the top
# level's --help or a command mistyped.
PARSERS = {"validate": _validate_parser, "verdict": _verdict_parser, "healthcheck": _act_parsers, "act": _act_parsers,
           "baseline": _baseline_parser, "spec": _spec_parser, "report": _report_parser, "images": _images_parser,
           "bench": _bench_parser, "warm-agent": _warm_agent_parser, "attest": _attest_parsers,
           "verify-image": _attest_parsers, "node-class": _attest_parsers}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser, or `command`'s alone when it is one."""
    parser = _Parser(prog="stackproof", description=__doc__, epilog=EXIT_CODES_HELP + ".")
    parser.add_argument("--version", action="version", version=f"stackproof {__version__}")
    sub = parser.add_subparsers(dest="command", required=True,  # argparse lists the commands
                                parser_class=_Parser)
    builders = [PARSERS[command]] if command in PARSERS else list(dict.fromkeys(PARSERS.values()))
    for build in builders:
        build(sub)
    return parser


def _validate(args: argparse.Namespace) -> int:
    from stackproof.run.launcher import validate

    return validate(ValidateConfig.from_args(args))


def _verdict(args: argparse.Namespace) -> int:
    from stackproof.report import folders
    from stackproof.report.attestation import read_record, record_line
    from stackproof.report.record import REPORT_FILE
    from stackproof.run import settle

    # A folder that keeps its runs: the newest; a run's report.json: its folder (as act and report take it).
    reports = args.reports.parent if args.reports.name == REPORT_FILE and args.reports.is_file() \
        else folders.current(args.reports)
    attested = read_record(reports)
    if attested:  # before the table: the last two lines stay the verdict and the report's path
        print(f"# stackproof: {record_line(attested)}", flush=True)
    return int(settle.conclude(reports, sys.stdout, launcher_exit=args.launcher_exit,
                               interrupted=args.interrupted, timed_out_s=args.timed_out).exit_code)


def _healthcheck(args: argparse.Namespace) -> int:
    """Any crash here goes up to act/contract.py's guard (python -m stackproof healthcheck), which keeps the
    scheduler's contract: it never becomes the taken-out code."""
    from stackproof.act import run
    from stackproof.act.config import ActConfig

    try:
        settings, act_settings = ValidateConfig.from_args(args), ActConfig.from_args(args)
    except ConfigError as err:
        if args.guarded:
            raise  # the contract says it: exit 0, and its metric that nothing was judged
        return run.bad_input(err, sys.stdout)
    return run.healthcheck(settings, act_settings, sys.stdout)


def _act(args: argparse.Namespace) -> int:
    from stackproof.act import run
    from stackproof.act.config import ActConfig

    if getattr(args, "skip_busy_gpus", False):
        raise ConfigError("--skip-busy-gpus: expected only with healthcheck (it chooses the GPUs this node checks), "
                          "found it with act, which reads a finished run's report; fix: leave it out")
    return run.act_on_reports(args.reports, ActConfig.from_args(args), sys.stdout)


def _baseline(args: argparse.Namespace) -> int:
    import json

    from stackproof.report import baseline

    output = outputs.output_file(args.output, "baseline", "baseline.json", args.reports,
                               remakes=outputs.remade_json(baseline.SCHEMA))
    made, said = baseline.make(args.reports)
    files.write_text(output, json.dumps(made, indent=2) + "\n")
    print("\n".join(said))
    for entry in made["entries"]:
        figures = sum(len(f) for f in entry["figures"].values())
        print(f"# {baseline.key_text(entry['key'])}: {figures} figures from {len(entry['reports'])} report(s)")
    print(f"# baseline: {args.output}")
    return 0


def _spec(args: argparse.Namespace) -> int:
    import json

    from stackproof.judge import spec
    from stackproof.report.record import read_report

    out = outputs.output_file(args.output, "spec", "spec.json", args.reports, remakes=outputs.remade_json(spec.SCHEMA))
    made = spec.make_spec({str(path): read_report(path) for path in args.reports})
    files.write_text(out, json.dumps(made, indent=2) + "\n")
    for warning in spec.unheld(made):
        print(f"stackproof: warning: {warning}", file=sys.stderr)
    for entry in made["entries"]:
        print(f"# {spec.key_text(entry['key'])}: from {len(entry['reports'])} report(s): "
              + ", ".join(f"{k}={v}" for k, v in entry["expect"].items()))
    print(f"# spec: {out}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from stackproof.report import page

    output = outputs.output_file(args.output, "HTML page", "page.html", [*args.reports, *args.reference],
                               remakes=lambda path: path.suffix in (".html", ".htm"))
    path, missing = page.write(args.reports, output, references=args.reference)
    for folder in missing:
        print(f"stackproof: warning: {folder}: expected a report.json, found none; the page lists it as missing "
              "and draws the others", file=sys.stderr)
    print(f"# report: {path}")
    return 0


def _images(args: argparse.Namespace) -> int:
    from stackproof.images import bake, locks
    from stackproof.images.matrix import load_matrix

    matrix = load_matrix()
    chosen = [matrix.get(name) for name in getattr(args, "names", [])] or list(matrix.images)
    if args.images_command == "list":
        for image in matrix.images:
            default = " (default)" if image.name == matrix.default else ""
            print(f"{image.name:<16} {image.tag:<42} {image.base}{default}")
        return 0
    if args.images_command == "lock":
        for image in chosen:
            print(f"# locking {image.name}: torch {image.torch}, python {image.python}", flush=True)
            locks.lock_image(image)
        if not args.names:
            locks.lock_validation()
        return 0
    if args.images_command == "check":
        problems = locks.check_matrix(matrix, with_metadata=not args.offline, names=args.names)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            return ConfigError.exit_code
        source = "locks" if args.offline else "locks and torch's wheel metadata"
        print(f"# {len(chosen)} image(s) agree with their {source}: {', '.join(i.name for i in chosen)}")
        if args.offline:
            print(f"# {locks.offline_summary(matrix, args.names)}")
        return 0
    if args.images_command == "bake":
        return bake.run(args)
    raise AssertionError(args.images_command)


def _bench(args: argparse.Namespace) -> int:
    if args.bench_command == "parallel":
        from stackproof.bench import parallel

        return parallel.run(parallel.ParallelBench.from_args(args))
    from stackproof.bench import resnet

    return resnet.run(resnet.ResnetBench.from_args(args))


def _attest(args: argparse.Namespace) -> int:
    from stackproof.images import attest
    from stackproof.images.attest_config import AttestConfig

    settings = AttestConfig.from_args(args)
    record = attest.attest(Path(settings.reports), settings.image, Path(settings.key), settings.spec,
                           settings.baseline)
    print(f"# {attest.record_line(record)} (record: {Path(settings.reports) / attest.RECORD_FILE})")
    return 0


def _verify_image(args: argparse.Namespace) -> int:
    import json

    from stackproof.images import attest
    from stackproof.images.attest_config import VerifyImageConfig
    from stackproof.judge import node_class

    settings = VerifyImageConfig.from_args(args)
    wanted = node_class.parse(settings.node_class) if settings.node_class else attest.this_node_class()
    if settings.spec:
        import dataclasses

        wanted = dataclasses.replace(wanted, spec=settings.spec)
    verdict = attest.verify_image(args.reference, wanted, Path(settings.key), settings.max_age)
    if settings.json:
        print(json.dumps(verdict.to_json(), indent=2))
    print(f"stackproof verify-image: {verdict.line()}", file=sys.stderr if settings.json else sys.stdout)
    return 0 if verdict.ok else 1


def _node_class(args: argparse.Namespace) -> int:
    from stackproof.images import attest

    print(attest.this_node_class().text())
    return 0


def _warm_agent(args: argparse.Namespace) -> int:
    from stackproof import environment
    from stackproof.run import warm

    return warm.serve(args.socket or environment.WARM_SOCKET.get() or warm.DEFAULT_SOCKET, args.group, sys.stdout,
                      main)


def _innermost(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)command's own parser these args were parsed by: `stackproof images check`'s, not the top's."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subs[0].dest, None) if subs else None
        if chosen not in (subs[0].choices if subs else {}):
            return parser
        parser = subs[0].choices[chosen]


def main(argv: Sequence[str] | None = None, guarded: bool = False) -> int:
    """`guarded`: healthcheck runs inside its contract (act/contract.py), which reports bad input itself (its
    metric says the node was not judged); otherwise bad input to healthcheck is its exit 0 here."""
    pipes.keep_exit_code()  # `stackproof ... | head -1`: the command's exit code, not a BrokenPipeError's
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(argv[0] if argv else None)
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # said by the subcommand's parser: its usage, its --help (argparse would print the top's)
            _innermost(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as stop:
        if stop.code == Exit.USAGE and argv[:1] == ["healthcheck"] and not guarded:
            # The scheduler's contract: a typo in a Prolog's flags is bad input, never a drain.
            from stackproof.act.run import STAYS

            print(f"# stackproof healthcheck: bad input (the flags above); this node stays in service; exit {STAYS}",
                  flush=True)
            return STAYS
        raise
    commands = {"validate": _validate, "verdict": _verdict, "healthcheck": _healthcheck, "act": _act,
                "baseline": _baseline, "spec": _spec, "report": _report, "images": _images, "bench": _bench,
                "attest": _attest, "verify-image": _verify_image, "node-class": _node_class,
                "warm-agent": _warm_agent}
    args.guarded = guarded
    try:
        return int(commands[args.command](args))
    except StackproofError as err:
        print(f"stackproof: {err}", file=sys.stderr)
        return int(err.exit_code)
    except KeyboardInterrupt:
        print(f"stackproof: interrupted (exit code {int(Exit.INTERRUPTED)}: {Exit.INTERRUPTED.meaning})",
              file=sys.stderr)
        return Exit.INTERRUPTED
