# The plugin makes one verdict out of one pytest session per rank; fixtures: dist_env, settings, report.
pytest_plugins = ["stackproof.suite.plugin"]


def pytest_configure(config):
    # TEMP (per-gpu branch): the lead's plugin registers `fast` with --tier fast; until then --strict-markers needs it.
    config.addinivalue_line("markers", "fast: the fast tier (identity, health history, per-GPU checks)")
