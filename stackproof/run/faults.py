"""Faults injected on purpose (--inject-fault) to prove the suite turns red when a rank goes wrong."""

from __future__ import annotations

import os
import time

from stackproof.run.config import ValidateConfig

# A slowed pair moves its data this many more times in each exchange, and a slowed rank sleeps this many times
# the time its own work took: 10x slower in all, far past any tolerance, and the same factor on a laptop's loopback
# as on InfiniBand. Repeating the transfer (not sleeping a multiple of one early exchange) keeps the pair 10x
# slower under whatever load the host has at that moment: a sleep sized on a calm exchange was under 3x a pair
# measured during a burst of background load, and the slow node passed (issue 36 item 15).
SLOW_DOWN = 9


def active(settings: ValidateConfig, fault: str, rank: int) -> bool:
    return settings.inject_fault == fault and rank == settings.fault_rank


def stop_if_asked(settings: ValidateConfig, rank: int) -> None:
    """A rank that stops answering (hang) or dies (crash): the others must not wait forever, and the run's
    error must name it."""
    if active(settings, "hang", rank):
        time.sleep(settings.run_timeout * 2)
    if active(settings, "crash", rank):
        os._exit(13)


def pair_slow_down(settings: ValidateConfig, env, peer: int) -> int:
    """How many more times this rank and `peer` move their data in each exchange (slow-node, slow-link); 0 when
    not faulted. The same on both ends of the pair (each end posts every transfer). Ranks are laid out node by
    node (rank = node x local world + local rank; the pairwise check verifies it)."""
    per_node, fault = env.local_world_size, settings.fault_rank
    if settings.inject_fault == "slow-node":
        return SLOW_DOWN if fault // per_node in (env.node_rank, peer // per_node) else 0
    if settings.inject_fault == "slow-link":
        if env.num_nodes > 1:
            ends = {fault // per_node, (fault // per_node + 1) % env.num_nodes}
            return SLOW_DOWN if {env.node_rank, peer // per_node} == ends else 0
        ends = {fault % per_node, (fault % per_node + 1) % per_node}
        return SLOW_DOWN if {env.local_rank, peer % per_node} == ends else 0
    return 0


def work_slow_down(settings: ValidateConfig, env) -> float:
    """How much this rank stretches its own timed work (slow-node: every rank on the fault rank's node)."""
    if settings.inject_fault == "slow-node" and env.node_rank == settings.fault_rank // env.local_world_size:
        return SLOW_DOWN
    return 0.0
