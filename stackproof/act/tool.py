"""The error of a scheduler's tool (scontrol, kubectl) that failed: stackproof.tools.run_tool raises it."""

from __future__ import annotations

from stackproof.errors import ConfigError


class ActError(ConfigError):
    """The action itself failed (tool missing, refused, timed out): the node was NOT acted on. Exit 2, as bad
    input: the settings or the permissions of the machine running stackproof need a fix, not the node."""
