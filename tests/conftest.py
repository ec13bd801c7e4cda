# Fixtures for the real-Docker tests (docker_engine, built): see image_support.py.
import pytest
from image_support import built, docker_engine  # noqa: F401

# The suite runs on two pytest-xdist workers (pyproject.toml's addopts; CI's machine has two cores, and a third of
# the suite's time is spent waiting on Slurm, Docker and the ranks' sockets). The tests that share one real
# resource run on one worker, one after another: the Slurm cluster's nodes, the Docker engine's images and
# containers (built once per worker), the network namespaces.
SHARED = {"slurm": "slurm", "docker": "docker", "registry": "docker", "lab": "docker"}
SHARED_BY_FIXTURE = {"built": "docker", "docker_engine": "docker"}
SHARED_BY_FILE = {"test_netns.py": "netns"}


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups off the items
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        groups = {SHARED[mark.name] for mark in item.iter_markers() if mark.name in SHARED}
        groups |= {SHARED_BY_FIXTURE[name] for name in getattr(item, "fixturenames", ()) if name in SHARED_BY_FIXTURE}
        groups |= {SHARED_BY_FILE[item.path.name]} if item.path.name in SHARED_BY_FILE else set()
        if len(groups) > 1:
            raise pytest.UsageError(f"{item.nodeid}: shares {sorted(groups)}; one group per test (tests/conftest.py)")
        for group in groups:
            item.add_marker(pytest.mark.xdist_group(group))
