"""Acting on a verdict: drain a Slurm node, label and taint a Kubernetes node. A third role beside images/ (build)
and suite/ (validate): it reads a finished run's report.json (docs/report-format.md); healthcheck runs validate first.

decide.py: the policy (which outcomes act, on which nodes, with which reason); config.py: the settings and their
flags; slurm.py and kubernetes.py: the commands of the schedulers' own tools (scontrol, kubectl); tool.py: running
them; run.py: `stackproof act` and `stackproof healthcheck` (validate this node, then act)."""
