"""The command line is generated from the checked settings (suite/config.py): each flag is declared once."""

import argparse
import dataclasses
import subprocess
import sys

import pytest

from stackproof.cli import build_parser
from stackproof.run.config import ValidateConfig, flag_of, parse_bytes


def _validate_parser() -> argparse.ArgumentParser:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices["validate"]


def test_every_setting_is_a_flag_with_help_and_nothing_else_is():
    flags = {o for a in _validate_parser()._actions for o in a.option_strings} - {"-h", "--help"}
    fields = [f for f in dataclasses.fields(ValidateConfig) if not f.metadata["positional"]]
    assert flags == {flag_of(f) for f in fields}
    assert all(f.metadata["help"] for f in dataclasses.fields(ValidateConfig))


def test_defaults_come_from_the_dataclass():
    assert ValidateConfig.from_args(_validate_parser().parse_args([])) == ValidateConfig()


@pytest.mark.parametrize(("text", "value"), [("65536", 65536), ("64K", 65536), ("256M", 256 << 20),
                                             ("4G", 4 << 30), ("1MiB", 1 << 20)])
def test_sizes_read_like_nccl_tests(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize(("args", "words"), [
    (["--nproc", "0"], "--nproc: expected >= 1, found 0"),
    (["--nproc", "two"], "argument --nproc: expected a whole number, found 'two'"),
    (["--sweep-max", "lots"], "expected a size such as 65536, 64K, 256M or 4G, found 'lots'"),
    (["--image", "current", "--expect-file", "x.json"], "give one of them, not both"),
    (["--inject-fault", "nope"], "invalid choice: 'nope'"),
    (["--expect-file", "/nonexistent.json"], "--expect-file /nonexistent.json: expected a readable JSON file"),
    (["--image", "nosuch"], "image 'nosuch': not in matrix.toml"),
    # issue 20 item 9: these passed the checks and crashed every rank (OverflowError, exit 4)
    (["--rendezvous-timeout", "inf"], "--rendezvous-timeout: expected seconds in (0, 2592000] (30 days), found inf"),
    (["--timeout", "1e15", "--run-timeout", "1e15"], "--timeout: expected seconds in (0, 2592000] (30 days), found "
                                                     "1000000000000000.0; --run-timeout: expected seconds"),
    (["--check-timeout", "nan"], "--check-timeout: expected seconds in (0, 2592000] (30 days), found nan"),
    # issue 20 item 7: pytest's "empty arguments" from every rank, exit 4
    (["-k", "and or"], "-k 'and or': expected a pytest -k expression"),
])
def test_bad_input_exits_2_at_once_with_one_line_naming_the_flag(args, words):
    proc = subprocess.run([sys.executable, "-m", "stackproof", "validate", *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr and "Traceback" not in proc.stderr
    assert "reports=" not in proc.stderr  # flags are named, the settings object is not dumped


def test_an_expect_file_with_invalid_json_is_bad_input(tmp_path):
    bad = tmp_path / "pins.json"
    bad.write_text("{not json")
    proc = subprocess.run([sys.executable, "-m", "stackproof", "validate", "--expect-file", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "expected JSON, found invalid JSON" in proc.stderr


@pytest.mark.parametrize(("argv", "prog"), [(["validate", "--bogus"], "stackproof validate"),
                                             (["images", "check", "--bogus"], "stackproof images check"),
                                             (["spec", "r", "-o", "s.json", "--bogus"], "stackproof spec")])
def test_an_unknown_flag_after_a_subcommand_is_said_by_that_subcommand(argv, prog):
    """Before: the top-level usage (the list of commands), which does not say which flags the command takes."""
    proc = subprocess.run([sys.executable, "-m", "stackproof", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"usage: {prog} ") and "{validate,verdict" not in proc.stderr, proc.stderr
    assert f"{prog}: unrecognized arguments: --bogus (see: {prog} --help)" in proc.stderr
