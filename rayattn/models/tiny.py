"""Tiny random-weight models of the architectures rayattn cares about (Llama-style GQA,
Qwen3 MoE, DeepSeek-V3-style MLA), with a tokenizer trained locally — for tests that need a
particular attention shape without a model hub."""

from __future__ import annotations

from pathlib import Path

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = ("the a cache block token router replica prefix decode extend prefill attention "
             "paris france capital question answer system user assistant").split()
    corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(500)]
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=[
        "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
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
