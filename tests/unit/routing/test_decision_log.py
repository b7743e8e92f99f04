"""DecisionLog alone: previous turns, moves and regret, by the decision's reason."""

from __future__ import annotations

from rayattn.routing.decision_log import DecisionLog
from rayattn.routing.policies import Decision, RouteRequest

BS = 4


def _route(session: str | None = "s", held: dict[str, int] | None = None,
           previous: str | None = None) -> RouteRequest:
    r = RouteRequest([1, 2, 3], 12, 1, session)
    r.held, r.previous = held, previous
    return r


def test_regret_counts_tokens_another_candidate_held():
    log = DecisionLog()
    d = Decision("a", "least_loaded", 0)
    log.record(d, _route(held={"b": 2}), ["a", "b"], BS, retry=False)
    assert d.regret_tokens == 2 * BS and log.regret_tokens == {"least_loaded": 2 * BS}
    assert log.previous("s") == "a"


def test_a_move_off_the_previous_turns_candidate_is_counted():
    log = DecisionLog()
    d = Decision("b", "r", 0)
    log.record(d, _route(previous="a"), ["a", "b"], BS, retry=False)
    assert d.moved_from == "a" and log.session_moves == {"r": 1}
    d2 = Decision("b", "r", 0)
    log.record(d2, _route(previous="a"), ["b"], BS, retry=False)  # "a" not a candidate
    assert log.session_moves == {"r": 1}


def test_a_retry_is_remembered_but_not_accounted():
    log = DecisionLog()
    d = Decision("b", "r", 0)
    log.record(d, _route(held={"a": 3}, previous="a"), ["a", "b"], BS, retry=True)
    assert not log.regret_tokens and not log.session_moves and log.previous("s") == "b"


def test_the_last_replicas_are_bounded_and_clear_forgets_everything():
    log = DecisionLog(last_replicas=2)
    for s in ("x", "y", "z"):
        log.record(Decision("a", "r", 0), _route(s, held={"b": 1}), ["a", "b"], BS, retry=False)
    assert log.previous("x") is None and log.previous("z") == "a"
    log.clear()
    assert log.previous("z") is None and not log.regret_tokens and not log.session_moves
