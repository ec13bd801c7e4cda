"""`stackproof bench resnet`: real torchrun runs of ResNet-50 under DDP (CPU ranks here; GPUs on a GPU host)."""

import dataclasses
import json
import subprocess
import sys

import pytest

from stackproof.bench.resnet import ResnetBench, Result, format_table, with_scaling

BENCH = [sys.executable, "-m", "stackproof", "bench", "resnet"]


def test_bench_runs_one_and_two_ranks_and_reports_scaling(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([*BENCH, "--nproc", "1,2", "--steps", "1", "--warmup", "1", "--image-size", "32",
                           "--batch", "2", "--timeout", "600", "-o", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert all(line.startswith(("#", "  ")) for line in lines), lines  # nccl-tests' contract: '#' or data
    data = [line.split() for line in lines if line.startswith("  ")]
    assert [(row[0], row[1], row[2]) for row in data] == [("1", "cpu", "eager"), ("2", "cpu", "eager")]
    results = json.loads(out.read_text())["results"]
    assert [r["gpus"] for r in results] == [1, 2]
    assert all(r["img_per_s_total"] > 0 and r["compile_s"] is None for r in results)
    assert results[0]["scaling"] == 1.0
    assert results[1]["scaling"] == pytest.approx(results[1]["img_per_s_total"] / (2 * results[0]["img_per_s_total"]))


@pytest.mark.parametrize(("args", "words"), [
    (["--nproc", "0"], "--nproc: expected counts >= 1, found 0"),
    (["--nproc", "one,two"], "expected whole numbers separated by commas"),
    (["--steps", "0"], "--steps: expected >= 1, found 0"),
    (["--timeout", "inf"], "--timeout: expected seconds in (0, 2592000] (30 days), found inf"),
])
def test_bad_input_is_exit_2_in_one_line(args, words):
    done = subprocess.run([*BENCH, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and "Traceback" not in done.stderr


def test_scaling_is_against_the_same_modes_single_gpu_run():
    runs = [Result(1, "cuda", "eager", 256, 224, 4700.0, 4700.0, None),
            Result(1, "cuda", "compiled", 256, 224, 7000.0, 7000.0, 44.6),
            Result(2, "cuda", "eager", 256, 224, 9212.0, 4606.0, None),
            Result(8, "cuda", "compiled", 256, 224, 55160.0, 6895.0, 50.1)]
    scaled = with_scaling(runs)
    assert [round(r.scaling, 3) for r in scaled] == [1.0, 1.0, 0.98, 0.985]
    assert "0.980" in format_table(scaled)
    assert with_scaling([Result(2, "cuda", "eager", 256, 224, 9000.0, 4500.0, None)])[0].scaling is None


def test_the_worker_gets_the_same_settings_back():
    settings = ResnetBench(nproc=(1, 2), compile=True, batch=64, steps=5)
    argv = settings.to_argv()
    assert argv[:2] == ["--nproc", "1,2"] and "--compile" in argv
    import argparse

    parser = argparse.ArgumentParser()
    ResnetBench.add_arguments(parser)
    assert ResnetBench.from_args(parser.parse_args(argv)) == settings


def test_bench_parallel_runs_dataparallel_and_ddp_and_says_what_cpu_can(tmp_path):
    """`stackproof bench parallel` on CPU: DataParallel in one process and DDP on 2 gloo ranks, the table, the JSON
    and the plot; it says that a comparison needs 2+ GPUs."""
    out, plot = tmp_path / "parallel.json", tmp_path / "parallel.svg"
    done = subprocess.run([sys.executable, "-m", "stackproof", "bench", "parallel", "--steps", "1", "--warmup", "1",
                           "--image-size", "32", "--batch", "2", "--timeout", "600", "-o", str(out),
                           "--plot", str(plot)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert all(line.startswith(("#", "  ")) for line in lines), lines
    rows = [line.split() for line in lines if line.startswith("  ")]
    assert [(row[0], row[1], row[2]) for row in rows] == [("DataParallel", "cpu", "1"), ("DDP", "cpu", "2")]
    assert "a DataParallel/DDP comparison needs 2+ GPUs" in done.stdout
    saved = json.loads(out.read_text())
    assert [r["mode"] for r in saved["results"]] == ["dp", "ddp"]
    assert all(r["img_per_s"] > 0 and r["forward_ms"] > 0 and r["backward_ms"] > 0 for r in saved["results"])
    assert [len(r["peak_mib"]) for r in saved["results"]] == [1, 2]
    assert plot.read_text().lstrip().startswith("<") and "DDP" in plot.read_text()


def test_bench_parallel_names_dataparallels_gpu0_excess():
    from stackproof.bench.parallel import Result, format_table, note

    runs = [Result("dp", "cuda", 4, 512, 224, 3000.0, [30000.0, 21000.0, 21000.0, 20500.0], 40.0, 90.0, 5.0),
            Result("ddp", "cuda", 4, 512, 224, 12000.0, [20000.0] * 4, 30.0, 60.0, 3.0)]
    assert note(runs) == ("DDP / DataParallel img/s: 4.00x; DataParallel's GPU 0 holds 9000 MiB more than its "
                          "other GPUs' peak")
    assert "30000,21000,21000,20500" in format_table(runs)
    one = [dataclasses.replace(r, gpus=1, peak_mib=r.peak_mib[:1]) for r in runs]
    assert "a comparison needs 2+ GPUs" in note(one)
