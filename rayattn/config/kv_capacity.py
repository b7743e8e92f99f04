"""What a GiB of KV memory holds: bytes per token of the whole model for each KV cache
dtype, so `rayattn check` can show fp8 and the packed formats as capacity levers (tokens per
GiB) and size the host-memory tier in tokens.

Counts follow vLLM's layouts: MHA stores K and V per KV head and layer; MLA stores one
latent of head_dim (576 = 512 + 64 rope) per layer, and `fp8_ds_mla` is DeepSeek's 656-byte
fp8 latent with its scales. The `turboquant_*` presets pack K and V per head (vLLM's
TurboQuantConfig: fp8 or MSE-quantized keys with an fp16 norm, uniform values with fp16
scale and zero, rounded to an even byte count) and keep the first and last two layers at
the native dtype. Block padding and allocator overhead are not counted.
"""

from __future__ import annotations

import math

from rayattn.config.architecture import Architecture

# Key bits, value bits of vLLM's TurboQuant presets (8-bit keys are fp8).
TURBOQUANT = {"turboquant_k8v4": (8, 4), "turboquant_4bit_nc": (4, 4),
              "turboquant_k3v4_nc": (3, 4), "turboquant_3bit_nc": (3, 3)}
TURBOQUANT_NATIVE_LAYERS = 4
"""TurboQuant keeps its boundary layers (the first and last two) at the native dtype."""
FP8_DS_MLA_BYTES = 656
GIB = 1 << 30


def native_bytes(model_dtype: str, platform: str) -> int:
    """Bytes of one KV element with kv_cache_dtype `auto`: the model's dtype (float32 for
    `auto` on CPU, as rayattn's plan runs CPU engines; bf16 otherwise)."""
    if model_dtype == "float32" or (model_dtype == "auto" and platform == "cpu"):
        return 4
    return 2


def _turboquant_slot(head_dim: int, key_bits: int, value_bits: int) -> int:
    key = head_dim if key_bits == 8 else math.ceil(head_dim * key_bits / 8) + 2
    value = math.ceil(head_dim * value_bits / 8) + 4
    slot = key + value
    return slot + slot % 2


def bytes_per_token(arch: Architecture, kv_dtype: str, native: int) -> int | None:
    """KV bytes one token takes in the whole engine (all TP ranks together); None when the
    layer count or the format's layout is not known, or the format does not apply."""
    layers = arch.num_layers
    if not layers:
        return None
    if arch.is_mla:
        if kv_dtype == "fp8_ds_mla":
            return layers * FP8_DS_MLA_BYTES
        if kv_dtype.startswith("turboquant_"):
            return None
        elem = 1 if kv_dtype.startswith("fp8") else native
        return layers * arch.head_dim * elem
    if kv_dtype == "fp8_ds_mla":
        return None
    per_head = 2 * arch.head_dim * (1 if kv_dtype.startswith("fp8") else native)
    if kv_dtype in TURBOQUANT:
        packed = _turboquant_slot(arch.head_dim, *TURBOQUANT[kv_dtype])
        kept = min(layers, TURBOQUANT_NATIVE_LAYERS)
        return arch.num_key_value_heads * (kept * 2 * arch.head_dim * native
                                           + (layers - kept) * packed)
    return layers * arch.num_key_value_heads * per_head


def levers(arch: Architecture, native: int) -> dict[str, int]:
    """Tokens per GiB of KV for each format that applies to this model, largest last."""
    formats = ["auto", "fp8", *(["fp8_ds_mla"] if arch.is_mla else TURBOQUANT)]
    out = {}
    for f in formats:
        b = bytes_per_token(arch, f, native)
        if b:
            out[f] = GIB // b
    return dict(sorted(out.items(), key=lambda kv: kv[1]))
