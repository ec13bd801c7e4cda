"""The proof travels with the image, through the real registry and cosign (scripts/ci/registry.sh sets them
up): two real CPU validation runs (one passing, one failing by a fault put into all_reduce) are attested on
stand-in image digests, and `stackproof verify-image` passes for the class it was proven on and refuses, each
with its own one-line reason, another class, another key, a FAILED result, one older than --max-age, a digest
with none, and a tag moved to another digest. The Slurm gate and the deploy/ policies are run against the same
attestations.

One registry prefix, one key set and one pair of runs per module: each cosign call takes about 0.4 s. Without a
registry, skopeo and cosign these tests skip, unless STACKPROOF_REQUIRE_REGISTRY=1 (CI).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import oci_support
import pytest
from test_registry import registry_prefix

from stackproof import cli
from stackproof.errors import ConfigError
from stackproof.images import attest, cosign
from stackproof.images.matrix import REPO_ROOT
from stackproof.report import page

pytestmark = [pytest.mark.registry]

QUICK = ["--nproc", "2", "--max-check-bytes", "64K", "--sweep-max", "256K"]
CPU_CLASS = "gpu=none;gpus=0"
H200_CLASS = "gpu=NVIDIA H200;gpus=8;driver=580.159.04;cuda=13.0"
GATE = REPO_ROOT / "scripts" / "slurm" / "image-gate.sh"


@pytest.fixture(scope="module")
def registry() -> str:
    return registry_prefix("attest")


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    """Two cosign key pairs (empty password): the trusted one and another."""
    folder = tmp_path_factory.mktemp("cosign")
    for prefix in ("trusted", "other"):
        subprocess.run(["cosign", "generate-key-pair", "--output-key-prefix", prefix], cwd=folder, check=True,
                       env={**os.environ, "COSIGN_PASSWORD": ""}, capture_output=True, timeout=60)
    return {name: folder / name for name in ("trusted.key", "trusted.pub", "other.key", "other.pub")}


def _validate(reports: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("NVIDIA_VISIBLE_DEVICES", "STACKPROOF_REPORTS")}
    return subprocess.run([sys.executable, "-m", "stackproof", "validate", "--reports", str(reports), *QUICK, *args],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO_ROOT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two real CPU runs side by side: one passing, one whose all_reduce is wrong on rank 1."""
    root = tmp_path_factory.mktemp("runs")
    plans = {"passed": ["-k", "barrier or (all_reduce and sum-float32)"],
             "failed": ["-k", "all_reduce and sum-float32", "--inject-fault", "allreduce-add-one", "--fault-rank", "1"]}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = {name: pool.submit(_validate, root / name, *args) for name, args in plans.items()}
    assert done["passed"].result().returncode == 0, done["passed"].result().stdout[-3000:]
    assert done["failed"].result().returncode == 1, done["failed"].result().stdout[-3000:]
    # The same passing run, in a folder of its own: attested with the other key, its record stays apart.
    shutil.copytree(root / "passed", root / "passed-again")
    return {name: root / name for name in (*plans, "passed-again")}


@pytest.fixture(scope="module")
def images(registry, tmp_path_factory) -> dict[str, dict[str, str]]:
    """Stand-in images, each its own digest: {name: {tag, digest, pinned}}."""
    root = tmp_path_factory.mktemp("oci")
    made = {}
    for name in ("proven", "failed", "other-key", "none", "moved-away"):
        tag = f"{registry}/standin:{name}"
        digest = oci_support.push(oci_support.layout(root / name, f"stand-in {name} {uuid.uuid4()}"), tag)
        made[name] = {"tag": tag, "digest": digest, "pinned": f"{registry}/standin@{digest}"}
    return made


def _cli(capsys, *argv: str, **env: str) -> tuple[int, str]:
    """stackproof's CLI in this process (cosign is the slow part); (exit code, stdout + stderr)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        code = cli.main(list(argv))
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.fixture(scope="module")
def attested(runs, images, keys) -> dict[str, dict]:
    """The passing run attested on 'proven' (trusted key) and on 'other-key' (the other key), the failing run on
    'failed'; the records attest wrote."""
    os.environ.setdefault("COSIGN_PASSWORD", "")
    records = {}
    for image, run, key in (("proven", "passed", "trusted.key"), ("failed", "failed", "trusted.key"),
                            ("other-key", "passed-again", "other.key")):
        records[image] = attest.attest(runs[run], images[image]["tag"], keys[key], password="")
    return records


def test_the_pinned_cosign_version_is_the_installed_one(monkeypatch):
    assert cosign.COSIGN_VERSION == "2.5.0"
    assert cosign.installed_version() == cosign.COSIGN_VERSION
    monkeypatch.setattr(cosign, "COSIGN_VERSION", "3.0.1")
    with pytest.raises(ConfigError, match=r"cosign: expected version 3\.0\.1 .* found 2\.5\.0"):
        cosign.require_pinned_version()


def test_attest_attaches_a_signed_test_result_on_the_digest(attested, images, runs, keys):
    record = attested["proven"]
    assert record["reference"] == images["proven"]["pinned"] and record["result"] == "PASSED"
    assert record["node_class"] == CPU_CLASS
    statements = cosign.verify(images["proven"]["pinned"], attest.PREDICATE_TYPE, keys["trusted.pub"], attest.POLICY)
    assert len(statements) == 1
    statement = statements[0]
    assert statement["predicateType"] == attest.PREDICATE_TYPE
    assert statement["subject"][0]["digest"]["sha256"] == images["proven"]["digest"].split(":")[1]
    predicate = statement["predicate"]
    assert predicate["result"] == "PASSED" and predicate["failedTests"] == []
    assert "collectives::barrier" in predicate["passedTests"]
    parts = {c["name"]: c for c in predicate["configuration"]}
    assert parts["node-class"]["annotations"] == {"gpu": "none", "gpus": 0}
    assert parts["stackproof"]["annotations"]["version"]
    assert parts["run"]["annotations"]["verdict"] == "OK" and parts["run"]["annotations"]["node"]
    assert json.loads((runs["passed"] / attest.PREDICATE_FILE).read_text()) == predicate


def test_a_failed_run_is_attested_failed_with_its_failed_checks(attested):
    assert attested["failed"]["result"] == "FAILED"


def test_verify_image_passes_for_the_class_it_was_proven_on(attested, images, keys, capsys):
    code, said = _cli(capsys, "verify-image", images["proven"]["tag"], "--key", str(keys["trusted.pub"]),
                      "--node-class", CPU_CLASS)
    assert code == 0, said
    assert said.startswith(f"stackproof verify-image: verified {images['proven']['tag']}: PASSED for {CPU_CLASS}")
    # This CI machine has no GPU: its own class (NVML) is the CPU class.
    code, said = _cli(capsys, "verify-image", images["proven"]["pinned"], "--key", str(keys["trusted.pub"]),
                      "--max-age", "1h", "--json")
    assert code == 0, said
    found = json.loads(said[:said.rindex("}") + 1])
    assert found["ok"] and found["digest"] == images["proven"]["digest"] and found["node_class"] == CPU_CLASS


@pytest.mark.parametrize("case, reason", [
    ("another class", "wrong class: no result for " + H200_CLASS),
    ("another key", "wrong key: "),
    ("a FAILED result", "FAILED: the newest result for gpu=none;gpus=0"),
    ("older than --max-age", "too old: the newest PASSED result"),
    ("a digest with none", "no attestation: "),
    ("a moved tag", "digest mismatch: "),
])
def test_verify_image_refuses_with_one_line_naming_what_is_missing(attested, images, keys, capsys, case, reason):
    pub = str(keys["trusted.pub"])
    argv = {"another class": [images["proven"]["tag"], "--node-class", H200_CLASS],
            "another key": [images["other-key"]["tag"]],
            "a FAILED result": [images["failed"]["tag"]],
            "older than --max-age": [images["proven"]["tag"], "--max-age", "0.001"],
            "a digest with none": [images["none"]["pinned"]],
            # the proven digest, pinned with a tag that now names another image
            "a moved tag": [f"{images['moved-away']['tag']}@{images['proven']['digest']}"]}[case]
    node = [] if "--node-class" in argv else ["--node-class", CPU_CLASS]
    code, said = _cli(capsys, "verify-image", *argv, "--key", pub, *node)
    assert code == 1, said
    lines = said.strip().splitlines()
    assert len(lines) == 1, said
    assert lines[0].startswith(f"stackproof verify-image: refused {argv[0]}: {reason}"), lines[0]
    assert lines[0].count("fix:") == 1, lines[0]  # issue 36 item 7: wrong class: had none
    if case == "a FAILED result":
        assert "collectives::all_reduce[sum-float32]" in lines[0]


def test_a_moved_tag_fails_where_the_digest_still_passes(attested, images, keys, capsys, tmp_path):
    """The tag 'proven' moved to another image: the tag now has no proof, the digest it named still has."""
    moved = f"{images['proven']['tag']}-moved"
    subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false", "--dest-tls-verify=false",
                    f"docker://{images['proven']['pinned']}", f"docker://{moved}"], check=True, timeout=120)
    pub = str(keys["trusted.pub"])
    assert _cli(capsys, "verify-image", moved, "--key", pub, "--node-class", CPU_CLASS)[0] == 0
    oci_support.push(oci_support.layout(tmp_path / "oci", f"moved {uuid.uuid4()}"), moved)
    code, said = _cli(capsys, "verify-image", moved, "--key", pub, "--node-class", CPU_CLASS)
    assert code == 1 and "no attestation: " in said, said
    code, said = _cli(capsys, "verify-image", f"{moved}@{images['proven']['digest']}", "--key", pub,
                      "--node-class", CPU_CLASS)
    assert code == 1 and "digest mismatch: " in said and "(the tag moved)" in said, said
    assert _cli(capsys, "verify-image", images["proven"]["pinned"], "--key", pub, "--node-class", CPU_CLASS)[0] == 0


def test_attest_refuses_a_run_without_an_image_digest(runs, keys, registry, capsys):
    code, said = _cli(capsys, "attest", "--reports", str(runs["passed"]), "--key", str(keys["trusted.key"]))
    assert code == 2, said
    assert "expected the image digest the run ran in" in said and "fix: pass --image REPO@sha256:" in said
    code, said = _cli(capsys, "attest", "--reports", str(runs["passed"]), "--key", str(keys["trusted.key"]),
                      "--image", f"{registry}/nothing:here")
    assert code == 2 and "expected an image digest the registry " in said and said.count("fix:") == 1, said


def test_verdict_and_the_page_show_the_attestation(attested, runs, images, capsys, tmp_path):
    code, said = _cli(capsys, "verdict", "--reports", str(runs["passed"]))
    assert code == 0
    assert said.splitlines()[0] == f"# stackproof: {attest.record_line(attested['proven'])}"
    assert said.splitlines()[-2].startswith("# Verdict: OK")
    html = page.write([runs["passed"]], tmp_path / "page.html")[0].read_text()
    assert images["proven"]["pinned"] in html and "PASSED for gpu=none;gpus=0" in html


def test_the_slurm_gate_refuses_an_unproven_image(attested, images, keys):
    def gate(image: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(GATE)], capture_output=True, text=True, timeout=120, env={
            **os.environ, "SPANK_STACKPROOF_IMAGE": image, "STACKPROOF_IMAGE_GATE": "1",
            "STACKPROOF_ATTEST_PUB": str(keys["trusted.pub"]), "STACKPROOF_PYTHON": sys.executable,
            "STACKPROOF_REPO": str(REPO_ROOT), "STACKPROOF_NODE_CLASS": CPU_CLASS, **env})

    proven = gate(images["proven"]["tag"])
    assert proven.returncode == 0, proven.stdout + proven.stderr
    refused = gate(images["failed"]["tag"])
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "refused" in refused.stdout and "FAILED: " in refused.stdout
    # pyxis's form of a reference (REGISTRY#IMAGE) is the same image.
    host, _, rest = images["proven"]["tag"].partition("/")
    assert gate(f"{host}#{rest}").returncode == 0
    # Opt-in: off (or no image named), the gate lets every job start.
    assert gate(images["failed"]["tag"], STACKPROOF_IMAGE_GATE="0").returncode == 0
    assert gate("").returncode == 0



def test_the_prolog_gate_cancels_the_job_and_leaves_the_node_in_service(attested, images, keys, tmp_path):
    """As slurmd's Prolog: a refused image cancels the job (its comment says why) and exits 0, since a failing
    Prolog would drain the node. scontrol and scancel are stand-ins that record their arguments."""
    for tool in ("scontrol", "scancel"):
        (tmp_path / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> "{tmp_path}/slurm.log"\n')
        (tmp_path / tool).chmod(0o755)
    proc = subprocess.run(["bash", str(GATE)], capture_output=True, text=True, timeout=120, env={
        **os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SPANK_STACKPROOF_IMAGE": images["failed"]["tag"],
        "STACKPROOF_IMAGE_GATE": "1", "STACKPROOF_ATTEST_PUB": str(keys["trusted.pub"]),
        "STACKPROOF_PYTHON": sys.executable, "STACKPROOF_REPO": str(REPO_ROOT), "STACKPROOF_NODE_CLASS": CPU_CLASS,
        "SLURM_SCRIPT_CONTEXT": "prolog_slurmd", "SLURM_JOB_ID": "42"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = (tmp_path / "slurm.log").read_text().splitlines()
    assert calls[0].startswith("scontrol update jobid=42 comment=stackproof image gate: stackproof verify-image: "
                               "refused"), calls
    assert "FAILED: " in calls[0] and calls[1] == "scancel 42"


# --- deploy/admission: the policy-controller CUE through cosign, the Kyverno conditions through JMESPath -------

ADMISSION = REPO_ROOT / "deploy" / "admission"


def _yaml(name: str) -> dict:
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (dev extra)")
    return yaml.safe_load((ADMISSION / name).read_text())


@pytest.fixture(scope="module")
def h200_attested(images, registry, keys, tmp_path_factory) -> dict[str, str]:
    """The real H200 run's record (tests/fixtures/attest: one H200, validate --tier fast on the GPU machine),
    attested on a stand-in image of its own."""
    folder = tmp_path_factory.mktemp("h200-run")
    shutil.copy(Path(__file__).parent / "fixtures" / "attest" / "h200x1-fast-report.json", folder / "report.json")
    tag = f"{registry}/standin:h200"
    digest = oci_support.push(oci_support.layout(folder / "oci", f"h200 {uuid.uuid4()}"), tag)
    record = attest.attest(folder, tag, keys["trusted.key"], password="")
    assert record["node_class"] == "gpu=NVIDIA H200;gpus=1;driver=580.159.04;cuda=13.0"
    return {"tag": tag, "pinned": f"{registry}/standin@{digest}"}


def _for_one_gpu(text: str) -> str:
    # The policies are written for 8 x H200; the GPU machine's run had one.
    return text.replace("gpus: 8", "gpus: 1")


def test_the_policy_controller_cue_admits_only_a_pass_for_its_class(attested, h200_attested, images, keys, tmp_path):
    policy = _yaml("policy-controller-proven-images.yaml")
    assert policy["kind"] == "ClusterImagePolicy" and policy["apiVersion"] == "policy.sigstore.dev/v1beta1"
    (check,) = policy["spec"]["authorities"][0]["attestations"]
    assert check["predicateType"] == attest.PREDICATE_TYPE and check["policy"]["type"] == "cue"
    cue = tmp_path / "h200x1.cue"
    cue.write_text(_for_one_gpu(check["policy"]["data"]))
    pub = keys["trusted.pub"]
    assert cosign.verify(h200_attested["pinned"], attest.PREDICATE_TYPE, pub, cue)
    for refused in ("proven", "failed"):  # a CPU class's PASSED, and a FAILED
        with pytest.raises(cosign.NotVerified) as err:
            cosign.verify(images[refused]["pinned"], attest.PREDICATE_TYPE, pub, cue)
        assert err.value.why == "policy", err.value.said
    # As written (8 x H200), the one-GPU result is not enough.
    (tmp_path / "h200x8.cue").write_text(check["policy"]["data"])
    with pytest.raises(cosign.NotVerified):
        cosign.verify(h200_attested["pinned"], attest.PREDICATE_TYPE, pub, tmp_path / "h200x8.cue")


def test_the_kyverno_policy_is_keyed_on_the_gpu_node_selector(attested, h200_attested, images, keys):
    jmespath = pytest.importorskip("jmespath", reason="jmespath is not installed (dev extra)")
    policy = _yaml("kyverno-proven-images.yaml")
    (rule,) = policy["spec"]["rules"]
    (verify,) = rule["verifyImages"]
    (check,) = verify["attestations"]
    assert check["type"] == attest.PREDICATE_TYPE
    entry = check["attestors"][0]["entries"][0]["keys"]
    assert entry["rekor"]["ignoreTlog"] is True and entry["ctlog"]["ignoreSCT"] is True  # signed offline

    def holds(conditions: list[dict], document: dict, one_gpu: bool = False) -> bool:
        def value(condition: dict):
            return 1 if one_gpu and condition["value"] == 8 else condition["value"]
        return all(str(jmespath.search(c["key"].strip("{} "), document)) == str(value(c)) for c in conditions)

    def pod(selector: dict) -> dict:
        return {"request": {"object": {"kind": "Pod", "spec": {"nodeSelector": selector}}}}

    preconditions = rule["preconditions"]["all"]
    assert holds(preconditions, pod({"nvidia.com/gpu.product": "NVIDIA-H200", "nvidia.com/gpu.count": "8"}))
    assert holds(preconditions, pod({"nvidia.com/gpu.product": "NVIDIA-H200"}))
    assert not holds(preconditions, pod({"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}))
    assert not holds(preconditions, pod({}))

    def predicate(pinned: str) -> dict:
        return cosign.verify(pinned, attest.PREDICATE_TYPE, keys["trusted.pub"], attest.POLICY)[0]["predicate"]

    conditions = check["conditions"][0]["all"]
    assert holds(conditions, predicate(h200_attested["pinned"]), one_gpu=True)
    assert not holds(conditions, predicate(h200_attested["pinned"]))  # 8 GPUs asked for, 1 proven
    assert not holds(conditions, predicate(images["proven"]["pinned"]), one_gpu=True)  # the CPU class
    assert not holds(conditions, predicate(images["failed"]["pinned"]), one_gpu=True)  # FAILED


# --- make test-gpu ATTEST=1 and make verify-image --------------------------------------------------------------

STUB_DOCKER = """#!/bin/sh
# docker, as make test-gpu uses it: `image inspect` names the image's RepoDigest; `run` records its arguments and
# leaves a finished run's report in the mounted reports folder (what the validation image does).
echo "$@" >> "$STUB_LOG"
case "$1 $2" in
    "image inspect") echo "$STUB_REPO_DIGEST " ;;
    "run "*) for arg; do case "$arg" in *:/reports) cp "$STUB_REPORT" "${arg%:/reports}/report.json" ;; esac; done ;;
esac
"""


def _make(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    return subprocess.run(["make", "--no-print-directory", *args, f"PYTHON={sys.executable}"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300, env={**clean, **env})


def test_make_test_gpu_attest_and_make_verify_image(attested, runs, images, registry, keys, tmp_path):
    if not shutil.which("make"):
        pytest.skip("no make")
    tag = f"{registry}/standin:make"
    digest = oci_support.push(oci_support.layout(tmp_path / "oci", f"make {uuid.uuid4()}"), tag)
    stub = tmp_path / "docker"
    stub.write_text(STUB_DOCKER)
    stub.chmod(0o755)
    reports = tmp_path / "reports"
    env = {"STUB_LOG": str(tmp_path / "docker.log"), "STUB_REPORT": str(runs["passed"] / "report.json"),
           "STUB_REPO_DIGEST": f"{registry}/standin@{digest}", "COSIGN_PASSWORD": ""}
    proc = _make("test-gpu", f"DOCKER={stub}", "GPU_FLAGS=", f"REPORTS={reports}", "ATTEST=1", f"ATTEST_IMAGE={tag}",
                 f"COSIGN_KEY={keys['trusted.key']}", **env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"-e STACKPROOF_IMAGE_REF={registry}/standin@{digest}" in (tmp_path / "docker.log").read_text()
    assert f"# attested {registry}/standin@{digest}: PASSED for {CPU_CLASS}" in proc.stdout
    assert attest.read_record(reports)["reference"] == f"{registry}/standin@{digest}"
    verified = _make("verify-image", f"VERIFY_IMAGE={tag}", f"COSIGN_PUB={keys['trusted.pub']}",
                     f"NODE_CLASS={CPU_CLASS}", "MAX_AGE=1h")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    refused = _make("verify-image", f"VERIFY_IMAGE={tag}", f"COSIGN_PUB={keys['trusted.pub']}",
                    f"NODE_CLASS={H200_CLASS}")
    assert refused.returncode != 0 and "wrong class: " in refused.stdout, refused.stdout + refused.stderr
    assert _make("verify-image").returncode == 2


def test_attest_takes_the_digest_the_run_recorded(runs, images, keys, tmp_path):
    """A run given --image-ref (STACKPROOF_IMAGE_REF: what make test-gpu passes) is attested on that digest."""
    data = json.loads((runs["passed"] / "report.json").read_text())
    data["settings"]["image_ref"] = images["none"]["pinned"]
    (tmp_path / "report.json").write_text(json.dumps(data))
    record = attest.attest(tmp_path, None, keys["trusted.key"], password="")
    assert record["reference"] == images["none"]["pinned"]
