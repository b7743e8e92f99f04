"""Extend-first scheduling (router.extend_first): the priority vLLM's priority scheduler runs
a request by (lower first; ties in arrival order), in microseconds:

    priority = sent + extend_first × uncached_tokens × prefill_s_per_token

i.e. when the request was sent plus a multiple of its predicted prefill time (the router's
fitted prefill rate, so the setting means the same on any hardware). A deadline, not a
class: a turn that extends a cached history (few uncached tokens) goes ahead of the cold
prefills queued before it, but only of those sent less than extend_first × (their prefill
time − its own) earlier. However busy the engine, a long prompt therefore waits at most
extend_first × its own prefill time longer than first-come-first-served would make it wait;
shortest-first would starve it. The wall clock, not a process's monotonic one, so that the
priorities of several routers on one engine compare.
"""

from __future__ import annotations


def extend_first(sent_s: float, uncached_tokens: int, prefill_s_per_token: float,
                 factor: float) -> int:
    """The priority of a request sent at `sent_s` (time.time()) that leaves
    `uncached_tokens` of its prompt for the engine to compute."""
    allowance = factor * max(0, uncached_tokens) * prefill_s_per_token
    return int((sent_s + allowance) * 1e6)
