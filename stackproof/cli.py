"""The command line: `stackproof validate` proves a machine + image; `stackproof images ...` keeps the matrix,
locks and build plan consistent. Errors print one line (what was expected, what was found, the fix), no traceback."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from stackproof import __version__
from stackproof.errors import ConfigError, StackproofError
from stackproof.images import bake
from stackproof.suite.config import FAULTS

_SIZE = re.compile(r"^(\d+)([KMG]i?B?|B)?$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_bytes(text: str) -> int:
    """'4G', '256MiB', '65536' -> bytes (binary units, as nccl-tests' -b/-e take them)."""
    match = _SIZE.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 65536, 64K, 256M or 4G")
    unit = (match.group(2) or "").lower()[:1]
    return int(match.group(1)) * _UNITS[unit]


def _validate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="run the validation suite on every visible GPU (or 2 CPU ranks)",
                       description="Run smoke_tests/ on every visible GPU (one rank each, NCCL) or on CPU ranks "
                                   "(gloo). Under torchrun or srun, run as the rank given. Exit codes: 0 passed, "
                                   "1 a check failed, 2 bad flags, 3 no GPU visible but expected, "
                                   "4 a rank died or timed out.")
    p.add_argument("--expect-gpus", type=int, metavar="N",
                   help="GPUs that must be visible (default: >= 1 when NVIDIA_VISIBLE_DEVICES requests GPUs, "
                        "else whatever is there; 0 validates on CPU)")
    p.add_argument("--nproc", type=int, default=2, metavar="N", help="CPU ranks when no GPU is visible (default 2)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="seconds any collective, rendezvous or cross-rank sync may take (default 300)")
    p.add_argument("--run-timeout", type=float, default=1800.0, metavar="S",
                   help="seconds the whole run may take (default 1800)")
    p.add_argument("--min-busbw", type=float, metavar="GBPS",
                   help="all_reduce busbw the largest size must reach (default: derived from NVLink/PCIe topology)")
    p.add_argument("--busbw-fraction", type=float, default=0.5, metavar="F",
                   help="fraction of the topology's peak link bandwidth required when deriving (default 0.5)")
    p.add_argument("--max-check-bytes", type=parse_bytes, metavar="SIZE",
                   help="largest all_reduce correctness buffer (default 256M on GPU, 1M on CPU)")
    p.add_argument("--sweep-min", type=parse_bytes, metavar="SIZE", help="bandwidth sweep start (default 1M on GPU)")
    p.add_argument("--sweep-max", type=parse_bytes, metavar="SIZE", help="bandwidth sweep end (default 4G on GPU)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per sweep size (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="warm-up iterations per sweep size (default 5)")
    p.add_argument("--train-batch", type=int, metavar="N", help="ResNet-50 batch per rank (default 256 GPU, 4 CPU)")
    p.add_argument("--train-image-size", type=int, metavar="PX", help="ResNet-50 input size (default 224 GPU, 64 CPU)")
    p.add_argument("--bench-steps", type=int, default=20, help="timed ResNet-50 steps for img/s (default 20)")
    expect = p.add_mutually_exclusive_group()
    expect.add_argument("--image", metavar="NAME", help="compare runtime pins with this images/matrix.toml entry")
    expect.add_argument("--expect-file", metavar="PATH",
                        help="compare runtime pins with this JSON (default in stackproof images: "
                             "/etc/stackproof/expected.json)")
    p.add_argument("--reports", default=None, metavar="DIR",
                   help="where report.json, junit.xml and rank logs go (default $STACKPROOF_REPORTS or ./reports)")
    p.add_argument("--inject-fault", choices=FAULTS,
                   help="break something on purpose on --fault-rank to prove the suite fails when it should")
    p.add_argument("--fault-rank", type=int, default=1, metavar="R", help="rank that --inject-fault breaks (default 1)")
    p.add_argument("-k", dest="select", metavar="EXPR", help="run only checks matching this pytest -k expression")
    p.add_argument("pytest_args", nargs="*", metavar="-- PYTEST_ARGS", help="extra pytest arguments after --")


def _images_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("images", help="the image matrix, its locks and the build plan")
    images = p.add_subparsers(dest="images_command", required=True, metavar="{list,check,lock,bake}")
    images.add_parser("list", help="the images of images/matrix.toml, one line each")
    check = images.add_parser("check", help="matrix vs locks vs torch's wheel metadata; exit 2 on any disagreement")
    check.add_argument("--offline", action="store_true", help="skip the metadata read from PyPI")
    check.add_argument("names", nargs="*", metavar="IMAGE", help="only these images (default: all)")
    lock = images.add_parser("lock", help="regenerate hashed locks with uv from the matrix")
    lock.add_argument("names", nargs="*", metavar="IMAGE", help="only these images (default: all + validation)")
    bake.add_arguments(images.add_parser("bake", help="write the bake file of matrix values (build/images.bake.json)"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stackproof", description=__doc__)
    parser.add_argument("--version", action="version", version=f"stackproof {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{validate,images}")
    _validate_parser(sub)
    _images_parser(sub)
    return parser


def _validate(args: argparse.Namespace) -> int:
    import os

    from stackproof.suite.config import ValidateConfig
    from stackproof.suite.launcher import validate

    pytest_args = tuple(args.pytest_args) + (("-k", args.select) if args.select else ())
    settings = ValidateConfig(
        reports=args.reports or os.environ.get("STACKPROOF_REPORTS", "reports"),
        expect_gpus=args.expect_gpus, cpu_procs=args.nproc, timeout_s=args.timeout,
        run_timeout_s=args.run_timeout, max_check_bytes=args.max_check_bytes, sweep_min_bytes=args.sweep_min,
        sweep_max_bytes=args.sweep_max, sweep_warmup=args.warmup, sweep_iters=args.iters,
        min_busbw_gbps=args.min_busbw, busbw_fraction=args.busbw_fraction, train_batch=args.train_batch,
        train_image_size=args.train_image_size, bench_steps=args.bench_steps, expect_file=args.expect_file,
        image=args.image, pytest_args=pytest_args, inject_fault=args.inject_fault, fault_rank=args.fault_rank)
    return validate(settings)


def _images(args: argparse.Namespace) -> int:
    from stackproof.images import locks
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
        problems = [p for image in chosen for p in locks.check_image(image, with_metadata=not args.offline)]
        if not args.names and not locks.VALIDATION_LOCK.exists():
            problems.append("images/locks/validation.txt: missing; fix: make lock")
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            return ConfigError.exit_code
        source = "locks" if args.offline else "locks and torch's wheel metadata"
        print(f"# {len(chosen)} image(s) agree with their {source}: {', '.join(i.name for i in chosen)}")
        return 0
    if args.images_command == "bake":
        return bake.run(args)
    raise AssertionError(args.images_command)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _validate(args) if args.command == "validate" else _images(args)
    except StackproofError as err:
        print(f"stackproof: {err}", file=sys.stderr)
        return err.exit_code
