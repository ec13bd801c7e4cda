"""`stackproof report` for real: reports of real CPU runs (one passing, one with a fault injected) and real
nccl-tests output from 2 x H200 (tests/fixtures/nccl-tests) drawn as one page, then rendered by headless Chromium:
the screenshot is not blank, the plot is in the DOM and on the screen. Without chromium that test skips, unless
STACKPROOF_REQUIRE_CHROMIUM=1 (CI), where it fails."""

import os
import shutil
import subprocess
import sys

import pytest
from test_validate_cpu import EXIT_FAILED, EXIT_OK, stackproof, validate

from stackproof.errors import Exit
from stackproof.images.matrix import REPO_ROOT
from stackproof.report import nccl_tests

FIXTURES = REPO_ROOT / "tests" / "fixtures" / "nccl-tests"
EAGER, GRAPH = FIXTURES / "all_reduce_perf-2xH200.txt", FIXTURES / "all_reduce_perf-2xH200-graph.txt"
QUICK = ["--expect-gpus", "0", "--sweep-max", "256K", "--max-check-bytes", "64K"]
CHROMIUM_TIMEOUT_S = 120
FAILING_CHECK = "collectives::all_reduce[sum-float32]"


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """Two real runs, drawn with both nccl-tests runs as references."""
    tmp = tmp_path_factory.mktemp("page")
    passing, _ = validate(tmp / "ok", *QUICK, "--min-busbw", "0.0001", "-k", "busbw or barrier")
    assert passing.returncode == EXIT_OK, passing.stdout[-3000:]
    failing, _ = validate(tmp / "bad", *QUICK, "--inject-fault", "allreduce-add-one", "--fault-rank", "1",
                          "-k", "barrier or busbw or (all_reduce and sum-float32)")
    assert failing.returncode == EXIT_FAILED, failing.stdout[-3000:]
    out = tmp / "site" / "report.html"
    out.parent.mkdir()  # -o makes no folder (tests/test_files.py)
    made = stackproof("report", tmp / "ok" / "reports", tmp / "bad" / "reports" / "report.json", "-o", out,
                      "--reference", EAGER, "--reference", GRAPH)
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == f"# report: {out}"
    return out


def test_the_page_says_the_verdict_first_and_the_failing_checks_next(page):
    text = page.read_text()
    assert "<title>stackproof report: FAILED (2 runs)</title>" in text
    verdict, first_table = text.index('id="verdict"'), text.index("<table")
    assert verdict < first_table and "Verdict: FAILED" in text[verdict:first_table]
    failing = text[text.index("<h2>Failing checks</h2>"):text.index("<h2>all_reduce bandwidth and time</h2>")]
    assert FAILING_CHECK in failing and "rank 1 on" in failing and "collectives::barrier" not in failing
    # In the failing run's own table, the failing check comes before every passing one.
    last_run = text[text.rindex("<h3>"):]
    assert last_run.index(FAILING_CHECK) < last_run.index("collectives::barrier")
    assert "<h4>Nodes</h4>" in last_run and "none (CPU)" in last_run


def test_the_page_plots_the_sweeps_the_threshold_and_nccl_tests(page):
    text = page.read_text()
    plot = text[text.index('id="busbw-plot"'):text.index('id="time-plot"')]
    assert "<svg" in plot and "busbw (GB/s)" in plot and "message size (bytes, log scale)" in plot
    assert "threshold 0.0001 GB/s (--min-busbw)" in plot
    assert "nccl-tests in-place (all_reduce_perf-2xH200.txt)" in plot
    assert "nccl-tests out-of-place (all_reduce_perf-2xH200-graph.txt)" in plot
    assert plot.count(": all_reduce_busbw") == 2  # both runs' sweeps
    per_rank = text[text.index("<h2>Per-GPU and per-rank figures</h2>"):text.index("<h2>Every check, per run</h2>")]
    assert "collectives::barrier barrier" in per_rank and "ms (lower is better)" in per_rank
    # Self-contained: nothing to fetch (no script, stylesheet, image source, or url() but the SVGs' own #clips).
    assert not any(word in text.replace("url(#", "") for word in ("<script", "<link", " src=", "url(", "<img"))


def test_chromium_renders_the_page_with_its_plot(page, tmp_path):
    from PIL import Image, ImageStat

    if shutil.which("chromium") is None:
        message = "no chromium on PATH (fix: apt-get install -y chromium)"
        if os.environ.get("STACKPROOF_REQUIRE_CHROMIUM") == "1":
            pytest.fail(f"STACKPROOF_REQUIRE_CHROMIUM=1 but {message}")
        pytest.skip(message)

    shot = tmp_path / "shot.png"
    browser = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--window-size=1280,1600"]
    subprocess.run([*browser, f"--screenshot={shot}", page.as_uri()], capture_output=True,
                   timeout=CHROMIUM_TIMEOUT_S, check=True)
    dom = subprocess.run([*browser, "--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=CHROMIUM_TIMEOUT_S, check=True).stdout
    assert 'id="busbw-plot"' in dom and "<svg" in dom[dom.index('id="busbw-plot"'):]
    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, 1600)
    assert max(ImageStat.Stat(image.convert("L")).stddev) > 20, "the screenshot is blank"
    # The plot is drawn on the screen. The two nccl-tests references are fixed data on a fixed scale (they set it:
    # hundreds of GB/s), so their lines (matplotlib's tab:green and tab:purple) give a steady count; the two runs'
    # sweeps (tab:blue, tab:orange) lie near zero on CPU ranks and their pixels vary with the measured figures, so
    # they are asked only to be there: strokes in the plot's SVG, some pixels on the screen.
    colours = image.getcolors(maxcolors=1 << 20)
    near = lambda rgb, target: sum(abs(a - b) for a, b in zip(rgb, target, strict=True)) < 40  # noqa: E731
    pixels = {name: sum(n for n, rgb in colours if near(rgb, target))
              for name, target in (("blue", (31, 119, 180)), ("orange", (255, 127, 14)), ("green", (44, 160, 44)),
                                   ("purple", (148, 103, 189)))}
    assert pixels["green"] > 300 and pixels["purple"] > 300, f"the nccl-tests lines are not on the screen: {pixels}"
    assert pixels["blue"] > 20 and pixels["orange"] > 20, f"the runs' sweeps are not on the screen: {pixels}"
    plot = dom[dom.index('id="busbw-plot"'):dom.index('id="time-plot"')]
    assert "stroke: #1f77b4" in plot and "stroke: #ff7f0e" in plot, "the runs' sweeps are not in the plot's SVG"
    assert sum(n for n, rgb in colours if near(rgb, (198, 40, 40))) > 5000, "no FAILED banner on the screen"


def test_nccl_tests_output_is_read_as_its_columns_say():
    eager, graph = nccl_tests.read(EAGER), nccl_tests.read(GRAPH)
    assert len(eager) == 30 and eager[0].size_bytes == 8 and eager[-1].size_bytes == 4 << 30
    assert eager[0].out_of_place == (21.41, 0.0, 0.0) and eager[0].in_place == (19.97, 0.0, 0.0)
    one_mib = next(r for r in eager if r.size_bytes == 1 << 20)
    assert one_mib.count == 262144 and one_mib.dtype == "float" and one_mib.redop == "sum"
    assert one_mib.in_place == (18.95, 55.33, 55.33) and one_mib.out_of_place[2] == 40.99
    assert eager[-1].out_of_place[0] == 12478.9
    assert graph[0].in_place[0] == 5.92 and graph[-1].size_bytes == 64 << 20


def test_nccl_tests_variants_unchecked_results_and_trace_replays():
    header = "#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   "
    rows = nccl_tests.parse(
        f"{header}busbw  #wrong\n"
        "host:1:1 [0] NCCL INFO Channel 00/24 : 0 1\n"
        "     1048576        262144     float     sum      -1    25.58   40.99   40.99    N/A    18.95   55.33   "
        "55.33    N/A\n"
        "     2097152        524288     float     sum      -1                                    29.87   70.22   "
        "70.22      0\n")
    assert [(r.size_bytes, r.out_of_place, r.in_place) for r in rows] == [
        (1048576, (25.58, 40.99, 40.99), (18.95, 55.33, 55.33)), (2097152, None, (29.87, 70.22, 70.22))]


def test_bad_inputs_are_exit_2_naming_the_file(page, tmp_path):
    (tmp_path / "empty.txt").write_text("# nothing measured\n")
    refused = stackproof("report", page.parent.parent / "ok" / "reports", "-o", tmp_path / "r.html",
                         "--reference", tmp_path / "empty.txt")
    assert refused.returncode == Exit.USAGE and f"--reference {tmp_path / 'empty.txt'}: expected nccl-tests' " \
        "data lines" in refused.stderr
    (tmp_path / "other.json").write_text('{"schema": "something/else"}')
    refused = stackproof("report", tmp_path / "other.json", "-o", tmp_path / "r.html")
    assert refused.returncode == Exit.USAGE and "field 'schema': expected 'stackproof.report/2'" in refused.stderr
    assert not (tmp_path / "r.html").exists()


def test_without_matplotlib_it_says_which_extra_to_install(page, tmp_path):
    blocked = ("import sys; sys.modules['matplotlib'] = None; from stackproof.cli import main; "
               f"sys.exit(main(['report', {str(page.parent.parent / 'ok' / 'reports')!r}, '-o', "
               f"{str(tmp_path / 'r.html')!r}]))")
    proc = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120)
    assert proc.returncode == Exit.USAGE and "pip install 'stackproof[report]'" in proc.stderr


def test_per_gpu_bars_carry_the_checks_bar():
    from test_baseline import gpu_report

    from stackproof.report import page

    text = page.render([("n1", gpu_report(hbm1=3.9))])
    bars = text[text.index("<h2>Per-GPU and per-rank figures</h2>"):text.index("<h2>Every check, per run</h2>")]
    assert "per_gpu::hbm_bandwidth hbm" in bars and "bar 3.37 TB/s" in bars and "TB/s (higher is better)" in bars
    assert "No busbw sweep in these reports" in text
