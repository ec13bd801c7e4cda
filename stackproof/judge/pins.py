"""The image's pins at runtime: what torch loaded and what is installed, against what the image promised (its
expected versions, its lock) and where each native library must come from. Pure: the readings of
stackproof/measure/pins.py in, software-pins findings out (the image, not the machine, is to blame)."""

from __future__ import annotations

from collections.abc import Mapping

from packaging.version import InvalidVersion, Version

from stackproof.judge.findings import Finding
from stackproof.judge.software import REBUILD, pins

# How many release fields the runtime can tell: CUDA and Python are major.minor, cuDNN's 4th field is not
# visible at runtime; the rest compare whole (torch's '+cu130' local part aside).
_RELEASE_FIELDS = {"cuda": 2, "python": 2, "cudnn": 3}
SHADOWED = "a system library shadowing torch's? check LD_LIBRARY_PATH; else " + REBUILD
LOCK_DRIFT = "the environment drifted from the lock: rebuild the image, or pip install --require-hashes -r lock"
SHOWN = 10  # drifted packages named in the finding


def same_version(component: str, expected: str, found: str | None) -> bool:
    """Compare as far as the runtime can tell, as versions (packaging), not as strings: '2.8' == '2.8.0'."""
    if found is None:
        return False
    try:
        want, have = Version(expected), Version(found)
    except InvalidVersion:
        return expected.split("+")[0] == found.split("+")[0]
    fields = _RELEASE_FIELDS.get(component)
    if fields:
        return _padded(want.release, fields) == _padded(have.release, fields)
    return Version(want.public) == Version(have.public)


def _padded(release: tuple[int, ...], fields: int) -> tuple[int, ...]:
    return (release + (0,) * fields)[:fields]


def versions(promised: Mapping[str, str], source: str, running: Mapping[str, str | None],
             libraries: Mapping[str, str]) -> list[Finding]:
    """A finding per component whose running version is not the promised one (with the library it came from)."""
    return [pins(component, f"{version} ({source})",
                 (running.get(component) or "none") + (f" loaded from {libraries[component]}"
                                                       if component in libraries else ""), SHADOWED)
            for component, version in promised.items() if not same_version(component, version, running.get(component))]


def from_its_wheel(library: str, wheel: str, wheel_version: str, running: str | None, path: str | None
                   ) -> list[Finding]:
    """The NCCL/cuDNN torch runs must be the pip wheel torch was built against, not one found on LD_LIBRARY_PATH
    (pytorch#122571)."""
    expected = f"lib{library} {wheel_version} from the {wheel} wheel"
    fix = f"unset LD_LIBRARY_PATH entries that hold another lib{library}, or pin the system package to {wheel_version}"
    if not path:
        return [pins(library, expected, f"lib{library} not loaded by torch at all", fix)]
    if same_version(library, wheel_version, running) and "site-packages" in path:
        return []
    return [pins(library, expected, f"{running} loaded from {path}", fix)]


def lock_drift(locked: Mapping[str, str], installed: Mapping[str, str], lock: str) -> list[Finding]:
    """One finding when installed packages differ from the image's lock, naming the first SHOWN."""
    wrong = [f"{name}: lock {version}, installed {installed.get(name, 'none')}"
             for name, version in locked.items() if installed.get(name) != version]
    if not wrong:
        return []
    return [pins("installed packages", f"the {len(locked)} versions of {lock}",
                 f"{len(wrong)} package(s) differ: " + "; ".join(wrong[:SHOWN]), LOCK_DRIFT)]


def system_nccl(version: str, path: str, torch_nccl: str | None) -> list[Finding]:
    """In the devel flavor the system NCCL (what a user's own build links) must equal torch's."""
    if version == torch_nccl:
        return []
    return [pins("system NCCL", f"torch's NCCL {torch_nccl}", f"{version} ({path})",
                 "apt-get install libnccl2=<torch's NCCL>-1+cuda<CUDA> libnccl-dev=... and apt-mark hold them")]
