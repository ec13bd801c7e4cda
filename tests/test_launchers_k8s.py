"""Kubernetes manifests (scripts/kubernetes/): what can be proven without a cluster.

Statically (PyYAML): every pod runs `stackproof validate` through the image's entrypoint, GPU limits match the
ranks per pod, /dev/shm is a memory emptyDir, deadlines and timeouts bound everything, the indexed Job's pods
find rank 0 through the headless Service. Dynamically: the pods' own command runs here, as two "pods" (two
processes with the environment the operator or the manifest gives them) on CPU ranks, and exits as the Job
would see it: 0 on a pass, non-zero on a fault, 3 when a pod has fewer GPUs than it asked for.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (pip install pyyaml; it is in the dev extra)")

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "scripts" / "kubernetes"
PYTORCHJOB = K8S / "pytorchjob.yaml"
INDEXED = K8S / "indexed-job.yaml"
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
POD_TIMEOUT_S = 240
MiB = 1 << 20


def _load(path: Path) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(path.read_text()) if doc}


def _pods() -> dict[str, dict]:
    """Every pod template, by where it comes from."""
    job = _load(PYTORCHJOB)["PyTorchJob"]
    specs = job["spec"]["pytorchReplicaSpecs"]
    return {"pytorchjob-master": specs["Master"]["template"], "pytorchjob-worker": specs["Worker"]["template"],
            "indexed-job": _load(INDEXED)["Job"]["spec"]["template"]}


def _container(pod: dict) -> dict:
    (container,) = pod["spec"]["containers"]
    return container


def _env(container: dict) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _quantity(text: str | int) -> int:
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(text))
    assert match, f"not a binary quantity: {text!r}"
    return int(match.group(1)) << {None: 0, "Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40}[match.group(2)]


def _script(container: dict) -> tuple[str, list[str]]:
    """(the bash script, the arguments after it: $0 then validate's flags)."""
    args = container["args"]
    assert args[:2] == ["bash", "-c"], f"expected args: [bash, -c, SCRIPT, ...], got {args[:2]}"
    return args[2], args[3:]


@pytest.fixture(params=["pytorchjob-master", "pytorchjob-worker", "indexed-job"])
def pod(request) -> dict:
    return _pods()[request.param]


# --- static -------------------------------------------------------------------------------------------------

def test_kinds_and_api_versions():
    job = _load(PYTORCHJOB)["PyTorchJob"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    indexed = _load(INDEXED)
    assert set(indexed) == {"Service", "Job"}
    assert indexed["Job"]["apiVersion"] == "batch/v1" and indexed["Service"]["apiVersion"] == "v1"


def test_pod_runs_validate_through_the_image_entrypoint(pod):
    container = _container(pod)
    # No `command`: the image's ENTRYPOINT stays (tini as PID 1 reaps DataLoader workers, forwards signals).
    assert "command" not in container
    script, rest = _script(container)
    assert "exec python3 -m stackproof validate" in script and "--nnodes=" in script
    assert '"$@"' in script and rest[0] == "stackproof"  # $0, then flags passed through to validate
    assert re.fullmatch(r"([\w.-]+(:\d+)?/)?stackproof/validation:[\w.-]+", container["image"]), container["image"]


def test_both_manifests_run_the_same_pod_command():
    scripts = {name: _script(_container(p)) for name, p in _pods().items()}
    assert len({json.dumps(s) for s in scripts.values()}) == 1, scripts


def test_image_is_a_validation_image_of_the_matrix(pod):
    from stackproof.images import bake
    from stackproof.images.matrix import load_matrix

    tags = {bake.validation_tag(image).split(":", 1)[1] for image in load_matrix().images}
    assert _container(pod)["image"].rsplit(":", 1)[1] in tags


def test_gpu_limits_equal_ranks_per_pod(pod):
    resources = _container(pod)["resources"]
    gpus = resources["limits"]["nvidia.com/gpu"]
    assert gpus >= 1 and resources["requests"].get("nvidia.com/gpu", gpus) == gpus
    job = _load(PYTORCHJOB)["PyTorchJob"]
    if pod in (job["spec"]["pytorchReplicaSpecs"][r]["template"] for r in ("Master", "Worker")):
        assert int(job["spec"]["nprocPerNode"]) == gpus
    else:
        assert int(_env(_container(pod))["PET_NPROC_PER_NODE"]) == gpus


def test_dev_shm_is_a_memory_emptydir(pod):
    mounts = {m["mountPath"]: m["name"] for m in _container(pod)["volumeMounts"]}
    assert "/dev/shm" in mounts
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mounts["/dev/shm"])
    assert volume["emptyDir"]["medium"] == "Memory"
    # The suite's /dev/shm check wants >= 1 GiB by default (smoke_tests/test_01_host.py).
    assert _quantity(volume["emptyDir"]["sizeLimit"]) >= 1024 * MiB


def test_reports_dir_is_a_volume(pod):
    mounts = {m["mountPath"] for m in _container(pod)["volumeMounts"]}
    assert "/reports" in mounts  # the image's STACKPROOF_REPORTS


def test_nothing_can_hang(pod):
    env = _env(_container(pod))
    script, rest = _script(_container(pod))
    assert '--rendezvous-timeout="$RDZV_TIMEOUT_S"' in script and int(env["RDZV_TIMEOUT_S"]) > 0
    assert any(a.startswith("--timeout") for a in rest)  # every collective / cross-rank sync
    for deadline, backoff in (_deadline(PYTORCHJOB), _deadline(INDEXED)):
        assert 0 < deadline <= 4 * 3600 and backoff == 0
        assert int(env["RDZV_TIMEOUT_S"]) < deadline


def _deadline(path: Path) -> tuple[int, int]:
    docs = _load(path)
    spec = docs["PyTorchJob"]["spec"]["runPolicy"] if "PyTorchJob" in docs else docs["Job"]["spec"]
    return spec["activeDeadlineSeconds"], spec["backoffLimit"]


def test_nccl_env(pod):
    env = _env(_container(pod))
    assert env["NCCL_SOCKET_IFNAME"] and env["GLOO_SOCKET_IFNAME"]
    # Every rank sets it (2) where it starts (suite/dist.py): 1 would kill a waiting rank before the watchdog
    # names the stalled one.
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env
    assert env["STACKPROOF_NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    # NCCL_DEBUG stays unset: the worker then sends NCCL's INFO lines to a file the transport check reads.
    assert "NCCL_DEBUG" not in env


def test_pods_land_on_distinct_gpu_nodes(pod):
    (term,) = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    labels = {**pod["metadata"].get("labels", {})}
    if "job-name" in term["labelSelector"]["matchLabels"]:
        labels["job-name"] = _load(INDEXED)["Job"]["metadata"]["name"]  # the Job controller sets it
    assert term["labelSelector"]["matchLabels"].items() <= labels.items()


def test_pytorchjob_shape():
    job = _load(PYTORCHJOB)["PyTorchJob"]
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] >= 1
    assert specs["Master"]["template"] == specs["Worker"]["template"]
    for spec in specs.values():
        assert spec["restartPolicy"] == "Never"
        container = _container(spec["template"])
        # The operator finds its container and the master port by these names.
        assert container["name"] == "pytorch"
        assert any(p["name"] == "pytorchjob-port" for p in container["ports"])


def test_indexed_job_finds_rank_0_through_the_headless_service():
    docs = _load(INDEXED)
    job, service = docs["Job"], docs["Service"]
    spec = job["spec"]
    env = _env(_container(spec["template"]))
    assert spec["completionMode"] == "Indexed"
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # a failed pod fails the Job (backoffLimit 0)
    assert spec["completions"] == spec["parallelism"] == int(env["PET_NNODES"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert spec["template"]["spec"]["subdomain"] == service["metadata"]["name"]
    # Indexed Job pods are named (hostname) <job>-<index>: pod 0 is node rank 0, which hosts the store.
    assert env["MASTER_ADDR"] == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert env["PET_NODE_RANK"] == {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    ports = {p["containerPort"] for p in _container(spec["template"])["ports"]}
    assert int(env["MASTER_PORT"]) in ports


# --- the pod command, run here ------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pod_env(tmp_path: Path, manifest: str, index: int, port: int, **extra: str) -> dict[str, str]:
    """The environment a pod of `manifest` gets, with the cluster's parts mapped onto this host."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "python3"  # the image's python3 is our venv's
    shim.write_text(f'#!/bin/sh\nexec "{PYTHON}" "$@"\n')
    shim.chmod(0o755)
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "PET_", "STACKPROOF_")) and k not in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NCCL_DEBUG")}
    if manifest == "indexed-job":
        container = _container(_load(INDEXED)["Job"]["spec"]["template"])
        pod_env = {k: v for k, v in _env(container).items() if isinstance(v, str)}
        pod_env["PET_NODE_RANK"] = str(index)  # the completion-index annotation
    else:
        container = _container(_load(PYTORCHJOB)["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]["Master"]["template"])
        pod_env = {k: v for k, v in _env(container).items() if isinstance(v, str)}
        # What the training operator adds (pkg/controller.v1/pytorch/envvar.go): pod-level RANK and WORLD_SIZE,
        # which torchrun must replace for its ranks.
        pod_env.update(PET_NODE_RANK=str(index), PET_NNODES="2", RANK=str(index), WORLD_SIZE="2",
                       PYTHONUNBUFFERED="0")
    pod_env.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),          # pod 0's DNS name -> this host
        NCCL_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo",        # the pod network -> loopback
        PET_NPROC_PER_NODE="1", OMP_NUM_THREADS="1",             # one CPU rank per "pod"
        PATH=f"{bin_dir}:{base.get('PATH', '/usr/bin:/bin')}",
        PYTHONPATH=str(REPO),                                    # the image has PYTHONPATH=/opt/stackproof
        STACKPROOF_REPORTS=str(tmp_path / f"pod{index}"),        # the image's /reports, one per pod
    )
    return {**base, **pod_env, **extra}


def _run_pods(tmp_path: Path, manifest: str, extra_args: list[str],
              **extra_env: str) -> list[subprocess.CompletedProcess]:
    path = INDEXED if manifest == "indexed-job" else PYTORCHJOB
    docs = _load(path)
    pod = docs["Job"]["spec"]["template"] if "Job" in docs else \
        docs["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    script, rest = _script(_container(pod))
    port = _free_port()
    procs = [subprocess.Popen(["bash", "-c", script, *rest, *extra_args], cwd=tmp_path,
                              env=_pod_env(tmp_path, manifest, index, port, **extra_env),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for index in (0, 1)]
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=POD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            pytest.fail(f"{manifest}: the pods did not finish within {POD_TIMEOUT_S} s")
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
    return results


SUBSET = ["-k", "collectives", "--max-check-bytes", "64K"]


# One real run per manifest: this one for the PyTorchJob (whose operator sets pod-level RANK/WORLD_SIZE), the
# fault run below for the indexed Job; the pod command is the same in both (test above).
@pytest.mark.parametrize("manifest", ["pytorchjob"])
def test_pod_command_passes_on_two_cpu_pods(tmp_path, manifest):
    pods = _run_pods(tmp_path, manifest, SUBSET, EXPECT_GPUS="0")
    for index, pod in enumerate(pods):
        assert pod.returncode == 0, f"pod {index}: exit {pod.returncode}\n{pod.stdout[-5000:]}"
    report = json.loads((tmp_path / "pod0" / "report.json").read_text())
    assert report["verdict"] == "OK" and report["world"]["size"] == 2
    assert (tmp_path / "pod1" / "logs" / "rank1.log").exists()  # rank 1 ran in the other "pod"
    assert "Verdict: OK" in pods[0].stdout


def test_pod_command_fails_both_pods_on_a_fault(tmp_path):
    pods = _run_pods(tmp_path, "indexed-job", [*SUBSET, "--inject-fault", "allreduce-add-one"], EXPECT_GPUS="0")
    assert [p.returncode != 0 for p in pods] == [True, True], [p.returncode for p in pods]
    report = json.loads((tmp_path / "pod0" / "report.json").read_text())
    assert report["verdict"] == "FAILED"
    assert any("rank(s) [1] of 2" in c["message"] for c in report["checks"] if c["outcome"] == "failed")


def test_pod_without_its_gpus_exits_3(tmp_path):
    """nvidia.com/gpu asked for, none visible (broken device plugin): exit 3, never a CPU 'pass'."""
    script, rest = _script(_container(_load(INDEXED)["Job"]["spec"]["template"]))
    env = _pod_env(tmp_path, "indexed-job", 0, _free_port(), PET_NPROC_PER_NODE="8")
    proc = subprocess.run(["bash", "-c", script, *rest], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "no GPU visible" in proc.stdout and "expected >= 8, found 0" in proc.stdout


# --- every manifest against the Kubernetes API schema (kubernetes-validate bundles the schemas) --------------

def _schema_errors(docs: list[dict]) -> list[str]:
    """Each document against its kind's schema (strict: unknown fields fail). A custom resource (PyTorchJob)
    has no bundled schema: its pod templates are validated as core PodTemplates instead."""
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (dev extra)")
    errors = []
    for doc in docs:
        if doc["kind"] == "PyTorchJob":
            targets = [{"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{role.lower()}"},
                        "template": spec["template"]} for role, spec in doc["spec"]["pytorchReplicaSpecs"].items()]
        else:
            targets = [doc]
        for target in targets:
            try:
                kv.validate(target, kv.latest_version(), strict=True)
            except kv.ValidationError as err:
                errors.append(f"{target['kind']}/{target['metadata'].get('name')}: {err.message} at "
                              f"{'.'.join(map(str, err.path))}")
    return errors


@pytest.mark.parametrize("path", sorted(K8S.glob("*.yaml")), ids=lambda p: p.name)
def test_manifest_matches_the_kubernetes_schema(path):
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert docs and not _schema_errors(docs), _schema_errors(docs)


@pytest.mark.parametrize("breakage", ["memory limit not a quantity", "unknown field"])
def test_schema_validation_fails_a_broken_manifest(breakage):
    docs = [doc for doc in yaml.safe_load_all(INDEXED.read_text()) if doc]
    job = next(d for d in docs if d["kind"] == "Job")
    assert not _schema_errors(docs)
    if breakage == "unknown field":
        job["spec"]["completionsTypo"] = 2
    else:
        job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] = ["256Gi"]
    (error,) = _schema_errors(docs)
    assert error.startswith("Job/stackproof-validate:"), error
