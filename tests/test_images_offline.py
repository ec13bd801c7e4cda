"""`make check OFFLINE=1` says what it compared and what it did not (issue 20, item 19): without cached index data
it printed the same success line as with it."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def check_offline(cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stackproof", "images", "check", "--offline", "current"],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "XDG_CACHE_HOME": str(cache)})


def test_an_offline_check_without_cached_index_data_says_no_hash_was_compared(tmp_path):
    proc = check_offline(tmp_path / "empty-cache")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "# 1 image(s) agree with their locks: current"
    said = lines[1]
    assert said.startswith("# offline: matrix vs locks compared; torch's wheel metadata not read; the hashes of 0 of ")
    total = int(said.split(" of ")[2].split()[0])
    assert f"{total} not compared (no cached answer of the index: run `make check` online once)" in said


def test_cached_index_data_is_counted_as_compared(tmp_path):
    """One pin's cached answer (as an online check leaves it) makes it compared, and its hash is checked."""
    from stackproof.images import index, locks
    from stackproof.images.matrix import load_matrix

    image = load_matrix().get("current")
    entry = next(e for e in locks.parse_lock(image.lock_path)[1] if e.version and e.hashes)
    cache = tmp_path / "cache"
    files = {f"f{i}.whl": digest.removeprefix("sha256:") for i, digest in enumerate(entry.hashes)}
    script = (f"from stackproof.images import index; import json; p = index._cache_path({index.pip_index_urls()[0]!r}, "
              f"{entry.name!r}, {entry.version!r}); p.parent.mkdir(parents=True); "
              f"p.write_text(json.dumps({files!r}))")
    subprocess.run([sys.executable, "-c", script], check=True, env={**os.environ, "XDG_CACHE_HOME": str(cache)})
    proc = check_offline(cache)
    assert proc.returncode == 0, proc.stderr
    assert "the hashes of 1 of " in proc.stdout.splitlines()[1]
