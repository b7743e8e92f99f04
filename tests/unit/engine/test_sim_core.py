"""The simulated engine's scheduler and prefix cache (rayattn/engine/sim_core.py), stepped
by hand: vLLM's shape of a step (decodes, then prompt chunks within the token budget, a
batch of at most max_num_seqs), cached prefixes that cost nothing, blocks kept after their
request in an LRU, and an event for every block stored or evicted."""

from __future__ import annotations

import pytest

from rayattn.config.schema import SimulatedEngineConfig
from rayattn.engine.sim_core import PrefixCache, SimCore, SimRequest

BS = 4
SIM = SimulatedEngineConfig(step_ms=1.0, prefill_us_per_token=100.0, decode_us_per_seq=10.0,
                      num_blocks=16, max_tokens=2)


def req(keys: list[int], prompt: int, out: int = 2) -> SimRequest:
    return SimRequest(keys, prompt, out, arrived=0.0)


def run(core: SimCore, until_done: list[SimRequest], now: float = 0.0) -> list[float]:
    """Adds those not added yet, then steps until every one is done; the steps' durations."""
    for r in until_done:
        if r not in core.waiting and r.scheduled_at is None:
            core.add(r)
    steps = []
    while not all(r.done for r in until_done):
        step = core.schedule(now)
        assert not step.empty, "nothing to run while requests wait"
        now += step.duration_s
        core.finish(step, now)
        steps.append(step.duration_s)
    return steps


def test_a_prompt_is_prefilled_in_chunks_of_the_step_budget_then_decoded():
    core = SimCore(SIM, BS, max_num_seqs=8, max_batched_tokens=6)
    r = req(list(range(1, 6)), prompt=16, out=3)  # 4 prompt blocks, one more from the output
    steps = run(core, [r])
    # 16 tokens at 6 a step: 6, 6, 4 (the first token comes with the last chunk), then two
    # decode steps.
    assert steps == pytest.approx([1e-3 + 6e-4, 1e-3 + 6e-4, 1e-3 + 4e-4, 1e-3 + 1e-5,
                                   1e-3 + 1e-5])
    assert r.generated == 3 and r.cached_tokens == 0
    assert r.first_token_at == pytest.approx(sum(steps[:3]))
    # Stored: the prompt's blocks as the chunks filled them, then the output's full block
    # (16 + 3 - 1 = 18 tokens computed: 4 full blocks, the fifth is not full).
    stored = [k for kind, keys in core.cache.take_events() if kind == "stored" for k in keys]
    assert stored == [1, 2, 3, 4]


def test_a_cached_prefix_costs_nothing_and_the_last_block_is_computed_again():
    core = SimCore(SIM, BS, max_num_seqs=8, max_batched_tokens=64)
    first = req([1, 2, 3, 4, 5], prompt=16, out=2)
    run(core, [first])
    second = req([1, 2, 3, 9, 10], prompt=20)  # shares 3 blocks
    steps = run(core, [second])
    assert second.cached_tokens == 12
    assert steps[0] == pytest.approx(1e-3 + 8 * 1e-4)  # 20 - 12 tokens prefilled
    again = req([1, 2, 3, 4, 5], prompt=16)  # all cached: its last block is computed anyway
    run(core, [again])
    assert again.cached_tokens == 12


def test_the_batch_holds_at_most_max_num_seqs_and_the_rest_wait_in_order():
    core = SimCore(SIM, BS, max_num_seqs=2, max_batched_tokens=64)
    rs = [req([100 + i], prompt=4, out=3) for i in range(3)]
    for r in rs:
        core.add(r)
    step = core.schedule(0.0)
    assert [r for r, _ in step.prefills] == rs[:2] and list(core.waiting) == [rs[2]]
    run(core, rs)
    assert rs[2].scheduled_at > rs[0].scheduled_at


def test_free_blocks_are_evicted_least_recently_used_first_and_said_so():
    cache = PrefixCache(num_blocks=6)
    a, b = req([1, 2], prompt=8, out=1), req([3, 4], prompt=8, out=1)  # 3 blocks each
    for r in (a, b):
        assert cache.admit(r, BS)
        cache.store(r, 8, BS)
        cache.release(r)
    cache.take_events()
    # a's and b's 4 full blocks are free and cached; c needs 4 blocks of the 6, so two free
    # ones go: a's (the older), its tail first, as vLLM frees a request's blocks.
    c = req([5, 6], prompt=8, out=8)
    assert cache.admit(c, BS)
    assert cache.take_events() == [("removed", [2, 1])]
    assert cache.cached(3) and cache.cached(4) and not cache.cached(1)


def test_a_request_that_does_not_fit_waits_and_changes_nothing():
    cache = PrefixCache(num_blocks=3)
    held = req([1, 2], prompt=8, out=4)  # 3 blocks, in use
    assert cache.admit(held, BS)
    before = (dict(cache.refs), list(cache.free), cache.anonymous)
    assert not cache.admit(req([7], prompt=4, out=1), BS)
    assert (dict(cache.refs), list(cache.free), cache.anonymous) == before


def test_an_aborted_request_gives_its_blocks_back():
    core = SimCore(SIM, BS, max_num_seqs=4, max_batched_tokens=64)
    r = req([1, 2, 3], prompt=12, out=50)
    core.add(r)
    core.finish(core.schedule(0.0), 1.0)  # prefilled, decoding
    assert core.cache.used > 0
    core.abort(r)
    assert r.done and core.unfinished == 0
    assert core.cache.anonymous == 0 and not core.cache.refs
    assert list(core.cache.free) == [3, 2, 1]  # what it computed stays cached, tail first
    assert core.cache.clear() and not core.cache.free


def test_a_reset_is_refused_while_a_request_holds_blocks():
    core = SimCore(SIM, BS, max_num_seqs=4, max_batched_tokens=64)
    done, running = req([1, 2], prompt=8), req([7, 8], prompt=8, out=50)
    run(core, [done])
    core.add(running)
    core.finish(core.schedule(0.0), 1.0)
    assert not core.cache.clear() and core.cache.cached(1)  # as vLLM answers False
    core.abort(running)
    assert core.cache.clear() and not core.cache.cached(1)
