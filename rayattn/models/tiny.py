"""Tiny random-weight models of the architectures rayattn cares about (Llama-style GQA,
Qwen3 MoE, DeepSeek-V3-style MLA), with a tokenizer trained locally — for tests that need a
particular attention shape without a model hub."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

# Like Qwen3's: tools rendered into a system block, and `enable_thinking: false` (a
# chat_template_kwargs) closing an empty think block, so tests can exercise vLLM's tool and
# reasoning handling on a tiny model.
_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")
# Plain (not special) added tokens, as in Qwen3's tokenizer: vLLM's qwen3 reasoning parser
# and hermes tool-call parser look them up, and they must survive detokenization.
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


def _tokenizer(out: Path, vocab: int = 512) -> None:
    import random
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()  # else decoded text keeps the byte markers (Ġ for ' ')
    words = ("the a cache block token router replica prefix decode extend prefill attention "
             "paris france capital question answer system user assistant").split()
    corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(500)]
    if vocab > 512:
        # A real-size vocabulary needs enough distinct words to merge into (~10 s for 32000).
        rng = random.Random(0)
        words += ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 10)))
                  for _ in range(60000)]
        corpus = [" ".join(rng.choice(words) for _ in range(20)) for _ in range(20000)]
    trainer = trainers.BpeTrainer(vocab_size=vocab - len(MARKERS), special_tokens=[
        "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens(MARKERS)
    if vocab > 512 and tok.get_vocab_size() != vocab:  # tiny models: up to 512 is fine
        raise ValueError(f"tokenizer trained to {tok.get_vocab_size()} tokens, not {vocab}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>",
                                   unk_token="<unk>", pad_token="<unk>")
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(out)


def make_tiny_model(arch: str, out: str | Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out)
    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  max_position_embeddings=2048, bos_token_id=1, eos_token_id=4,
                  tie_word_embeddings=False)
    if arch == "llama":
        from transformers import LlamaConfig
        cfg = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=32, **common)
    elif arch == "qwen3-moe":
        from transformers import Qwen3MoeConfig
        cfg = Qwen3MoeConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                             decoder_sparse_step=1, **common)
    elif arch == "deepseek-mla":
        from transformers import DeepseekV3Config
        # CPU MLA kernels need the real latent size (kv_lora_rank 512 + rope 64 = 576);
        # loading needs noaux_tc + sigmoid routing for e_score_correction_bias.
        cfg = DeepseekV3Config(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512,
                               q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32,
                               v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
                               n_group=1, topk_group=1, moe_intermediate_size=64,
                               first_k_dense_replace=1, topk_method="noaux_tc",
                               scoring_func="sigmoid", **common)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    _tokenizer(out)
    return out


# --- random models at real shapes (GPU benchmarks, bench/gpu) --------------------------------
# Weights are drawn on the GPU where there is one and written layer by layer as safetensors
# shards with an index, without instantiating modelling code: seconds for billions of
# parameters, and host memory holds one layer at a time.
SHAPES: dict[str, dict] = {
    # The 0.85B Llama of the GPU recipe (../shared/gpu/make_model.py): GQA 32/8, head_dim 64.
    "llama-0.85b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        head_dim=64, max_position_embeddings=40960),
    # DeepSeek-V2-Lite's shape (15.7B total, 2.4B active): MLA with 16 heads, kv_lora_rank 512,
    # q_lora_rank none, qk_nope 128 + rope 64, v 128; 27 layers, the first dense (10944), then
    # 64 routed experts (6 per token, 1408 wide) + 2 shared. Not copied: the vocabulary (32000
    # here, to match the tokenizer; 102400 in V2-Lite: only the LM head of the last token
    # differs) and YaRN rope scaling (plain rope here; same kernels).
    "deepseek-v2-lite": dict(vocab_size=32000, hidden_size=2048, intermediate_size=10944,
                             moe_intermediate_size=1408, num_hidden_layers=27,
                             num_attention_heads=16, num_key_value_heads=16,
                             n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6,
                             kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                             qk_nope_head_dim=128, v_head_dim=128, topk_method="greedy",
                             n_group=1, topk_group=1, first_k_dense_replace=1,
                             norm_topk_prob=False, routed_scaling_factor=1.0,
                             max_position_embeddings=40960),
}


def make_shaped_model(arch: str, out: str | Path, tokenizer: str | Path | None = None,
                      device: str | None = None, **overrides: Any) -> Path:
    """Random bf16 model of a real shape (`SHAPES`; `overrides` change any config field, e.g.
    num_hidden_layers=2 for a quick check). `tokenizer`: a directory whose tokenizer files are
    copied (its size must equal the vocabulary); else one is trained (~10 s for 32000)."""
    import shutil
    import time

    import torch

    if arch not in SHAPES:
        raise ValueError(f"unknown shaped architecture {arch!r}; known: {', '.join(SHAPES)}")
    t0 = time.time()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _shaped_config(arch, {**SHAPES[arch], **overrides})
    cfg.save_pretrained(out)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    weights = _RandomWeights(cfg, dev, llama=arch.startswith("llama"))
    total, shards = _save_shards(weights.shards(), out)
    if tokenizer is not None:
        for f in Path(tokenizer).iterdir():
            if f.is_file() and not f.name.startswith(("config", "model")):
                shutil.copy(f, out / f.name)
    else:
        _tokenizer(out, cfg.vocab_size)
    print(f"{arch}: {total / 1e9:.2f}B parameters, bf16, {shards} shards in {out} "
          f"({time.time() - t0:.1f} s on {dev})", flush=True)
    return out


def _shaped_config(arch: str, shape: dict[str, Any]) -> Any:
    """The transformers config of `arch` (Llama or DeepSeek-V2) with `shape`, in bf16."""
    common = dict(rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=4, tie_word_embeddings=False)
    if arch.startswith("llama"):
        from transformers import LlamaConfig

        cfg = LlamaConfig(**shape, **common)
        cfg.architectures = ["LlamaForCausalLM"]
    else:
        from transformers import DeepseekV2Config

        cfg = DeepseekV2Config(**shape, **common)
        cfg.architectures = ["DeepseekV2ForCausalLM"]
    cfg.dtype = "bfloat16"
    return cfg


class _RandomWeights:
    """A shaped model's weights, random (seeded: the same shape gives the same bytes), one
    shard of tensors at a time so a large model never sits whole in memory. Drawn on `dev`
    (a GPU draws a large model's weights far faster), kept on the host."""

    def __init__(self, cfg: Any, dev: str, llama: bool) -> None:
        import torch

        self.cfg, self.dev, self.llama = cfg, dev, llama
        self.g = torch.Generator(device=dev).manual_seed(0)

    def shards(self) -> list[Callable[[], dict[str, Any]]]:
        """Makers of the shards' tensors, in the order they are drawn: embeddings and the
        head first, then one shard per layer."""
        cfg = self.cfg
        parts: list[Callable[[], dict[str, Any]]] = [
            lambda: {"model.embed_tokens.weight": self.rnd(cfg.vocab_size, cfg.hidden_size),
                     "model.norm.weight": self.ones(cfg.hidden_size),
                     "lm_head.weight": self.rnd(cfg.vocab_size, cfg.hidden_size)}]
        parts += [lambda i=i: self.layer(i) for i in range(cfg.num_hidden_layers)]
        return parts

    def rnd(self, *s: int) -> Any:
        import torch

        return (torch.randn(*s, generator=self.g, device=self.dev, dtype=torch.float32)
                * 0.02).to(torch.bfloat16).cpu()

    def ones(self, n: int) -> Any:
        import torch

        return torch.ones(n, dtype=torch.bfloat16)

    def mlp(self, p: str, width: int) -> dict[str, Any]:
        h = self.cfg.hidden_size
        return {f"{p}gate_proj.weight": self.rnd(width, h),
                f"{p}up_proj.weight": self.rnd(width, h),
                f"{p}down_proj.weight": self.rnd(h, width)}

    def layer(self, i: int) -> dict[str, Any]:
        cfg = self.cfg
        p, h = f"model.layers.{i}.", cfg.hidden_size
        sd = {p + "input_layernorm.weight": self.ones(h),
              p + "post_attention_layernorm.weight": self.ones(h)}
        if self.llama:
            return sd | self._gqa(p + "self_attn.") | self.mlp(p + "mlp.", cfg.intermediate_size)
        sd |= self._mla(p + "self_attn.")
        if i < cfg.first_k_dense_replace:
            return sd | self.mlp(p + "mlp.", cfg.intermediate_size)
        sd[p + "mlp.gate.weight"] = self.rnd(cfg.n_routed_experts, h)
        for e in range(cfg.n_routed_experts):
            sd |= self.mlp(f"{p}mlp.experts.{e}.", cfg.moe_intermediate_size)
        return sd | self.mlp(p + "mlp.shared_experts.",
                             cfg.moe_intermediate_size * cfg.n_shared_experts)

    def _gqa(self, a: str) -> dict[str, Any]:
        cfg, h = self.cfg, self.cfg.hidden_size
        hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        return {a + "q_proj.weight": self.rnd(nh * hd, h),
                a + "k_proj.weight": self.rnd(nkv * hd, h),
                a + "v_proj.weight": self.rnd(nkv * hd, h),
                a + "o_proj.weight": self.rnd(h, nh * hd)}

    def _mla(self, a: str) -> dict[str, Any]:
        cfg, h = self.cfg, self.cfg.hidden_size
        nh, r = cfg.num_attention_heads, cfg.kv_lora_rank
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        return {a + "q_proj.weight": self.rnd(nh * qk, h),
                a + "kv_a_proj_with_mqa.weight": self.rnd(r + cfg.qk_rope_head_dim, h),
                a + "kv_a_layernorm.weight": self.ones(r),
                a + "kv_b_proj.weight": self.rnd(nh * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                                 r),
                a + "o_proj.weight": self.rnd(h, nh * cfg.v_head_dim)}


def _save_shards(parts: list[Callable[[], dict[str, Any]]], out: Path) -> tuple[int, int]:
    """Each part's tensors as one safetensors shard in `out`, with the index that maps every
    tensor to its shard. Returns (parameters, shards)."""
    import json

    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    total = 0
    for n, make in enumerate(parts):
        sd = make()
        fname = f"model-{n + 1:05d}-of-{len(parts):05d}.safetensors"
        save_file(sd, str(out / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(sd, fname)
        total += sum(t.numel() for t in sd.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 2 * total}, "weight_map": weight_map}, indent=1))
    return total, len(parts)
