"""What a smaller KV format does to the answers: the same prompts, greedy, once per
`attention.kv_cache_dtype`, each format's tokens compared with the first format's (the
reference, `auto`: the model's own dtype). The capacity side of the lever, tokens per GiB,
is `rayattn check`'s `kv format:` line; this is the quality side.

    .venv/bin/python bench/kv_format_agreement.py [--config deployments/local.yaml]
        [--model DIR] [--kv-dtypes auto,fp8] [--max-tokens 64] [--doc-words 300]
        [--out FILE]

Prompts: short instructions (written here) and long-context ones (doc_chat's documents of
`--doc-words` words, then the conversation's first and second turns, the second extending
the first's cached prefix, as users' later turns do). Per format: the share of prompts
answered token for token as the reference did, the mean share of each reference answer
matched before the first differing token, and the p50 position of that token
(rayattn.bench.stats.percentile: the upper median). Greedy
decoding amplifies one flipped token into a different continuation, so the second and third
figures say more than the first. Each format runs in a process of its own (vLLM's offline
`LLM`, the engine arguments rayattn's plan gives its engines, the KV format changed).

fp8 KV on CPU needs AVX-512 or AMX (vLLM's CPU_ATTN); on a GPU, a backend that lists it."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

from rayattn.bench.stats import percentile  # noqa: E402
from rayattn.bench.workloads import doc_chat  # noqa: E402
from rayattn.config.loader import app_args, load_serve_config, parse_args  # noqa: E402
from rayattn.config.plan import build_plan  # noqa: E402

INSTRUCTIONS = [
    "What is the capital of France?",
    "Explain in one sentence what a CPU does.",
    "Write a haiku about autumn leaves.",
    "List three prime numbers greater than 20.",
    "What does HTTP stand for?",
    "Give me a Python function that reverses a string.",
    "Why is the sky blue? Answer briefly.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Name the planets of the solar system in order.",
    "What is the difference between a list and a tuple in Python?",
    "Suggest a name for a bakery that sells only bread.",
    "How many days are there in a leap year?",
    "Describe a cat to someone who has never seen one.",
    "What is photosynthesis?",
    "Write a SQL query that counts the rows of a table named users.",
    "Who wrote 'Pride and Prejudice'?",
    "Give two tips for a job interview.",
    "What is the boiling point of water at sea level in Fahrenheit?",
    "Explain what a hash table is.",
    "Write a short apology for missing a meeting.",
    "What is the largest ocean on Earth?",
    "Convert 5 kilometres to miles.",
]


def prompts(doc_words: int, documents: int) -> list[list[dict[str, str]]]:
    """Chat prompts: each instruction alone, then each document's first and second turns
    (the second with the first's answer left out: the same prefix, a different ending)."""
    out = [[{"role": "user", "content": q}] for q in INSTRUCTIONS]
    for c in doc_chat(conversations=documents, turns=2, doc_words=doc_words, user_words=40,
                      seed=11).conversations:
        first = [{"role": "system", "content": c.system}, {"role": "user", "content": c.turns[0]}]
        out += [first, [*first, {"role": "assistant", "content": "Noted."},
                        {"role": "user", "content": c.turns[1]}]]
    return out


def engine_kwargs(config: str, model: str | None, kv_dtype: str) -> tuple[dict, dict]:
    """rayattn's engine arguments for `config` with `kv_dtype`, and the plan's environment."""
    args = app_args(load_serve_config(config)["applications"][0])
    if model:
        args["model"]["source"] = model
    args.setdefault("attention", {})["kv_cache_dtype"] = kv_dtype
    plan = build_plan(parse_args(args), prepare_model=True)
    kw = {k: v for k, v in plan.engine_kwargs.items()
          if k not in ("served_model_name", "kv_events_config")}
    return kw, dict(plan.env)


def answers(config: str, model: str | None, kv_dtype: str, chats: list, max_tokens: int,
            conn: Any) -> None:
    """One format's greedy token ids per prompt, sent back on `conn` (a child process)."""
    try:
        kw, env = engine_kwargs(config, model, kv_dtype)
        # The bench has the machine to itself: every core for the one engine.
        env["OMP_NUM_THREADS"] = str(os.cpu_count() or 1)
        os.environ.update(env)
        from vllm import LLM, SamplingParams

        from rayattn.integrations.vllm_engine import config_objects

        llm = LLM(**config_objects(kw))
        outs = llm.chat(chats, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                        use_tqdm=False)
        conn.send({"tokens": [list(o.outputs[0].token_ids) for o in outs]})
    except Exception as e:  # the parent reports it with the format's name
        conn.send({"error": f"{type(e).__name__}: {e}"})


def run_format(config: str, model: str | None, kv_dtype: str, chats: list,
               max_tokens: int) -> list[list[int]]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=answers, args=(config, model, kv_dtype, chats, max_tokens, child))
    p.start()
    child.close()  # the child's end only: a child that dies unsent ends recv() with EOFError
    try:
        got = parent.recv()
    except EOFError:
        p.join()
        got = {"error": f"the engine's process exited {p.exitcode} with no answers"}
    p.join()
    if "error" in got:
        raise SystemExit(f"kv_cache_dtype={kv_dtype}: {got['error']}")
    return got["tokens"]


def agreement(ref: list[list[int]], alt: list[list[int]]) -> dict[str, float]:
    """How closely `alt`'s answers follow `ref`'s, prompt by prompt (nothing to compare:
    an empty dict)."""
    if not ref:
        return {}
    same, matched, firsts = 0, [], []
    for a, b in zip(ref, alt, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                 min(len(a), len(b)))
        same += a == b
        matched.append(n / max(len(a), 1) if a != b else 1.0)
        if a != b:
            firsts.append(n)
    return {"identical": round(same / len(ref), 3),
            "matched_before_first_difference": round(sum(matched) / len(matched), 3),
            "first_difference_p50": percentile(sorted(firsts), 0.5, empty=-1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "deployments/local.yaml"))
    ap.add_argument("--model", default=None, help="a model directory instead of the config's")
    ap.add_argument("--kv-dtypes", default="auto,fp8", help="the first is the reference")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--doc-words", type=int, default=300)
    ap.add_argument("--documents", type=int, default=12)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dtypes = a.kv_dtypes.split(",")
    chats = prompts(a.doc_words, a.documents)
    tokens = {d: run_format(a.config, a.model, d, chats, a.max_tokens) for d in dtypes}
    ref = tokens[dtypes[0]]
    short = len(INSTRUCTIONS)
    report: dict[str, Any] = {"config": a.config, "model": a.model, "prompts": len(chats),
                              "reference": dtypes[0], "max_tokens": a.max_tokens, "formats": {}}
    for d in dtypes[1:]:
        report["formats"][d] = {
            "all": agreement(ref, tokens[d]),
            "instructions": agreement(ref[:short], tokens[d][:short]),
            "documents": agreement(ref[short:], tokens[d][short:])}
    print(json.dumps(report, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps({**report, "tokens": tokens}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
