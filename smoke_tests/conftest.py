# The plugin makes one verdict out of one pytest session per rank; fixtures: dist_env, settings, report.
pytest_plugins = ["stackproof.run.plugin"]
