"""No registry, index or mirror host is written in the repository: the package index comes from pip's own
configuration and the Debian/Ubuntu archives from the machine's apt sources (or a variable naming them)."""

from __future__ import annotations

import os
import shutil
import subprocess
import urllib.parse
from pathlib import Path

import pytest

from stackproof.images import index
from stackproof.images.matrix import REPO_ROOT

APT_MIRROR = REPO_ROOT / "scripts" / "ci" / "apt-mirror.sh"


def apt_sources() -> list[tuple[str, str]]:
    """(release, URI) of every index target apt reads from this machine's sources."""
    if not shutil.which("apt-get"):
        return []
    out = subprocess.run(["apt-get", "indextargets", "--format", "$(RELEASE) $(REPO_URI)"], capture_output=True,
                         text=True, timeout=60).stdout
    return sorted({tuple(line.split(" ", 1)) for line in out.splitlines() if " " in line})


def os_release() -> dict[str, str]:
    text = Path("/etc/os-release").read_text() if Path("/etc/os-release").exists() else ""
    return dict((k, v.strip('"')) for k, _, v in (line.partition("=") for line in text.splitlines()) if k)


def test_no_index_or_mirror_host_of_this_machine_is_written_in_the_repository():
    hosts = {urllib.parse.urlsplit(url).hostname for url in index.pip_index_urls()}
    hosts |= {urllib.parse.urlsplit(uri).hostname for _, uri in apt_sources()}
    hosts.discard(None)
    hosts.discard("")
    assert hosts, "neither pip nor apt names an index host here: nothing to look for"
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    found = []
    for name in tracked:
        if name.startswith("images/locks/"):
            continue
        path = REPO_ROOT / name
        # sysfs fixtures hold symlinks (some to folders): a link's text is its target
        text = os.readlink(path) if path.is_symlink() else path.read_text(errors="replace")
        found += [f"{name}: {host}" for host in hosts if host in text]
    assert not found, found


def run_mirror(distro: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.endswith("_MIRROR")}
    return subprocess.run([str(APT_MIRROR), distro], capture_output=True, text=True, timeout=60,
                          env={**clean, **env})


def test_a_mirror_variable_wins():
    proc = run_mirror("ubuntu", UBUNTU_MIRROR="http://mirror.invalid/ubuntu/")
    assert proc.returncode == 0 and proc.stdout == "http://mirror.invalid/ubuntu\n", proc.stderr


def test_the_machines_own_archive_is_found_in_its_apt_sources():
    release = os_release()
    if release.get("ID") not in ("debian", "ubuntu"):
        pytest.skip("not a Debian or Ubuntu machine")
    expected = next((uri for suite, uri in apt_sources() if suite == release.get("VERSION_CODENAME")), None)
    if expected is None:
        pytest.skip(f"the apt sources here serve no {release.get('VERSION_CODENAME')} release")
    proc = run_mirror(release["ID"])
    assert proc.returncode == 0 and proc.stdout == expected.rstrip("/") + "\n", proc.stderr


def test_another_distros_archive_must_be_named():
    other = "ubuntu" if os_release().get("ID") != "ubuntu" else "debian"
    proc = run_mirror(other)
    assert proc.returncode == 1
    assert f"expected {other.upper()}_MIRROR" in proc.stderr
    assert f"fix: set {other.upper()}_MIRROR=" in proc.stderr
