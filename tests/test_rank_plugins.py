"""A rank loads only the suite's own pytest plugins: one installed beside it (an entry point, as hypothesis, anyio,
xdist or pytest-benchmark install theirs in an ML image) is not loaded, and cost the H200's healthcheck 0.8 s at
the ranks' start and 1.2 s at their end; a person names one to load it (`-- -p NAME`), and a plugin given by
PYTEST_PLUGINS (the fault plugins) still loads. The plugin here is a real installed distribution on the ranks'
path, found through its entry point exactly as pytest finds any."""

import sys
from pathlib import Path

from test_validate_cpu import EXIT_OK, validate

REPO = Path(__file__).parent.parent
PLUGIN = '''
import os, pathlib
def pytest_configure(config):
    folder = pathlib.Path(os.environ["LOADED_INTO"])
    folder.mkdir(exist_ok=True)
    (folder / f"{os.getpid()}").write_text("loaded")
'''


def installed_plugin(site: Path) -> None:
    """A distribution `noisy` in `site`, registering the pytest plugin noisy_plugin through its entry point."""
    info = site / "noisy-1.0.dist-info"
    info.mkdir(parents=True)
    (site / "noisy_plugin.py").write_text(PLUGIN)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: noisy\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pytest11]\nnoisy = noisy_plugin\n")
    (info / "RECORD").write_text("")


def run(tmp_path: Path, *args: str):
    """A two-rank CPU run with the distribution on the ranks' path; the ranks' pids that loaded the plugin."""
    site = tmp_path / "site"
    if not site.exists():
        installed_plugin(site)
    work = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    work.mkdir()
    path = ":".join([str(site), str(REPO), *sys.path])
    proc, report = validate(work, "--nproc", "2", "-k", "dev_shm", *args,
                            env_extra={"PYTHONPATH": path, "LOADED_INTO": str(work / "loaded")})
    return proc, report, sorted((work / "loaded").glob("*"))


def test_a_plugin_installed_beside_the_suite_stays_out_of_the_ranks_unless_named(tmp_path):
    import importlib.metadata

    installed_plugin(tmp_path / "probe")  # the entry point is real: pytest's own lookup finds it on the path
    found = importlib.metadata.distributions(path=[str(tmp_path / "probe")])
    assert [e.value for d in found for e in d.entry_points if e.group == "pytest11"] == ["noisy_plugin"]

    proc, report, loaded = run(tmp_path)
    assert proc.returncode == EXIT_OK, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["verdict"] == "OK"
    assert loaded == [], "an installed plugin ran in a rank without being named"

    proc, report, loaded = run(tmp_path, "--", "-p", "noisy_plugin")
    assert proc.returncode == EXIT_OK, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(loaded) == 2, f"named with -p, the plugin loads on both ranks: {loaded}"
