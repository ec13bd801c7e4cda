"""The lab flavor for real: `make build` of the lab image built on the default image, then the container itself:
non-root, JupyterLab of the matrix, its lock installed as is and on top of every layer of the validation image,
no server without a token, the server's API answers with the token and refuses without it, and a notebook (torch,
a tensor op, the validation suite's CPU checks from Python) runs inside it. Beside JupyterLab, sshd from a mounted
authorized_keys: a generated key logs in and imports torch; another key, a password and root are refused.

Needs a Docker engine with buildx and the default image's base; skips without them (fails when
STACKPROOF_REQUIRE_DOCKER=1, as in CI).
"""

from __future__ import annotations

import json
import os
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
def keys(tmp_path_factory) -> Path:
    """Two generated ssh keys, 'allowed' (in authorized_keys) and 'other' (not)."""
    if shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        message = "no ssh client on PATH (fix: apt-get install -y openssh-client)"
        if os.environ.get("STACKPROOF_REQUIRE_DOCKER") == "1":
            pytest.fail(f"STACKPROOF_REQUIRE_DOCKER=1 but {message}")
        pytest.skip(message)
    folder = tmp_path_factory.mktemp("ssh")
    folder.chmod(0o755)  # the lab (uid 1000) reads authorized_keys through it
    for name in ("allowed", "other"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(folder / name)],
                       check=True, timeout=30)
    (folder / "authorized_keys").write_text((folder / "allowed.pub").read_text())
    (folder / "authorized_keys").chmod(0o644)
    return folder


@pytest.fixture(scope="module")
def server(lab_built, keys, tmp_path_factory):
    """The lab container as make lab starts it (minus GPUs), a workspace and an authorized_keys mounted; yields
    (url, token, workspace, name, ssh_port)."""
    workspace = tmp_path_factory.mktemp("workspace")
    workspace.chmod(0o777)  # the lab runs as uid 1000
    token = uuid.uuid4().hex
    name = f"stackproof-test-lab-{token[:8]}"
    started = subprocess.run(["docker", "run", "--detach", "--rm", "--name", name, "--ipc=host",
                              "-e", f"JUPYTER_TOKEN={token}", "-e", "NVIDIA_VISIBLE_DEVICES=void",
                              "-p", "127.0.0.1::8888", "-p", "127.0.0.1::2222",
                              "-v", f"{keys / 'authorized_keys'}:/etc/stackproof/ssh/authorized_keys:ro",
                              "-v", f"{workspace}:/home/stackproof/work", lab_built],
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
        ssh_port = subprocess.check_output(["docker", "port", name, "2222/tcp"], text=True, timeout=30) \
            .splitlines()[0].rsplit(":", 1)[1]
        yield {"url": url, "token": token, "workspace": workspace, "name": name, "ssh_port": ssh_port}
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
    proc = run(lab_built, "sh", "-c", "id -u; jupyter lab --version; ls /etc/ssh | grep -c '^ssh_host_' || true")
    assert proc.returncode == 0, proc.stderr
    uid, version, host_keys = proc.stdout.split()
    assert uid == "1000"
    assert version == LAB.jupyterlab
    assert host_keys == "0", "the image ships ssh host keys: every container would share them"


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


def ssh(server, keys, *options: str, user: str = "stackproof", key: str | None = "allowed",
        command: str = "true", env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The ssh client against the lab's sshd, without a terminal (a password only through SSH_ASKPASS)."""
    identity = ["-i", str(keys / key), "-o", "IdentitiesOnly=yes"] if key else []
    return subprocess.run(["ssh", "-p", server["ssh_port"], "-o", "StrictHostKeyChecking=no", "-o",
                           "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=20", *identity, *options,
                           f"{user}@127.0.0.1", command], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL, env=env, start_new_session=True)


def test_ssh_with_the_mounted_key_logs_in_and_imports_torch(server, keys):
    proc = ssh(server, keys, "-o", "BatchMode=yes",
               command='python -c "import torch; print(torch.__version__)"; id -un')
    assert proc.returncode == 0, proc.stderr
    version, user = proc.stdout.split()
    assert version.split("+")[0] == LAB.torch and user == "stackproof"


def test_ssh_refuses_another_key_root_and_a_password(server, keys, tmp_path):
    other = ssh(server, keys, "-o", "BatchMode=yes", key="other")
    assert other.returncode == 255 and "Permission denied (publickey)" in other.stderr, other.stderr
    root = ssh(server, keys, "-o", "BatchMode=yes", user="root")
    assert root.returncode == 255 and "Permission denied (publickey)" in root.stderr, root.stderr
    # A client that offers a password (through SSH_ASKPASS): the server lists only publickey, so none is asked for.
    asked = tmp_path / "asked"
    askpass = tmp_path / "askpass"
    askpass.write_text(f"#!/bin/sh\ntouch {asked}\necho not-a-key\n")
    askpass.chmod(0o755)
    env = {**os.environ, "SSH_ASKPASS": str(askpass), "SSH_ASKPASS_REQUIRE": "force", "DISPLAY": ":0"}
    password = ssh(server, keys, "-o", "PubkeyAuthentication=no", "-o", "NumberOfPasswordPrompts=1", "-o",
                   "PreferredAuthentications=password,keyboard-interactive", key=None, env=env)
    assert password.returncode == 255 and "Permission denied (publickey)." in password.stderr, password.stderr
    assert not asked.exists(), "the server asked for a password"
