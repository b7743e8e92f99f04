"""Limits on the request fields that multiply an engine's work: every one is checked on the
parsed body before anything is rendered, hashed or admitted, and answered with a 400 that
names the field and the limit (router.limits).

vLLM validates each field's type and range, not its size: one body can ask for 1,000
samples (`n`), 10,000 stop strings scanned at every step, a logit bias over the whole
vocabulary, or a megabyte of JSON schema that the grammar backend compiles before the
first token.
"""

from __future__ import annotations

import json
from typing import Any

from rayattn.config.schema import RequestLimits
from rayattn.server.errors import APIError

STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_grammar", "guided_choice", "guided_decoding_backend")
"""Fields whose content the grammar backend compiles (vLLM's current and legacy names)."""


def check(kind: str, data: dict[str, Any], limits: RequestLimits) -> None:
    for field in ("n", "best_of"):
        v = data.get(field)
        if isinstance(v, int) and v > limits.max_n:
            _refuse(field, f"{v} exceeds router.limits.max_n = {limits.max_n}")
    for field in ("stop", "stop_token_ids"):
        v = data.get(field)
        if isinstance(v, list) and len(v) > limits.max_stop:
            _refuse(field, f"{len(v)} entries exceed router.limits.max_stop = "
                           f"{limits.max_stop}")
    bias = data.get("logit_bias")
    if isinstance(bias, dict) and len(bias) > limits.max_logit_bias:
        _refuse("logit_bias", f"{len(bias)} entries exceed router.limits.max_logit_bias = "
                              f"{limits.max_logit_bias}")
    for field in STRUCTURED_FIELDS:
        v = data.get(field)
        if v is not None and len(json.dumps(v)) > limits.max_schema_bytes:
            _refuse(field, f"{len(json.dumps(v))} bytes of structured-output spec exceed "
                           f"router.limits.max_schema_bytes = {limits.max_schema_bytes}")
    if kind == "responses":
        # Structured output rides in text.format there.
        text = data.get("text")
        if text is not None and len(json.dumps(text)) > limits.max_schema_bytes:
            _refuse("text", f"{len(json.dumps(text))} bytes of structured-output spec exceed "
                            f"router.limits.max_schema_bytes = {limits.max_schema_bytes}")
        if data.get("background"):
            # vLLM would answer at once and go on generating: work beyond admission, with
            # no route here to fetch its result.
            _refuse("background", "background responses are not served; leave it unset")
    prompt = data.get("prompt")
    if kind == "completion" and isinstance(prompt, list) and prompt and \
            not isinstance(prompt[0], int) and len(prompt) > limits.max_prompts:
        # A list of strings or of token lists: one engine request each.
        _refuse("prompt", f"{len(prompt)} prompts exceed router.limits.max_prompts = "
                          f"{limits.max_prompts}")


def engine_requests(kind: str, data: dict[str, Any]) -> int:
    """How many engine requests a (checked) request asks for: admission counts this, not 1."""
    n = data.get("n")
    n = n if isinstance(n, int) and n > 0 else 1
    prompt = data.get("prompt")
    prompts = (len(prompt) if kind == "completion" and isinstance(prompt, list) and prompt
               and not isinstance(prompt[0], int) else 1)
    return n * prompts


def check_session(header: str, value: str | None, limits: RequestLimits) -> None:
    """The conversation id is kept per router (affinity, admission): bounded in size."""
    if value is not None and len(value.encode()) > limits.max_session_id_bytes:
        _refuse(header, f"{len(value.encode())} bytes exceed "
                        f"router.limits.max_session_id_bytes = {limits.max_session_id_bytes}")


def _refuse(field: str, why: str) -> None:
    raise APIError(400, f"{field}: {why}", param=field, code="limit_exceeded")
