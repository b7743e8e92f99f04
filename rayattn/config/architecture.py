"""Architecture facts (MLA or MHA, heads, head size, sinks, MoE) that decide which attention
backends and parallel layouts can run a model.

Looked up, in order, from the model's config.json (local directory, embedded model, or the
Hugging Face cache — never the network), a built-in table of well-known production models,
or the `model.architecture` block of the YAML. The result says which source it used.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from rayattn.config.schema import ModelConfig
from rayattn.models.embedded import is_embedded, resolve_embedded


@dataclass(frozen=True)
class Architecture:
    is_mla: bool
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    has_sinks: bool
    is_moe: bool
    source: str
    """Where the facts came from (shown by `rayattn check`)."""
    num_layers: int | None = None
    """Attention layers (num_hidden_layers): what KV bytes per token scale with; None when
    unknown (then `rayattn check` prints no KV capacity)."""

    @property
    def kind(self) -> str:
        return "mla" if self.is_mla else "mha"


def from_hf_config(cfg: dict, source: str) -> Architecture:
    text = cfg.get("text_config", cfg)  # multimodal wrappers nest the LM config
    heads = int(text["num_attention_heads"])
    is_mla = bool(text.get("kv_lora_rank"))
    if is_mla:
        # The MLA kernels see the latent: kv_lora_rank + rope dims (512 + 64 = 576).
        head_dim = int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim", 64))
        kv_heads = 1
    else:
        head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
        kv_heads = int(text.get("num_key_value_heads") or heads)
    is_moe = any(
        text.get(k) for k in ("num_experts", "n_routed_experts", "num_local_experts")
    )
    # GPT-OSS declares sinks only implicitly through its model type.
    has_sinks = bool(text.get("sinks") or text.get("model_type") == "gpt_oss")
    layers = text.get("num_hidden_layers")
    return Architecture(is_mla, heads, kv_heads, head_dim, has_sinks, is_moe, source,
                        int(layers) if layers else None)


# Facts of production models whose weights are not on this machine, from their config.json.
KNOWN: dict[str, dict] = {
    "deepseek-ai/DeepSeek-R1-0528": dict(is_mla=True, num_attention_heads=128,
                                         num_key_value_heads=1, head_dim=576,
                                         has_sinks=False, is_moe=True, num_layers=61),
    "deepseek-ai/DeepSeek-R1": dict(is_mla=True, num_attention_heads=128, num_key_value_heads=1,
                                    head_dim=576, has_sinks=False, is_moe=True, num_layers=61),
    "deepseek-ai/DeepSeek-V3": dict(is_mla=True, num_attention_heads=128, num_key_value_heads=1,
                                    head_dim=576, has_sinks=False, is_moe=True, num_layers=61),
    "moonshotai/Kimi-K2-Instruct": dict(is_mla=True, num_attention_heads=64,
                                        num_key_value_heads=1, head_dim=576, has_sinks=False,
                                        is_moe=True, num_layers=61),
    "Qwen/Qwen3-235B-A22B-Instruct-2507-FP8": dict(is_mla=False, num_attention_heads=64,
                                                   num_key_value_heads=4, head_dim=128,
                                                   has_sinks=False, is_moe=True, num_layers=94),
    "Qwen/Qwen3-32B": dict(is_mla=False, num_attention_heads=64, num_key_value_heads=8,
                           head_dim=128, has_sinks=False, is_moe=False, num_layers=64),
    "meta-llama/Llama-3.3-70B-Instruct": dict(is_mla=False, num_attention_heads=64,
                                              num_key_value_heads=8, head_dim=128,
                                              has_sinks=False, is_moe=False, num_layers=80),
    "meta-llama/Llama-3.1-8B-Instruct": dict(is_mla=False, num_attention_heads=32,
                                             num_key_value_heads=8, head_dim=128,
                                             has_sinks=False, is_moe=False, num_layers=32),
    "openai/gpt-oss-120b": dict(is_mla=False, num_attention_heads=64, num_key_value_heads=8,
                                head_dim=64, has_sinks=True, is_moe=True, num_layers=36),
}


def _hf_cache_config(repo_id: str) -> Path | None:
    hub = Path(os.environ.get("HF_HUB_CACHE")
               or Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub")
    snapshots = hub / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    if not snapshots.is_dir():
        return None
    for snap in sorted(snapshots.iterdir()):
        if (snap / "config.json").is_file():
            return snap / "config.json"
    return None


def local_model_dir(source: str, prepare: bool) -> Path | None:
    """The directory holding the model's files, if it is on this machine."""
    if is_embedded(source):
        return resolve_embedded(source, prepare=prepare)
    path = Path(source).expanduser()
    return path if path.is_dir() else None


def lookup(model: ModelConfig, prepare: bool = False) -> Architecture:
    local = local_model_dir(model.source, prepare=prepare)
    if local is not None and (local / "config.json").is_file():
        return from_hf_config(json.loads((local / "config.json").read_text()),
                              f"config.json in {local}")
    if local is None and (cached := _hf_cache_config(model.source)):
        return from_hf_config(json.loads(cached.read_text()), f"Hugging Face cache {cached}")
    if model.source in KNOWN:
        return Architecture(**KNOWN[model.source], source="rayattn built-in table")
    if local is not None and local.name in {"SmolLM2-135M-Instruct"}:
        # Embedded model not prepared yet: its facts are fixed by the GGUF we ship.
        return Architecture(False, 9, 3, 64, False, False, source="rayattn built-in table",
                            num_layers=30)
    if local is not None and local.name == "tiny-llama":
        # Generated when first prepared, always at this shape (rayattn/models/tiny.py).
        return Architecture(False, 4, 2, 32, False, False, source="rayattn built-in table",
                            num_layers=2)
    if model.architecture is not None:
        a = model.architecture
        return Architecture(a.is_mla, a.num_attention_heads,
                            a.num_key_value_heads or a.num_attention_heads, a.head_dim,
                            a.has_sinks, a.is_moe, source="model.architecture in YAML",
                            num_layers=a.num_layers)
    raise ValueError(
        f"model.source: cannot find config.json for {model.source!r} (not a local directory, "
        "not in the Hugging Face cache, not in rayattn's table of known models); declare "
        "model.architecture in the YAML"
    )
