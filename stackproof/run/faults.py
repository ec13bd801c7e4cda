"""Faults injected on purpose (--inject-fault) to prove the suite turns red when a rank goes wrong."""

from __future__ import annotations

import os
import time

from stackproof.run.config import ValidateConfig

# A slowed rank sleeps this many times the time its own send (or work) took: 10x slower in all, far past any
# tolerance and a shared host's noise, and the same factor on a laptop's loopback as on InfiniBand.
SLOW_DOWN = 9.0


def active(settings: ValidateConfig, fault: str, rank: int) -> bool:
    return settings.inject_fault == fault and rank == settings.fault_rank


def stop_if_asked(settings: ValidateConfig, rank: int) -> None:
    """A rank that stops answering (hang) or dies (crash): the others must not wait forever, and the run's
    error must name it."""
    if active(settings, "hang", rank):
        time.sleep(settings.run_timeout * 2)
    if active(settings, "crash", rank):
        os._exit(13)


def send_slow_down(settings: ValidateConfig, env, peer: int) -> float:
    """How much this rank holds back each send to `peer` (slow-node, slow-link); 0.0 when not faulted. Ranks are
    laid out node by node (rank = node x local world + local rank; the pairwise check verifies it)."""
    per_node, fault = env.local_world_size, settings.fault_rank
    if settings.inject_fault == "slow-node":
        return SLOW_DOWN if env.node_rank == fault // per_node else 0.0
    if settings.inject_fault == "slow-link":
        if env.num_nodes > 1:
            ends = {fault // per_node, (fault // per_node + 1) % env.num_nodes}
            return SLOW_DOWN if {env.node_rank, peer // per_node} == ends else 0.0
        ends = {fault % per_node, (fault % per_node + 1) % per_node}
        return SLOW_DOWN if {env.local_rank, peer % per_node} == ends else 0.0
    return 0.0


def work_slow_down(settings: ValidateConfig, env) -> float:
    """How much this rank stretches its own timed work (slow-node: every rank on the fault rank's node)."""
    if settings.inject_fault == "slow-node" and env.node_rank == settings.fault_rank // env.local_world_size:
        return SLOW_DOWN
    return 0.0
