"""The circuit breaker when many nodes act at once (issue 25): the pure halves (Slurm's re-count in slurmctld's
order, Kubernetes' claim decided from the ConfigMap and the taints), the kubectl commands of the compare-and-swap
(no API server here: built and checked, not sent), the Kubernetes verdict of a run that acted on nothing, and the
Slurm lock with real processes. The real cluster's proof is tests/test_act_slurm.py."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stackproof.act import breaker, decide, kubernetes, lock, slurm
from stackproof.act import run as act_run
from stackproof.act.config import ActConfig
from stackproof.errors import ActError, Exit
from stackproof.judge import policy

POOL = frozenset({"n1", "n2", "n3", "n4"})
NOW = 1_800_000_000.0


def _iso(t: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")


# --- Slurm: the re-count after draining --------------------------------------------------------------------

def test_the_recount_keeps_the_first_drains_in_slurmctlds_order():
    since = {"n1": "2026-12-01T10:00:05", "n2": "2026-12-01T10:00:04", "n3": "2026-12-01T10:00:05"}
    fleet = breaker.Fleet(POOL, frozenset(since), since)
    assert [n for n in sorted(since) if breaker.keeps(fleet, n, "1")] == ["n2"]  # the earliest stamp
    assert [n for n in sorted(since) if breaker.keeps(fleet, n, "2")] == ["n1", "n2"]  # a tie: by name
    assert all(breaker.keeps(fleet, n, "100%") for n in since)


def test_every_node_counting_the_same_drains_agrees_on_who_keeps():
    """Each node re-counts the same sinfo (its stamp's second is over): exactly cap of them keep their drain."""
    since = {f"n{i}": f"2026-12-01T10:00:0{i % 3}" for i in range(1, 5)}
    fleet = breaker.Fleet(POOL, frozenset(since), since)
    for cap in range(0, 5):
        assert sum(breaker.keeps(fleet, n, str(cap)) for n in since) == cap


def test_sinfo_gives_the_stamp_of_each_drain():
    out = "n1|debug*|2026-12-01T10:00:00|stackproof: x\nn2|debug*|Unknown|none\n"
    assert slurm.fleet(out, {"n2"}).since == {"n1": "2026-12-01T10:00:00"}
    assert "%H" in slurm.FLEET[-1] and slurm.FLEET[-1].endswith("%E")  # the reason (free text) last
    assert slurm.resume("n1") == ["scontrol", "update", "nodename=n1", "state=resume"]


# --- Kubernetes: the claim ---------------------------------------------------------------------------------

def test_a_claim_is_granted_within_the_cap_and_written_with_the_node():
    fleet = breaker.Fleet(POOL, frozenset({"n1"}))
    got = breaker.claim("{}", fleet, "n2", "2", NOW)
    assert got.granted and json.loads(got.data[breaker.CLAIMS_KEY]) == {"n2": _iso(NOW)}


def test_claims_not_yet_tainted_count_so_simultaneous_nodes_cannot_all_pass():
    """n2 claimed a moment ago and has not tainted yet: n3, counting the same taints (none), is refused."""
    fleet = breaker.Fleet(POOL, frozenset())
    claims = json.dumps({"n2": _iso(NOW - 5)})
    refused = breaker.claim(claims, fleet, "n3", "1", NOW)
    assert not refused.granted and "1 of 4 nodes tainted or claimed by stackproof (n2)" in refused.words


def test_an_old_claim_without_its_taint_expires_and_a_tainted_one_stays():
    fleet = breaker.Fleet(POOL, frozenset({"n1"}))
    claims = json.dumps({"n1": _iso(NOW - 10 * breaker.CLAIM_TTL_S), "n2": _iso(NOW - 2 * breaker.CLAIM_TTL_S)})
    got = breaker.claim(claims, fleet, "n3", "2", NOW)
    assert got.granted and set(json.loads(got.data[breaker.CLAIMS_KEY])) == {"n1", "n3"}


def test_a_damaged_configmap_still_counts_the_taints():
    fleet = breaker.Fleet(POOL, frozenset({"n1"}))
    assert not breaker.claim("not json", fleet, "n2", "1", NOW).granted
    assert breaker.claim("[1, 2]", fleet, "n2", "2", NOW).granted


def test_the_compare_and_swap_is_a_replace_at_the_version_read_or_a_create():
    assert kubernetes.claim_read("stackproof/stackproof-breaker") == [
        "kubectl", "get", "configmap", "stackproof-breaker", "--namespace", "stackproof", "-o", "json"]
    current = {"metadata": {"name": "stackproof-breaker", "namespace": "stackproof", "resourceVersion": "4711"},
               "data": {breaker.CLAIMS_KEY: "{}"}}
    claims, obj = kubernetes.claims_of(json.dumps(current))
    assert claims == "{}" and obj == current
    argv, body = kubernetes.claim_write("stackproof/stackproof-breaker", obj, {breaker.CLAIMS_KEY: '{"n2": "t"}'})
    assert argv == ["kubectl", "replace", "-f", "-", "-o", "name"]
    sent = json.loads(body)
    assert sent["metadata"] == {"name": "stackproof-breaker", "namespace": "stackproof", "resourceVersion": "4711"}
    assert sent["kind"] == "ConfigMap" and sent["data"] == {breaker.CLAIMS_KEY: '{"n2": "t"}'}
    argv, body = kubernetes.claim_write("ns/cm", None, {})
    assert argv[:2] == ["kubectl", "create"] and "resourceVersion" not in json.loads(body)["metadata"]
    assert kubernetes.claims_of(None) == ("{}", None)


def _fake_kubectl(tmp_path: Path, script: str) -> Path:
    """A `kubectl` on PATH that plays an API server's answers (there is none here), logging each call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "kubectl"
    fake.write_text(f"#!/usr/bin/env bash\necho \"$*\" >> {tmp_path}/calls\n{script}\n")
    fake.chmod(0o755)
    return bin_dir


def _decision(*nodes: str) -> decide.Decision:
    return decide.Decision(Exit.FAILED, "", actions=tuple(decide.NodeAction(n, policy.DRAIN, f"stackproof: {n}")
                                                          for n in nodes))


NODES_JSON = json.dumps({"items": [{"metadata": {"name": n, "labels": {}}, "spec": {}} for n in sorted(POOL)]})


def test_a_lost_race_reads_again_and_then_holds(tmp_path, monkeypatch):
    """kubectl replace answers Conflict once (another node claimed in between); the second read shows that
    node's claim, which fills --max-drained 1: the taint is withheld, never sent."""
    other = json.dumps({"n1": _iso(time.time())})
    script = f"""case "$1 $2" in
  "get nodes") echo '{NODES_JSON}' ;;
  "get configmap") n=$(grep -c "get configmap" {tmp_path}/calls)
     if [ "$n" = 1 ]; then data='{{}}'; else data='{other}'; fi
     printf '%s' '{{"metadata": {{"name": "b", "namespace": "s", "resourceVersion": "'$n'"}}, "data": {{"claims": ' ; \
     python3 -c 'import json,sys; print(json.dumps(sys.argv[1]) + "}}}}")' "$data" ;;
  "replace -f") echo 'Error from server (Conflict): the object has been modified' >&2; exit 1 ;;
  *) exit 0 ;;
esac"""
    monkeypatch.setenv("PATH", f"{_fake_kubectl(tmp_path, script)}:{__import__('os').environ['PATH']}")
    monkeypatch.setattr(act_run, "CLAIM_ATTEMPTS", 3)
    out = io.StringIO()
    done, _ = act_run.act(_decision("n2"), ActConfig(scheduler="kubernetes", max_drained="1"), out)
    calls = (tmp_path / "calls").read_text()
    assert done.drains == () and "taint" not in calls, (out.getvalue(), calls)
    assert "changed since it was read; reading it again" in out.getvalue()
    assert "1 of 4 nodes tainted or claimed by stackproof (n1)" in done.actions[0].held


def test_a_won_claim_taints(tmp_path, monkeypatch):
    script = f"""case "$1 $2" in
  "get nodes") echo '{NODES_JSON}' ;;
  "get configmap") echo 'Error from server (NotFound): configmaps "b" not found' >&2; exit 1 ;;
  "create -f") cat > {tmp_path}/created; echo configmap/b ;;
  *) exit 0 ;;
esac"""
    monkeypatch.setenv("PATH", f"{_fake_kubectl(tmp_path, script)}:{__import__('os').environ['PATH']}")
    done, failures = act_run.act(_decision("n2"), ActConfig(scheduler="kubernetes", max_drained="1"), io.StringIO())
    assert [a.node for a in done.drains] == ["n2"] and not failures
    assert "taint node n2 stackproof.io/unhealthy=true:NoSchedule" in (tmp_path / "calls").read_text()
    assert set(json.loads(json.loads((tmp_path / "created").read_text())["data"]["claims"])) == {"n2"}


def test_a_run_that_acted_on_nothing_labels_the_node_incomplete(tmp_path, monkeypatch):
    """Exit 4 names no machine: no drain, but the node's old verdict=pass must not stay."""
    monkeypatch.setenv("PATH", f"{_fake_kubectl(tmp_path, 'exit 0')}:{__import__('os').environ['PATH']}")
    nothing = decide.Decision(Exit.INCOMPLETE, "", withheld="exit code 4 names no machine at fault")
    act_run.act(nothing, ActConfig(scheduler="kubernetes", node="g1"), io.StringIO())
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0] == f"label node g1 {kubernetes.VERDICT_LABEL}=incomplete --overwrite"
    assert calls[1].startswith(f"annotate node g1 {kubernetes.CHECK_ANNOTATION}=stackproof: not judged: exit code 4")


def test_the_incomplete_label_is_one_kubectl_applies(tmp_path):
    """kubectl itself (--local, no cluster) applies the label to a Node object."""
    kubectl = __import__("shutil").which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    node = tmp_path / "node.json"
    labels = {kubernetes.VERDICT_LABEL: "pass"}
    node.write_text(json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "g1", "labels": labels}}))
    local = ["-f", str(node), "--local", "-o", "json"]
    argv = kubernetes.incomplete_commands("g1", "stackproof: not judged", local)[0]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout
    assert json.loads(out)["metadata"]["labels"][kubernetes.VERDICT_LABEL] == kubernetes.INCOMPLETE


# --- Slurm: the lock, with real processes ------------------------------------------------------------------

HOLD = """import sys, time
from pathlib import Path
from stackproof.act import lock
with lock.held(Path(sys.argv[1]), 5):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_the_lock_makes_a_second_node_wait_and_names_the_holder_when_it_times_out(tmp_path):
    path = tmp_path / "breaker.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path), "3"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ActError, match=r"expected the lock within 0.3 s, found it held by pid \d+ on "), \
                lock.held(path, 0.3):
            pass
        with lock.held(path, 10) as waited:  # the holder ends: the lock is ours
            assert waited > 0.5
    finally:
        holder.kill()
        holder.wait(timeout=10)


SLOW_TO_SAY = """import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o664)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(0.5)  # a holder descheduled between taking the lock and saying who it is
os.pwrite(fd, f"pid {os.getpid()} on a slow host".encode(), 0)
time.sleep(30)
"""


def test_a_healthcheck_finding_the_node_held_names_a_holder_slow_to_say_who_it_is(tmp_path):
    """Two healthchecks at once: the one that finds the lock held waits for the holder's words, which follow its
    flock (CI once read the file between the two and named no pid). Words are cleared before the lock is let go:
    none name a holder that is gone."""
    reports = tmp_path / "reports"
    reports.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", SLOW_TO_SAY, str(reports / lock.HEALTHCHECK_LOCK)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with lock.only_one(reports) as held_by:
            assert held_by == f"pid {holder.pid} on a slow host"
    finally:
        holder.kill()
        holder.wait(timeout=10)
    with lock.only_one(reports) as held_by:
        assert held_by == ""
        assert (reports / lock.HEALTHCHECK_LOCK).read_text().startswith(f"pid {os.getpid()} on ")
    assert (reports / lock.HEALTHCHECK_LOCK).read_text() == ""


def test_a_lock_that_cannot_be_opened_holds_the_drain(tmp_path):
    settings = ActConfig(scheduler="slurm", breaker_lock=str(tmp_path / "no" / "such" / "dir" / "lock"))
    out = io.StringIO()
    done, _ = act_run.act(_decision("n2"), settings, out)
    assert done.drains == () and "the circuit breaker's lock was not had" in done.actions[0].held
    assert "run: scontrol" not in out.getvalue()


@pytest.mark.parametrize("value", ["nope", "a/b/c", "/x"])
def test_a_bad_configmap_name_is_bad_input(value):
    from stackproof.errors import ConfigError

    with pytest.raises(ConfigError, match="--breaker-configmap: expected NAMESPACE/NAME"):
        ActConfig(scheduler="kubernetes", breaker_configmap=value)


def test_the_daemonsets_role_may_claim_only_the_breakers_configmap():
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (it is in the dev extra)")
    docs = {d["kind"]: d for d in yaml.safe_load_all((Path(__file__).resolve().parents[1] / "scripts" /
                                                      "kubernetes" / "daemonset.yaml").read_text()) if d}
    namespace, name = ActConfig(scheduler="kubernetes").breaker_configmap.split("/")
    role = docs["Role"]
    assert role["metadata"]["namespace"] == namespace
    assert {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [name], "verbs": ["get", "update"]} \
        in role["rules"]
    assert docs["RoleBinding"]["subjects"][0]["name"] == docs["ServiceAccount"]["metadata"]["name"]


def test_docs_say_the_breakers_figures():
    docs = " ".join((Path(__file__).resolve().parents[1] / "docs" / "act.md").read_text().split())
    assert f"`RECOUNT_SETTLE_S`, {act_run.RECOUNT_SETTLE_S:g} s" in docs
    assert f"({act_run.CLAIM_ATTEMPTS} tries, then no taint)" in docs
    assert f"after {breaker.CLAIM_TTL_S // 60} minutes is dropped" in docs
    assert ActConfig(scheduler="kubernetes").breaker_configmap in docs
