"""Judgement: pure functions from what was measured (recorded readings, figures) to findings and verdicts.

The layout is the architecture, run -> measure -> judge -> act:
  - run:     stackproof/run/ (launcher, agent, ranks, plugin) starts the checks and gathers what they found;
  - measure: smoke_tests/ and stackproof/measure/ read NVML and sysfs, time copies and collectives, and hand
             over figures and readings; they decide nothing;
  - judge:   this package. Every bar, expectation, health rule, spec, baseline and verdict lives here, as a pure
             function of recorded values, unit-tested without torch or a GPU;
  - act:     stackproof/act/ turns a verdict into a drain, a taint, a report or an alert, through the policy table;
  - report:  stackproof/report/ holds the run record (record.py) and renders it (report.json, junit, .prom, HTML).

The shared vocabulary is `findings.Finding`: what was expected, what was found, where (node, GPU), a category and
a severity, and the fix.
"""
