# Fixtures for the real-Docker tests (docker_engine, built): see image_support.py.
import pytest
from image_support import built, docker_engine  # noqa: F401

# The suite runs on two pytest-xdist workers (pyproject.toml's addopts; CI's machine has two cores, and 40 % of the
# suite's time the cores wait on Slurm, Docker and the ranks' sockets). The files whose tests share one real
# resource run on one worker, one test after another: the Slurm clusters' nodes, the Docker engine's images and
# containers (the image is built once, by that worker), the network namespaces. Grouped by file, as the
# controller sees only node ids (xdist's own xdist_group marks rename node ids, which pytest 9 ignores).
SHARED_FILES = {
    "slurm": ("test_act_resume_slurm.py", "test_act_slurm.py", "test_burn_slurm.py", "test_launchers_slurm.py",
              "test_localize_slurm.py"),
    "docker": ("test_attest.py", "test_attest_errors.py", "test_image_build.py", "test_image_sbom.py",
               "test_image_secrets.py", "test_image_validates.py", "test_lab.py", "test_registry.py"),
    "netns": ("test_netns.py",),
}
GROUP_OF_FILE = {name: group for group, names in SHARED_FILES.items() for name in names}
# What marks or fixtures say a test shares: its file must be in that group.
GROUP_OF_MARK = {"slurm": "slurm", "docker": "docker", "registry": "docker", "lab": "docker"}
GROUP_OF_FIXTURE = {"built": "docker", "docker_engine": "docker"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        shares = {GROUP_OF_MARK[mark.name] for mark in item.iter_markers() if mark.name in GROUP_OF_MARK}
        shares |= {GROUP_OF_FIXTURE[f] for f in getattr(item, "fixturenames", ()) if f in GROUP_OF_FIXTURE}
        stray = shares - {GROUP_OF_FILE.get(item.path.name)}
        if stray:
            raise pytest.UsageError(f"{item.nodeid} uses the shared {sorted(stray)} but its file is in no such group "
                                    "of tests/conftest.py's SHARED_FILES; fix: add the file there")


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    class SharedResourceScheduling(LoadScopeScheduling):
        """A group's files are one unit of work, sent to one worker; every other test is a unit of its own."""

        def _split_scope(self, nodeid: str) -> str:
            return GROUP_OF_FILE.get(nodeid.split("::", 1)[0].rsplit("/", 1)[-1], nodeid)

    return SharedResourceScheduling(config, log)
