"""Acting on a verdict: drain a Slurm node, label and taint a Kubernetes node. A third role beside images/ (build)
and run/ (validate): it reads a finished run's report.json (docs/report-format.md); healthcheck runs validate first.

policy.py: the table, (category, severity) -> drain / alert / report; decide.py: that table applied to a report,
per node, with the reason a person reads; breaker.py: the fleet circuit breaker (--max-drained); config.py: the
settings and their flags; slurm.py and kubernetes.py: the commands of the schedulers' own tools (scontrol, sinfo,
kubectl); hardware.py: what the node itself shows (GPUs on the PCI bus, GPUs in use); tool.py: their error;
resume.py: back in service only by proof (a node stackproof took out is re-proved by its own health check and
returned, kept out or held); history.py: each node's history with stackproof and the lemon rule;
run.py: `stackproof act` and `stackproof healthcheck` (validate this node, then act; the exit-code contract)."""
