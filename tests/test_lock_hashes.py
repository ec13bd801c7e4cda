"""A corrupted lock fails `make check` with exit 2, naming the package, the file and the fix: online against the
hashes the index pip is configured with publishes, offline on form and consistency (and against what that index
answered earlier, cached on disk)."""

from __future__ import annotations

import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from stackproof.images import index, locks
from stackproof.images.matrix import REPO_ROOT

LOCK = "images/locks/current.txt"


def repo_copy(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(REPO_ROOT / "Makefile", repo)
    for part in ("images", "stackproof"):
        shutil.copytree(REPO_ROOT / part, repo / part, ignore=shutil.ignore_patterns("__pycache__"))
    return repo


def change_first_hash(lock: Path, new_char: str) -> tuple[int, str]:
    """Change the last character of the lock's first hash; (line number, the changed hash)."""
    lines = lock.read_text().splitlines(keepends=True)
    number = next(i for i, line in enumerate(lines) if "--hash=sha256:" in line)
    old = re.search(r"sha256:([0-9a-f]{64})", lines[number]).group(1)
    new = old[:-1] + (new_char if new_char != old[-1] else "0")
    lines[number] = lines[number].replace(old, new)
    lock.write_text("".join(lines))
    return number + 1, new


def make_check(repo: Path, cache: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "check", f"PYTHON={sys.executable}", "IMAGE=current", *args], cwd=repo,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "XDG_CACHE_HOME": str(cache)})


def test_a_malformed_hash_fails_offline_naming_package_file_and_fix(tmp_path):
    repo = repo_copy(tmp_path)
    line, bad = change_first_hash(repo / LOCK, "g")
    proc = make_check(repo, tmp_path / "cache", "OFFLINE=1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (f"{LOCK} line {line}: cuda-bindings==13.5.0: --hash=sha256:{bad}: expected sha256:<64 hex digits>; "
            "fix: make lock") in proc.stderr


@pytest.mark.network
def test_a_changed_hash_fails_online_and_then_offline_from_the_cached_answers(tmp_path):
    repo = repo_copy(tmp_path)
    cache = tmp_path / "cache"
    assert make_check(repo, cache, "OFFLINE=1").returncode == 0
    line, bad = change_first_hash(repo / LOCK, "f")
    proc = make_check(repo, cache)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    message = f"{LOCK} line {line}: cuda-bindings==13.5.0: --hash=sha256:{bad} is not the hash of any of its"
    assert message in proc.stderr and "fix: make lock" in proc.stderr
    offline = make_check(repo, cache, "OFFLINE=1")  # the index's answers are cached now
    assert offline.returncode == 2 and message in offline.stderr, offline.stderr


BAD_LOCKS = [
    ("pytest==9.2.0 \\\n", "pytest>=9 \\\n", "pytest: not pinned with == (found '>=9')"),
    ("pytest==9.2.0 \\\n    --hash", "pytest==9.2.0\n    --hash", "pytest==9.2.0 has no --hash"),
    ("sha256:", "md5:", "expected sha256:<64 hex digits>"),
]


@pytest.mark.parametrize(("old", "new", "message"), BAD_LOCKS, ids=["unpinned", "no-hash", "algorithm"])
def test_an_inconsistent_lock_is_named_offline(tmp_path, old, new, message):
    lock = tmp_path / "validation.txt"
    text = (REPO_ROOT / "images/locks/validation.txt").read_text()
    assert old in text
    lock.write_text(text.replace(old, new, 1))
    problems = locks.lock_problems(lock, locks.parse_lock(lock)[1])
    assert any(message in p and p.endswith("fix: make lock") for p in problems), problems


def test_one_hash_listed_for_two_packages_is_named(tmp_path):
    lock = tmp_path / "validation.txt"
    text = (REPO_ROOT / "images/locks/validation.txt").read_text()
    _, entries = locks.parse_lock(REPO_ROOT / "images/locks/validation.txt")
    first, second = entries[0], entries[1]
    lock.write_text(text.replace(second.hashes[0], first.hashes[0]))
    problems = locks.lock_problems(lock, locks.parse_lock(lock)[1])
    assert any(f"is also listed for {first.name}=={first.version}" in p for p in problems), problems


def test_committed_locks_are_well_formed():
    for lock in sorted((REPO_ROOT / "images" / "locks").glob("*.txt")):
        assert locks.lock_problems(lock, locks.parse_lock(lock)[1]) == []


@pytest.fixture
def simple_index(tmp_path):
    """A real PEP 503 index (HTML pages served over HTTP) publishing the files of images/locks/validation.txt,
    except one hash of pytest; yields (its URL, the hash it does not publish)."""
    _, entries = locks.parse_lock(REPO_ROOT / "images/locks/validation.txt")
    root = tmp_path / "index"
    missing = next(e for e in entries if e.name == "pytest").hashes[-1]
    for entry in entries:
        wheel = f"{entry.name.replace('-', '_')}-{entry.version}-{{}}-py3-none-any.whl"
        links = [f'<a href="../../files/{wheel.format(i)}#{digest.replace(":", "=")}">{wheel.format(i)}</a>'
                 for i, digest in enumerate(entry.hashes) if digest != missing]
        (root / "simple" / entry.name).mkdir(parents=True)
        (root / "simple" / entry.name / "index.html").write_text("<html><body>" + "\n".join(links) + "</body></html>")
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(root))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/simple", missing
    finally:
        server.shutdown()


def test_hashes_are_checked_against_the_index_pip_is_configured_with(simple_index, tmp_path, monkeypatch):
    url, missing = simple_index
    monkeypatch.setenv("PIP_INDEX_URL", url)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # this machine's pip.conf may add extra indexes
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.setattr(index, "CACHE_DIR", tmp_path / "cache")
    index.pip_index_urls.cache_clear()
    try:
        assert index.pip_index_urls() == (url,)
        problems = locks.check_lock_hashes(REPO_ROOT / "images/locks/validation.txt")
    finally:
        index.pip_index_urls.cache_clear()
    assert len(problems) == 1, problems
    assert problems[0].startswith("images/locks/validation.txt line ")
    assert f"pytest==9.2.0: --hash={missing} is not the hash of any of its" in problems[0]
    assert url in problems[0] and problems[0].endswith("fix: make lock")
