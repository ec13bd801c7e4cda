"""Pins at runtime: what torch really loaded, compared with what the image promised."""

from pathlib import Path

import pytest

from stackproof import environment
from stackproof.judge import pins as rules
from stackproof.judge.findings import Judged
from stackproof.judge.promise import FULL, Needs
from stackproof.measure import pins

# Held where something declares the versions (a stackproof image's /etc/stackproof, --image, --expect-file).
pytestmark = pytest.mark.check(FULL, Needs(),
                               optional="nothing declares the versions outside a stackproof image")

WHEEL_LIBRARIES = [("nccl", "nvidia-nccl-cu"), ("cudnn", "nvidia-cudnn-cu")]


@pytest.fixture(scope="module")
def promise(settings):
    return pins.expected(settings.expect_file, settings.image, environment.current(), settings.expect_declared)


@pytest.fixture(scope="module")
def running():
    versions = pins.runtime_versions()  # loads cuDNN, so read the maps after
    return versions, pins.loaded_libraries()


def test_versions_match_the_promise(promise, running, report):
    versions, libraries = running
    for component, value in versions.items():
        report.figure(component, value or "none")
    report.context("versions", versions)
    report.context("libraries", libraries)
    report.context("expected", {"source": promise.source, **promise.versions})
    if promise.undeclared:
        report.figure("undeclared", ",".join(promise.undeclared))
    if not promise.versions:
        pytest.skip("no expected versions: run inside a stackproof image, or pass --image NAME / --expect-file")
    return Judged(rules.versions(promise.versions, promise.source, versions, libraries), hint=rules.SHADOWED)


@pytest.mark.parametrize(("library", "wheel_prefix"), WHEEL_LIBRARIES, ids=[w[0] for w in WHEEL_LIBRARIES])
def test_native_library_comes_from_its_wheel(library, wheel_prefix, running, report):
    """The NCCL/cuDNN torch runs must be the pip wheel torch was built against, not one found on
    LD_LIBRARY_PATH (pytorch#122571)."""
    versions, libraries = running
    installed = {n: v for n, v in pins.installed_versions().items() if n.startswith(wheel_prefix)}
    if not installed:
        pytest.skip(f"no {wheel_prefix}* wheel installed: this torch takes {library} from the system")
    (wheel, wheel_version), = installed.items()
    path = libraries.get(library)
    report.figure("loaded_from", path or "not loaded")
    return Judged(rules.from_its_wheel(library, wheel, wheel_version, versions.get(library), path))


def test_installed_packages_match_the_lock(promise, report):
    lock = promise.lock
    if not lock or not Path(lock).exists():
        pytest.skip("no lock to compare with (stackproof images carry theirs at /etc/stackproof/lock.txt)")
    locked = pins.locked_versions(Path(lock))
    report.figure("locked_packages", len(locked))
    return Judged(rules.lock_drift(locked, pins.installed_versions(), lock), hint=rules.LOCK_DRIFT)


def test_system_nccl_matches_torch(promise, running, report):
    system = pins.system_nccl()
    if system is None:
        pytest.skip("no system libnccl in the linker cache: nothing can shadow torch's")
    path, version = system
    torch_nccl = running[0]["nccl"]
    report.figure("system_nccl", f"{version} ({path})")
    if promise.flavor != "devel":
        pytest.skip(f"system NCCL {version} present; it must equal torch's only in the devel flavor")
    return Judged(rules.system_nccl(version, path, torch_nccl))
