"""The command line is an interface: this freezes it. Changing a flag must change this test, on purpose."""

import argparse

import pytest

from stackproof.cli import build_parser, parse_bytes

FROZEN = {
    "validate": ["--bench-steps", "--busbw-fraction", "--expect-file", "--expect-gpus", "--fault-rank", "--help",
                 "--image", "--inject-fault", "--iters", "--max-check-bytes", "--min-busbw", "--nproc", "--reports",
                 "--run-timeout", "--sweep-max", "--sweep-min", "--timeout", "--train-batch", "--train-image-size",
                 "--warmup", "-h", "-k"],
    "images": ["--help", "-h"],
    "images list": ["--help", "-h"],
    "images check": ["--help", "--offline", "-h"],
    "images lock": ["--help", "-h"],
    "images bake": ["--external-tag", "--help", "--image", "--matrix", "--output", "--show", "-h", "-o"],
}


def _subparsers(parser: argparse.ArgumentParser, prefix: str = ""):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                full = f"{prefix} {name}".strip()
                yield full, sub
                yield from _subparsers(sub, full)


def test_the_cli_is_frozen():
    found = {name: sorted(o for a in sub._actions for o in a.option_strings) for name, sub in
             _subparsers(build_parser())}
    assert found == FROZEN


@pytest.mark.parametrize(("text", "value"), [("65536", 65536), ("64K", 65536), ("256M", 256 << 20),
                                             ("4G", 4 << 30), ("1MiB", 1 << 20)])
def test_sizes_read_like_nccl_tests(text, value):
    assert parse_bytes(text) == value


def test_a_bad_size_names_the_forms_it_takes():
    with pytest.raises(argparse.ArgumentTypeError, match="such as 65536, 64K, 256M or 4G"):
        parse_bytes("lots")
