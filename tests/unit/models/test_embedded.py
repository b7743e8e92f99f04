"""Embedded model preparation and tiny random models (architecture facts, tokenizer)."""

from __future__ import annotations

import json

import pytest

from rayattn.config.architecture import lookup
from rayattn.config.loader import parse_args
from rayattn.config.plan import PlanError, build_plan
from rayattn.models.embedded import prepare_smollm2, resolve_embedded
from rayattn.models.tiny import make_tiny_model


def test_embedded_model_prepared_by_our_code_and_idempotent(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYATTN_CACHE", str(tmp_path))
    out = resolve_embedded("rayattn://smollm2-135m")
    assert out.is_relative_to(tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert (out / "model.safetensors").stat().st_size > 100e6
    mtime = (out / "model.safetensors").stat().st_mtime
    prepare_smollm2(out)  # second call: nothing rewritten
    assert (out / "model.safetensors").stat().st_mtime == mtime
    with pytest.raises(ValueError, match="model.source"):
        resolve_embedded("rayattn://nope")


def _cpu_args(path) -> dict:
    return {"model": {"source": str(path)}, "platform": {"kind": "cpu"},
            "engine": {"kv_cache_memory_bytes": 1 << 26}}


@pytest.mark.parametrize("arch,is_mla,head_dim,moe", [
    ("llama", False, 32, False), ("qwen3-moe", False, 32, True),
    ("deepseek-mla", True, 576, True)])
def test_tiny_models_have_the_declared_architecture(tmp_path, arch, is_mla, head_dim, moe):
    path = make_tiny_model(arch, tmp_path / arch)
    cfg = parse_args(_cpu_args(path))
    a = lookup(cfg.model)
    assert (a.is_mla, a.head_dim, a.is_moe) == (is_mla, head_dim, moe)
    assert a.source.startswith("config.json")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    ids = tok.apply_chat_template([{"role": "user", "content": "the cache"}],
                                  add_generation_prompt=True, tokenize=False)
    assert ids.endswith("<|im_start|>assistant\n")
    plan = build_plan(cfg)
    assert plan.backend.kind == ("mla" if is_mla else "mha")


def test_tiny_mla_rejects_mha_backend(tmp_path):
    path = make_tiny_model("deepseek-mla", tmp_path / "m")
    args = _cpu_args(path)
    args["attention"] = {"backend": "CPU_ATTN"}
    with pytest.raises(PlanError, match="attention.backend: CPU_ATTN is an MHA backend"):
        build_plan(parse_args(args))


def test_a_stale_model_moved_aside_by_another_process_first_is_replaced_all_the_same(
        tmp_path, monkeypatch):
    from pathlib import Path

    from rayattn.models import embedded

    out, tmp = tmp_path / "m", tmp_path / "m.tmp"
    tmp.mkdir()
    stamp = {"format": 1}
    (tmp / "rayattn-prepared.json").write_text(json.dumps(stamp))
    real_exists = Path.exists
    # `out` was there (stale) when this process looked, and gone when it moved it aside.
    monkeypatch.setattr(Path, "exists", lambda p: p == out or real_exists(p))
    embedded._replace(out, tmp, stamp)
    monkeypatch.undo()
    assert embedded._stamped(out, stamp) and not tmp.exists()
