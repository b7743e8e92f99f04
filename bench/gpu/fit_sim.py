"""Simulator engine coefficients refitted from the GPU measurements (docs/results.md), printed as
JSON and as `rayattn simulate` flags.

  python3 bench/gpu/fit_sim.py [--backends bench/gpu/results/backends.json] [--run FLASH_ATTN@mha]
      [--routing bench/gpu/results/routing-summary.json]

The simulator's engine model (rayattn/bench/simulate.py) is linear: a context stream costs
uncached × prefill_s_per_token + cached × ctx_s_per_token, a decode step itl_base_s +
itl_per_seq_s × running sequences. From the offline bench of the backend the routing run
served with (FLASH_ATTN, 0.85B Llama, H200):
  prefill_s_per_token = slope of cold TTFT between 1k and 8k tokens (the fixed per-request
                        cost of LLM.generate, ~14 ms, is left out: the model has no intercept);
  ctx_s_per_token     = slope of the extend TTFT (64 new tokens) over cached context, 1k→8k;
  itl_base_s          = single-stream ITL at 1k of context;
  itl_per_seq_s       = (ITL at batch 64 − ITL at batch 1) / 63;
  capacity_blocks     = the KV blocks each engine of the routing run had.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def fit(b: dict, blocks: int) -> dict:
    p1, p8 = b["prefill_1024_ms"] / 1000, b["prefill_8192_ms"] / 1000
    e1, e8 = b["extend_1024_ms"] / 1000, b["extend_8192_ms"] / 1000
    suffix = 64
    return {
        "prefill_s_per_token": (p8 - p1) / ((8192 + suffix) - (1024 + suffix)),
        "ctx_s_per_token": (e8 - e1) / (8192 - 1024),
        "itl_base_s": b["itl_b1_ctx1024_ms"] / 1000,
        "itl_per_seq_s": max(0.0, (b["itl_b64_ctx1024_ms"] - b["itl_b1_ctx1024_ms"]) / 1000 / 63),
        "capacity_blocks": blocks,
        "block_size": b["block_size"],
        "fixed_request_s": p1 - (p8 - p1) / (8192 - 1024) * (1024 + suffix),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="bench/gpu/results/backends.json")
    ap.add_argument("--run", default="FLASH_ATTN@mha")
    ap.add_argument("--routing", default="bench/gpu/results/routing-summary.json")
    a = ap.parse_args()
    b = json.loads(Path(a.backends).read_text())[a.run]
    blocks = json.loads(Path(a.routing).read_text())["engines"][0]["num_gpu_blocks"]
    c = fit(b, blocks)
    print(json.dumps({k: v if isinstance(v, int) else float(f"{v:.3g}")
                      for k, v in c.items()}, indent=1))
    flags = " ".join(f"--{k.replace('_', '-')} {v if isinstance(v, int) else format(v, '.3g')}"
                     for k, v in c.items() if k != "fixed_request_s")
    print(flags)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
