"""Benchmarks a user runs on their machines (`stackproof bench ...`): figures, not verdicts."""
