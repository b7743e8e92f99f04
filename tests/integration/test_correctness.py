"""The served engine computes what the model computes: greedy tokens through rayattn (real Ray
Serve, real vLLM CPU engines) equal transformers' greedy tokens from the same files.

The reference runs in float32 on the same weights, so the comparison does not depend on the
CPU's bf16/AMX kernels: a machine whose vLLM kernels are wrong fails here whatever text it
happens to produce.
"""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.integration
MODEL = "smollm2"
N_TOKENS = 16
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in one sentence what a CPU does.",
]


@pytest.fixture(scope="module")
def reference():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rayattn.models.embedded import resolve_embedded

    path = str(resolve_embedded("rayattn://smollm2-135m"))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()

    def greedy(prompt_ids: list[int]) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=N_TOKENS,
                                 do_sample=False, attention_mask=torch.ones(
                                     1, len(prompt_ids), dtype=torch.long))
        ids = out[0, len(prompt_ids):].tolist()
        if tok.eos_token_id in ids:  # the engine stops at EOS too
            ids = ids[:ids.index(tok.eos_token_id) + 1]
        return ids

    return tok, greedy


@pytest.mark.parametrize("question", PROMPTS)
def test_served_greedy_tokens_equal_transformers(server, reference, question):
    tok, greedy = reference
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": question}],
                                         add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt_ids, list):  # transformers 5 returns a BatchEncoding
        prompt_ids = prompt_ids["input_ids"]
    expected = greedy(prompt_ids)
    r = httpx.post(f"{server}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt_ids, "max_tokens": N_TOKENS, "temperature": 0,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == prompt_ids
    got = choice["token_ids"]
    assert got == expected, (tok.decode(got), tok.decode(expected))
