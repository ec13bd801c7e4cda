"""The node class and the verify-image rules without a registry: the class a real H200 run's record gives
(tests/fixtures/attest: `stackproof validate --tier fast` on the GPU machine), the class NVML gives (the H200
recording replayed beneath stackproof), the NICs from a sysfs tree, and which attested result decides."""

from __future__ import annotations

import datetime
import importlib.util
import sys
from pathlib import Path

import pytest

from stackproof.errors import ConfigError
from stackproof.images import attest, cosign
from stackproof.images.attest_config import parse_duration
from stackproof.judge import node_class
from stackproof.judge.node_class import NodeClass
from stackproof.measure import nics
from stackproof.report.record import Report, read_report

FIXTURES = Path(__file__).parent / "fixtures"
H200_RUN = FIXTURES / "attest" / "h200x1-fast-report.json"
H200_CLASS = "gpu=NVIDIA H200;gpus=1;driver=580.159.04;cuda=13.0"  # what `stackproof node-class` printed there


def test_a_real_h200_run_gives_the_class_its_node_printed():
    report = Report.from_json(read_report(H200_RUN))
    made = node_class.of_run(report.ranks, report.context, report.settings)
    assert made.text() == H200_CLASS
    assert node_class.parse(made.text()) == made


def test_the_h200_nvml_recording_gives_the_same_class(monkeypatch):
    monkeypatch.setenv("NVML_REPLAY", str(FIXTURES / "nvml" / "h200.json"))
    spec = importlib.util.spec_from_file_location("pynvml", Path(__file__).parent / "nvml_replay" / "pynvml.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    made = attest.this_node_class(str(FIXTURES / "sysfs" / "h200-vm"), infiniband="/nonexistent")
    assert made.text() == H200_CLASS


def test_a_run_that_recorded_no_driver_cannot_be_attested():
    data = read_report(H200_RUN)
    report = Report.from_json({**data, "context": {}})
    with pytest.raises(node_class.UnknownClass, match="recorded no driver") as err:
        node_class.of_run(report.ranks, report.context, report.settings)
    assert err.value.exit_code == 2


def test_nodes_of_different_classes_are_refused():
    ranks = [{"node": "a", "gpu": {"uuid": "GPU-1", "name": "NVIDIA H200"}},
             {"node": "b", "gpu": {"uuid": "GPU-2", "name": "NVIDIA H100 80GB HBM3"}}]
    with pytest.raises(node_class.UnknownClass, match="different classes: a: gpu=NVIDIA H200"):
        node_class.of_run(ranks, {"driver": {"version": "580", "cuda": "13.0"}}, {})


def test_nics_from_sysfs(tmp_path):
    for device, rate, layer in (("mlx5_0", "400 Gb/sec (4X NDR)", "InfiniBand"),
                                ("mlx5_1", "400 Gb/sec (4X NDR)", "InfiniBand"),
                                ("mlx5_2", "200 Gb/sec (4X HDR)", "Ethernet")):
        port = tmp_path / device / "ports" / "1"
        port.mkdir(parents=True)
        (port / "rate").write_text(rate + "\n")
        (port / "link_layer").write_text(layer + "\n")
    assert nics.survey(tmp_path) == "1 x 200 Gb/sec Ethernet, 2 x 400 Gb/sec InfiniBand"
    assert nics.survey(tmp_path / "none") is None


@pytest.mark.parametrize("text, problem", [("gpu=NVIDIA H200", "at least gpu=MODEL;gpus=N"),
                                           ("gpu=x;gpus=8;colour=red", "'colour=red'"),
                                           ("gpu=x;gpus=eight", "a whole number")])
def test_a_bad_node_class_is_bad_input(text, problem):
    with pytest.raises(ConfigError, match=problem):
        node_class.parse(text)


def test_the_spec_counts_only_when_asked_for():
    attested = NodeClass("NVIDIA H200", 8, "580.159.04", "13.0", spec="h200.spec.json")
    assert node_class.differences(attested, NodeClass("NVIDIA H200", 8, "580.159.04", "13.0")) == []
    wanted = NodeClass("NVIDIA H200", 8, "580.159.04", "13.0", spec="other.json")
    assert node_class.differences(attested, wanted) == ["spec h200.spec.json (this node: other.json)"]


@pytest.mark.parametrize("text, seconds", [("30d", 30 * 86400), ("12h", 43200), ("90m", 5400), ("45s", 45),
                                           ("1.5", 1.5)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("reference, fields", [
    ("r:5000/a/b:v1", ("r:5000/a/b", "v1", None)),
    ("r:5000/a/b@sha256:" + "0" * 64, ("r:5000/a/b", None, "sha256:" + "0" * 64)),
    ("r/a:v1@sha256:" + "1" * 64, ("r/a", "v1", "sha256:" + "1" * 64)),
])
def test_references(reference, fields):
    assert attest._split(reference) == fields


def _statement(result: str, finished: str, digest: str = "sha256:" + "a" * 64) -> dict:
    return {"subject": [{"digest": {"sha256": digest.split(":")[1]}}], "predicate": {
        "result": result, "failedTests": [] if result == "PASSED" else ["collectives::all_reduce[sum-float32]"],
        "configuration": [{"name": "node-class", "annotations": {"gpu": "none", "gpus": 0}},
                          {"name": "run", "annotations": {"node": "n1", "finished": finished}}]}}


@pytest.fixture
def attested(monkeypatch):
    """verify_image over statements given here, as if cosign had verified them on digest aaaa..."""
    def install(*statements: dict):
        monkeypatch.setattr(cosign, "require_pinned_version", lambda: cosign.COSIGN_VERSION)
        monkeypatch.setattr(attest, "digest_of", lambda reference: "sha256:" + "a" * 64)
        monkeypatch.setattr(cosign, "verify", lambda *args: list(statements))
    return install


def test_a_newer_failed_result_withdraws_an_older_pass(attested):
    attested(_statement("PASSED", "2026-11-01T00:00:00+00:00"), _statement("FAILED", "2026-11-02T00:00:00+00:00"))
    verdict = attest.verify_image("r/a:v1", NodeClass("none", 0), Path("k.pub"))
    assert not verdict.ok and verdict.reason.startswith("FAILED: the newest result")
    assert "collectives::all_reduce[sum-float32]" in verdict.reason


def test_a_newer_pass_after_a_failure_passes(attested):
    attested(_statement("FAILED", "2026-11-01T00:00:00+00:00"), _statement("PASSED", "2026-11-02T00:00:00+00:00"))
    now = datetime.datetime(2026, 11, 3, tzinfo=datetime.timezone.utc)
    verdict = attest.verify_image("r/a:v1", NodeClass("none", 0), Path("k.pub"), 2 * 86400, now=now)
    assert verdict.ok, verdict.reason
    assert attest.verify_image("r/a:v1", NodeClass("none", 0), Path("k.pub"), 3600, now=now).reason.startswith(
        "too old: ")


def test_an_attestation_about_another_digest_is_a_mismatch(attested):
    attested(_statement("PASSED", "2026-11-01T00:00:00+00:00", digest="sha256:" + "b" * 64))
    verdict = attest.verify_image("r/a:v1", NodeClass("none", 0), Path("k.pub"))
    assert verdict.reason.startswith("digest mismatch: an attestation on r/a@sha256:aaaa")


def _run_in(folder: Path, image_ref: str) -> Path:
    data = read_report(H200_RUN)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(__import__("json").dumps({**data, "settings": {
        **(data.get("settings") or {}), "image_ref": image_ref}}))
    return folder


D1, D2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64


def test_a_result_is_never_signed_onto_an_image_the_run_did_not_run_in(tmp_path):
    """Issue 36 item 2: the run recorded IMG1@D1; `attest --image IMG2@D2` signed D2 without a word."""
    run = _run_in(tmp_path / "run", f"registry.example/img1@{D1}")
    with pytest.raises(ConfigError) as err:
        attest.attest(run, f"registry.example/img2@{D2}", tmp_path / "cosign.key")
    said = str(err.value)
    assert err.value.exit_code == 2 and "\n" not in said, said
    assert f"expected the digest the run ran in ({D1}" in said and f"found {D2}" in said and "fix: " in said


def test_a_failed_attest_leaves_the_last_signed_predicate_in_place(tmp_path, monkeypatch):
    """Issue 36 item 8: a failed attest rewrote attestation.predicate.json before signing, and it no longer
    matched attestation.json. cosign here is a program on PATH that fails to sign, as with a wrong password."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "cosign"
    fake.write_text(f"""#!/bin/sh
[ "$1" = version ] && {{ echo '{{"gitVersion": "v{cosign.COSIGN_VERSION}"}}'; exit 0; }}
echo "Error: PUT https://registry.example/v2/img1/manifests/sha256-1.att: 503 Service Unavailable" >&2; exit 1
""")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    monkeypatch.setattr(attest, "digest_of", lambda reference: D1)  # the registry holds it
    run = _run_in(tmp_path / "run", f"registry.example/img1@{D1}")
    signed = run / attest.PREDICATE_FILE
    signed.write_text('{"the": "predicate of the attest that succeeded"}\n')
    (tmp_path / "cosign.key").write_text("a key\n")
    with pytest.raises(cosign.CosignError):
        attest.attest(run, None, tmp_path / "cosign.key")
    assert signed.read_text() == '{"the": "predicate of the attest that succeeded"}\n'
    assert sorted(p.name for p in run.iterdir()) == sorted(["report.json", attest.PREDICATE_FILE])


@pytest.mark.parametrize("given", ["90d", "365d"])
def test_a_max_age_past_30_days_is_an_age_not_a_typo(given, monkeypatch):
    """Issue 36 item 4: 90d was refused as 'found 7776000.0' (the 30-day cap on waits), so the Slurm image gate
    refused every job on every node."""
    from stackproof.images.attest_config import VerifyImageConfig

    monkeypatch.setenv("STACKPROOF_ATTEST_MAX_AGE", given)
    made = VerifyImageConfig.from_args(__import__("argparse").Namespace())
    assert made.max_age == parse_duration(given)
    with pytest.raises(ConfigError, match=r"expected an age > 0 \(30d, 12h, 90m, seconds\), found 0 s"):
        VerifyImageConfig(max_age=0.0)


def test_a_missing_key_is_bad_input_in_one_line(tmp_path):
    """Issue 36 item 7: it exited 1 with cosign's many lines; now it is refused before cosign runs. A key cosign
    cannot use and a wrong password: tests/test_attest_errors.py, with the real cosign."""
    for call in (lambda: cosign.attest(f"registry.example/img1@{D1}", tmp_path / "p.json", "t", tmp_path / "no.key"),
                 lambda: cosign.verify(f"registry.example/img1@{D1}", "t", tmp_path / "no.key", tmp_path / "p.cue")):
        with pytest.raises(ConfigError, match=r"--key .*no.key: expected a cosign key file .*found no such file") \
                as err:
            call()
        assert err.value.exit_code == 2 and "\n" not in str(err.value) and str(err.value).count("fix:") == 1
