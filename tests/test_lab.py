"""The lab flavor for real: `make build` of the lab image built on the default image, then the container itself:
non-root, JupyterLab of the matrix, its lock installed as is and on top of every layer of the validation image,
no server without a token, the server's API answers with the token and refuses without it, and a notebook (torch,
a tensor op, the validation suite's CPU checks from Python) runs inside it.

Needs a Docker engine with buildx and the default image's base; skips without them (fails when
STACKPROOF_REQUIRE_DOCKER=1, as in CI).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from image_support import IMAGE, NAMESPACE, VALIDATION_TAG, make
from packaging.utils import canonicalize_name

from stackproof.images import bake, sbom
from stackproof.images.locks import read_lock
from stackproof.images.matrix import REPO_ROOT, load_matrix

pytestmark = [pytest.mark.lab, pytest.mark.docker]

LAB = bake.lab_for(load_matrix(), IMAGE)
NOTEBOOK = Path(__file__).parent / "fixtures" / "lab-check.ipynb"
START_TIMEOUT_S = 90


def run(*args: str, entrypoint: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = ["docker", "run", "--rm", *(["--entrypoint", entrypoint] if entrypoint is not None else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def lab_built(built) -> str:
    proc = make("build", f"IMAGE={LAB.name}")
    assert proc.returncode == 0, f"make build IMAGE={LAB.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return LAB.tag_in(NAMESPACE)


@pytest.fixture(scope="module")
def server(lab_built, tmp_path_factory):
    """The lab container as make lab starts it (minus GPUs), a workspace mounted; yields (url, token, workspace)."""
    workspace = tmp_path_factory.mktemp("workspace")
    workspace.chmod(0o777)  # the lab runs as uid 1000
    token = uuid.uuid4().hex
    name = f"stackproof-test-lab-{token[:8]}"
    started = subprocess.run(["docker", "run", "--detach", "--rm", "--name", name, "--ipc=host",
                              "-e", f"JUPYTER_TOKEN={token}", "-e", "NVIDIA_VISIBLE_DEVICES=void",
                              "-p", "127.0.0.1::8888", "-v", f"{workspace}:/home/stackproof/work", lab_built],
                             capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    try:
        port = subprocess.check_output(["docker", "port", name, "8888/tcp"], text=True, timeout=30) \
            .splitlines()[0].rsplit(":", 1)[1]
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                status, _ = api(url, "/api/status", token)
                if status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                logs = subprocess.run(["docker", "logs", name], capture_output=True, text=True, timeout=30)
                pytest.fail(f"JupyterLab did not answer on {url} within {START_TIMEOUT_S} s:\n{logs.stderr[-3000:]}")
            time.sleep(1)
        yield {"url": url, "token": token, "workspace": workspace, "name": name}
    finally:
        subprocess.run(["docker", "stop", "--time", "5", name], capture_output=True, timeout=60)


def api(url: str, path: str, token: str | None) -> tuple[int, str]:
    request = urllib.request.Request(url + path, headers={"Authorization": f"token {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def test_the_lab_is_non_root_with_the_matrix_jupyterlab(lab_built):
    proc = run(lab_built, "sh", "-c", "id -u; jupyter lab --version")
    assert proc.returncode == 0, proc.stderr
    uid, version = proc.stdout.split()
    assert uid == "1000"
    assert version == LAB.jupyterlab


def test_the_lab_environment_equals_its_lock_and_its_sbom(lab_built):
    proc = run(lab_built, "sh", "-c", "pip freeze --all; echo ---; cat /etc/stackproof/sbom.cdx.json")
    assert proc.returncode == 0, proc.stderr
    freeze, document = proc.stdout.split("---\n", 1)
    frozen = {canonicalize_name(line.split("==")[0]): line.split("==")[1].split("+")[0]
              for line in freeze.splitlines()}
    frozen.pop("pip")
    _, locked = read_lock(LAB.lock_path)
    assert frozen == locked
    assert sbom.components(json.loads(document)) == locked


def test_the_lab_is_built_on_every_layer_of_the_validation_image(lab_built):
    def layers(tag: str) -> list[str]:
        return json.loads(subprocess.check_output(["docker", "image", "inspect", "--format",
                                                   "{{json .RootFS.Layers}}", tag], text=True))

    below = layers(bake.validation_tag(IMAGE, NAMESPACE) if LAB.parent == IMAGE.name else VALIDATION_TAG)
    lab = layers(lab_built)
    assert lab[: len(below)] == below
    assert len(lab) > len(below)


def test_the_lab_refuses_to_start_without_a_token(lab_built):
    proc = run(lab_built, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "JUPYTER_TOKEN is empty" in proc.stderr and "fix:" in proc.stderr


def test_the_server_answers_with_the_token_and_refuses_without(server):
    status, body = api(server["url"], "/api/status", server["token"])
    assert status == 200 and "started" in json.loads(body)
    for token in (None, "not-the-token"):
        status, _ = api(server["url"], "/api/contents", token)
        assert status == 403, f"/api/contents with token {token!r}: {status}"


def test_a_notebook_runs_inside_the_lab(server):
    shutil.copy(NOTEBOOK, server["workspace"] / NOTEBOOK.name)
    proc = subprocess.run(["docker", "exec", server["name"], "jupyter", "nbconvert", "--to", "notebook", "--execute",
                           "--ExecutePreprocessor.timeout=600", "--output", "executed.ipynb", NOTEBOOK.name],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    executed = json.loads((server["workspace"] / "executed.ipynb").read_text())
    printed = [json.loads(line) for cell in executed["cells"] for output in cell["outputs"]
               if output.get("name") == "stdout" for line in "".join(output["text"]).splitlines()
               if line.startswith("{")]
    facts = {key: value for fact in printed for key, value in fact.items()}
    assert facts["torch"].split("+")[0] == LAB.torch
    assert facts["matmul"] == [[5.0, 14.0], [14.0, 50.0]]
    assert facts["exit_code"] == 0 and facts["verdict"] == "OK"
    assert any(name.startswith("collectives::all_reduce") for name in facts["passed"])


def test_make_lab_passes_the_gpu_flags_the_workspace_and_a_token():
    proc = subprocess.run(["make", "-n", "lab", f"IMAGE={IMAGE.name}", "WORKSPACE=/data/me", "LAB_PORT=9999"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--gpus all" in proc.stdout and "-e JUPYTER_TOKEN" in proc.stdout
    assert '-v "/data/me:/home/stackproof/work"' in proc.stdout and '-p "127.0.0.1:9999:8888"' in proc.stdout
