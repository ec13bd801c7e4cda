"""`pip install .` (not editable) ships the suite itself: stackproof finds it inside the installed package."""

import subprocess
import sys
import zipfile

from stackproof.images.matrix import REPO_ROOT


def test_a_wheel_carries_the_suite_and_finds_it_installed(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"),
                    str(REPO_ROOT)], check=True, timeout=600)
    (wheel,) = (tmp_path / "dist").glob("stackproof-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"stackproof/smoke_tests/conftest.py", "stackproof/smoke_tests/pytest.ini",
            "stackproof/smoke_tests/test_04_collectives.py"} <= set(names)
    # verify-image runs on nodes from the installed package: its judge and the CUE policy cosign runs.
    assert {"stackproof/judge/node_class.py", "stackproof/images/test-result.cue"} <= set(names)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, timeout=600)
    found = subprocess.run([sys.executable, "-c", "from stackproof.run import smoke_tests_dir; "
                            "print(smoke_tests_dir())"], cwd=tmp_path, env={"PYTHONPATH": str(target)},
                           capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    assert found == str((target / "stackproof" / "smoke_tests").resolve())
