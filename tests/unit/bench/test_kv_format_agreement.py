"""bench/kv_format_agreement.py's pure parts: the agreement figures and the engine arguments
each format runs with."""

from __future__ import annotations

from bench.kv_format_agreement import INSTRUCTIONS, agreement, engine_kwargs, prompts
from tests.conftest import ROOT


def test_agreement_counts_identical_answers_and_where_the_others_part() -> None:
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    alt = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9]]
    got = agreement(ref, alt)
    assert got["identical"] == round(1 / 3, 3)
    # 1.0 for the identical answer, 2 of 4 tokens before the second's difference, 0 of 2
    assert got["matched_before_first_difference"] == round((1.0 + 0.5 + 0.0) / 3, 3)
    assert got["first_difference_p50"] == 2  # of the positions 2 and 0


def test_a_shorter_answer_that_stops_early_is_a_difference_at_its_end() -> None:
    got = agreement([[1, 2, 3]], [[1, 2]])
    assert got["identical"] == 0.0 and got["first_difference_p50"] == 2


def test_each_format_runs_the_plans_engine_arguments_with_only_its_kv_format_changed() -> None:
    config = str(ROOT / "deployments" / "h200.yaml")  # its model's shape is declared
    ref, _ = engine_kwargs(config, None, "auto")
    fp8, env = engine_kwargs(config, None, "fp8")
    assert fp8.pop("kv_cache_dtype") == "fp8" and ref.pop("kv_cache_dtype") == "auto"
    assert fp8 == ref and fp8["model"] == "/tmp/rayattn-gpu/llama-0.85b"
    assert "kv_events_config" not in fp8 and env  # no publisher: no router listens


def test_prompts_hold_every_instruction_and_two_turns_of_each_document() -> None:
    chats = prompts(doc_words=50, documents=3)
    assert len(chats) == len(INSTRUCTIONS) + 6
    first, second = chats[len(INSTRUCTIONS)], chats[len(INSTRUCTIONS) + 1]
    assert second[:2] == first and second[-1]["role"] == "user"
