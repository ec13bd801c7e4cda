"""The alert rules and the dashboard (deploy/) for real: promtool checks and unit-tests the rules; then a real
Prometheus and two real node_exporters (textfile collector) on 127.0.0.1 read the stackproof.prom of two real CPU
runs, one healthy and one whose rank 1 gets a broken torch.distributed.all_reduce (a sitecustomize on the ranks'
PYTHONPATH, outside stackproof). The failed-node alert is seen firing through Prometheus' HTTP API for the broken
node only, and every query of the Grafana dashboard runs against that Prometheus and returns data.

Without Debian's prometheus, prometheus-node-exporter (and promtool) these skip, unless
STACKPROOF_REQUIRE_PROMETHEUS=1 (CI), where they fail.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from test_validate_cpu import EXIT_FAILED, EXIT_OK, validate

from stackproof.act import contract, history
from stackproof.images.matrix import REPO_ROOT
from stackproof.judge.findings import Finding
from stackproof.report import metrics
from stackproof.report.record import Check, Figure, Report

RULES = REPO_ROOT / "deploy" / "prometheus" / "stackproof-rules.yml"
RULE_TESTS = [REPO_ROOT / "deploy" / "prometheus" / name
              for name in ("stackproof-rules.test.yml", "stackproof-rules-age.test.yml",
                           "stackproof-rules-lemon.test.yml")]
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "stackproof-dashboard.json"
BINARIES = ("promtool", "prometheus", "prometheus-node-exporter")
START_TIMEOUT_S = 30
ALERT_TIMEOUT_S = 60
FAILING_CHECK = "collectives::all_reduce[sum-float32]"
QUICK = ["--expect-gpus", "0", "--max-check-bytes", "64K", "-k", "all_reduce and sum-float32"]

# Rank 1's all_reduce adds one to every element after the real reduction: wrong sums, as a bad GPU or link gives.
BROKEN_ALL_REDUCE = '''
import os
if os.environ.get("RANK") == "1":
    import torch.distributed as dist
    _all_reduce = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        work = _all_reduce(tensor, *args, **kwargs)
        if work is not None:
            work.wait()
        tensor.add_(1)
        return work

    dist.all_reduce = all_reduce
'''


@pytest.fixture(scope="module")
def binaries() -> None:
    missing = [name for name in BINARIES if shutil.which(name) is None]
    if missing:
        message = (f"{', '.join(missing)} not on PATH (fix: apt-get install -y --no-install-recommends prometheus "
                   "prometheus-node-exporter)")
        if os.environ.get("STACKPROOF_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(f"STACKPROOF_REQUIRE_PROMETHEUS=1 but {message}")
        pytest.skip(message)


def promtool(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *map(str, args)], capture_output=True, text=True, timeout=60)


# promtool evaluates a query's result in whatever order it comes (it changes from run to run): an alert text
# that depends on it passes now and then. Each run takes a fraction of a second, so 20 of them are cheap.
RULE_TEST_RUNS = 20


def test_the_rules_are_valid_and_their_unit_tests_pass(binaries):
    checked = promtool("check", "rules", RULES)
    assert checked.returncode == 0 and "SUCCESS: 6 rules found" in checked.stdout, checked.stdout + checked.stderr
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda _: promtool("test", "rules", *RULE_TESTS), range(RULE_TEST_RUNS)))
    failed = [run for run in runs if run.returncode != 0 or run.stdout.count("SUCCESS") != len(RULE_TESTS)]
    assert not failed, f"{len(failed)} of {RULE_TEST_RUNS} runs failed; the first:\n" + failed[0].stdout + \
        failed[0].stderr


def test_the_rule_tests_fail_when_an_alert_is_wrong(binaries, tmp_path):
    """The unit tests can fail: the same tests against rules that never fire are red."""
    for tests in RULE_TESTS:
        shutil.copy(tests, tmp_path / tests.name)
    (tmp_path / RULES.name).write_text(RULES.read_text().replace("stackproof_node_passed == 0",
                                                                 "stackproof_node_passed == 2").replace(
        "> 7 * 24 * 3600", "> 9 * 24 * 3600").replace("stackproof_node_needs_service == 1",
                                                      "stackproof_node_out_of_service == 1"))
    for tests, alert in zip(RULE_TESTS, ("StackproofNodeFailedValidation", "StackproofNodeNotValidated",
                                         "StackproofLemonNode"), strict=True):
        tested = promtool("test", "rules", tmp_path / tests.name)
        assert tested.returncode != 0 and alert in tested.stdout + tested.stderr


def test_the_rules_and_dashboard_use_only_metrics_the_writer_writes():
    # the healthcheck guard's own textfile, and the node history's (act/history.py)
    written = set(metrics.HELP) | {contract.BROKEN_METRIC} | set(history.HELP)
    used = set(re.findall(r"\bstackproof_[a-z_]+\b", RULES.read_text() + DASHBOARD.read_text()))
    used -= {"stackproof_"}
    assert used and used <= written, used - written


def test_the_textfile_passes_promtool_lint_and_names_node_gpu_and_check(binaries):
    gpu = {"name": "NVIDIA H200", "serial": "1654", "pci_bus_id": "0000:00:06.0"}
    report = Report(ranks=[{"rank": r, "node": "n1", "host": "h1", "gpu": {**gpu, "index": r, "uuid": f"GPU-{r}"}}
                           for r in (0, 1)])
    report.checks = [
        Check("test_02_per_gpu.py::test_hbm_bandwidth", figures={
            "hbm@h1:0": Figure(4.2, "TB/s"), "hbm@h1:1": Figure(3.1, "TB/s"), "hbm_bar": Figure(3.37, "TB/s")},
              rank_figures={1: {"hbm": Figure(3.1, "TB/s")}}, outcome="failed", failed_ranks=[1],
              findings=[Finding(1, "GPU-1", "HBM copy", ">= 3.37 TB/s", "3.1 TB/s", "performance", "triage", "x",
                                node="n1", rank=1, source="per_gpu::hbm_bandwidth")],
              hint='compare with a good "node"'),
        Check("test_01_host.py::test_dev_shm", outcome="skipped")]
    report.planned = [c.nodeid for c in report.checks]
    running = report.prometheus()
    assert "stackproof_run_final 0" in running and metrics.NODE_PASSED not in running  # no verdict while going
    report.complete = True
    text = report.prometheus()
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0 and not lint.stdout.strip() + lint.stderr.strip(), lint.stdout + lint.stderr
    assert 'stackproof_node_passed{node="n1"} 0' in text
    assert ('stackproof_finding{node="n1",gpu="1",uuid="GPU-1",rank="1",check="per_gpu::hbm_bandwidth",'
            'category="performance",severity="triage"} 1') in text
    assert 'stackproof_check_fix_info{check="per_gpu::hbm_bandwidth",fix="compare with a good \\"node\\""} 1' in text
    # Each GPU's figure once, on its own node, GPU and rank; the skipped check is no series.
    hbm = re.findall(r'stackproof_figure\{node="n1",gpu="(\d)",uuid="GPU-\d",rank="(\d)",'
                     r'check="per_gpu::hbm_bandwidth",figure="hbm",unit="TB/s"\} ([\d.]+)', text)
    assert sorted(hbm) == [("0", "0", "4.2"), ("1", "1", "3.1")]
    assert "dev_shm" not in text


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(url: str, timeout: float = 5) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read().decode())


def wait_for(what: str, probe, timeout: float, logs: list[Path]):
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = probe()
            if found:
                return found
        except OSError:
            pass
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {log}\n{log.read_text()[-2000:]}" for log in logs if log.exists())
            pytest.fail(f"{what}: not within {timeout} s\n{tails}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def fleet(binaries, tmp_path_factory):
    """Two real runs (good-node passes, bad-node's rank 1 has a broken all_reduce), each served by its own
    node_exporter, scraped and judged every second by one Prometheus; yields its base URL."""
    tmp = tmp_path_factory.mktemp("prometheus")
    fault = tmp / "fault"
    fault.mkdir()
    (fault / "sitecustomize.py").write_text(BROKEN_ALL_REDUCE)
    path = os.pathsep.join(p for p in (str(fault), os.environ.get("PYTHONPATH", "")) if p)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both runs at once: half the wait
        good = pool.submit(validate, tmp / "good", *QUICK, env_extra={"STACKPROOF_NODE_NAME": "good-node"})
        bad = pool.submit(validate, tmp / "bad", *QUICK,
                          env_extra={"STACKPROOF_NODE_NAME": "bad-node", "PYTHONPATH": path})
        (good, _), (bad, _) = good.result(), bad.result()
    assert good.returncode == EXIT_OK, good.stdout[-3000:] + good.stderr[-3000:]
    assert bad.returncode == EXIT_FAILED, bad.stdout[-3000:] + bad.stderr[-3000:]

    procs, logs, exporters = [], [], {}
    try:
        for name in ("good", "bad"):
            port = free_port()
            log = tmp / f"node-exporter-{name}.log"
            logs.append(log)
            procs.append(subprocess.Popen(
                ["prometheus-node-exporter", f"--web.listen-address=127.0.0.1:{port}", "--collector.disable-defaults",
                 "--collector.textfile", f"--collector.textfile.directory={tmp / name / 'reports'}"],
                stdout=log.open("w"), stderr=subprocess.STDOUT))
            exporters[name] = f"127.0.0.1:{port}"
        port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "node", "static_configs": [{"targets": list(exporters.values())}]}]}))
        log = tmp / "prometheus.log"
        logs.append(log)
        procs.append(subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"], stdout=log.open("w"), stderr=subprocess.STDOUT))
        url = f"http://127.0.0.1:{port}"
        wait_for("Prometheus ready", lambda: urllib.request.urlopen(f"{url}/-/ready", timeout=2).status == 200,
                 START_TIMEOUT_S, logs)
        yield {"url": url, "exporters": exporters, "logs": logs}
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def query(url: str, expr: str) -> list[dict]:
    answer = get(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def firing(url: str) -> list[dict]:
    return [a for a in get(f"{url}/api/v1/alerts")["data"]["alerts"] if a["state"] == "firing"]


def test_the_failed_node_alert_fires_through_prometheus_for_the_broken_node_only(fleet):
    url = fleet["url"]
    # Both textfiles read without error, both nodes' verdicts scraped.
    scraped = wait_for("both nodes' verdicts scraped", lambda: len(query(url, "stackproof_node_passed")) == 2 and
                       query(url, "stackproof_node_passed"), ALERT_TIMEOUT_S, fleet["logs"])
    assert {r["metric"]["node"]: r["value"][1] for r in scraped} == {"good-node": "1", "bad-node": "0"}
    errors = query(url, "node_textfile_scrape_error")
    assert len(errors) == 2 and all(r["value"][1] == "0" for r in errors), errors

    def failed_alert():
        return [a for a in firing(url) if a["labels"]["alertname"] == "StackproofNodeFailedValidation"]

    alerts = wait_for("StackproofNodeFailedValidation firing", failed_alert, ALERT_TIMEOUT_S, fleet["logs"])
    assert [a["labels"]["node"] for a in alerts] == ["bad-node"]
    assert alerts[0]["labels"]["instance"] == fleet["exporters"]["bad"]
    summary = alerts[0]["annotations"]["summary"]
    assert summary.startswith("Node bad-node failed stackproof validation: ") and f"{FAILING_CHECK} on GPU - (rank 1)" \
        in summary, summary
    # Several evaluations later, still nothing about the healthy node, and no health or baseline alert on CPU.
    time.sleep(3)
    assert all(a["labels"].get("node") != "good-node" for a in firing(url))
    assert {a["labels"]["alertname"] for a in firing(url)} == {"StackproofNodeFailedValidation"}


def dashboard_queries() -> list[str]:
    """Every PromQL query of the dashboard: its panels' targets and its variables' label_values() selectors, with
    the variables set to All."""
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in board["panels"] for t in panel["targets"]]
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            selector = re.fullmatch(r"label_values\((.+), *\w+\)", var["query"]["query"])
            assert selector, var["query"]
            exprs.append(selector.group(1))
    return [re.sub(r"\$(node|check|figure)\b", ".*", expr) for expr in exprs]


def test_every_dashboard_query_parses_and_shows_the_fleet(fleet):
    url = fleet["url"]
    wait_for("the fault run's finding scraped", lambda: query(url, "stackproof_finding"), ALERT_TIMEOUT_S,
             fleet["logs"])
    exprs = dashboard_queries()
    assert len(exprs) >= 12
    empty = [expr for expr in exprs if not query(url, expr)]
    assert not empty, f"queries with no data: {empty}"
    board = json.loads(DASHBOARD.read_text())
    assert all(t["datasource"]["uid"] == "${datasource}" for panel in board["panels"] for t in panel["targets"])
