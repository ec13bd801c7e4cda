# Fixtures for the real-Docker tests (docker_engine, built): see image_support.py.
from image_support import built, docker_engine  # noqa: F401
