"""Routing targets: what the routing core chooses among.

A target is a KV cache with a scheduler in front of it. An engine replica is one, unless its
engine runs data-parallel ranks inside itself (parallelism.dp_attention, engine_dp_size):
each rank then has its own scheduler and its own KV cache, and a conversation's history is
on one rank only, so each rank is a target of its own, named after its replica. The server
side maps a target back to the replica it calls and the rank it asks vLLM for.
"""

from __future__ import annotations

RANK_MARK = "@dp"
"""Between a replica's name and a rank in a target's name (Serve's replica ids contain no
`@`)."""


def targets(replica: str, ranks: int) -> list[str]:
    """The targets of `replica` when the router routes to each of its `ranks` DP ranks (one,
    the replica itself, when it has one rank)."""
    if ranks <= 1:
        return [replica]
    return [f"{replica}{RANK_MARK}{r}" for r in range(ranks)]


def split(target: str) -> tuple[str, int | None]:
    """(replica, DP rank) of a target; the rank is None for a whole replica (vLLM picks)."""
    replica, mark, rank = target.rpartition(RANK_MARK)
    if mark and rank.isdigit():
        return replica, int(rank)
    return target, None


def replica_of(target: str) -> str:
    return split(target)[0]
