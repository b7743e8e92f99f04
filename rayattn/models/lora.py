"""Random-weight LoRA adapters the project makes itself, for a base model on this machine.

`rayattn://random-lora/<seed>` as an adapter's source: a PEFT-format adapter (the files
vLLM's LoRA loader reads: adapter_config.json and adapter_model.safetensors) on the base
model's attention projections, with weights drawn from `<seed>`. Tests and the local
multi-model deployment need adapters that load like real ones and visibly change the
answer, without a model hub; no `peft` install is needed to write them.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

RANDOM_LORA = "rayattn://random-lora/"
RANK = 8
TARGETS = ("q_proj", "v_proj", "o_proj")
SCALE = 0.7
_MARKER = "rayattn-lora.json"
_FORMAT = 2  # bumped when what make_random_adapter writes changes


def is_random_lora(source: str) -> bool:
    return source.startswith(RANDOM_LORA)


def seed_of(source: str) -> int:
    seed = source[len(RANDOM_LORA):]
    if not seed.isdigit():
        raise ValueError(f"lora adapter source {source!r}: expected {RANDOM_LORA}<integer seed>")
    return int(seed)


def adapter_dir(base_dir: Path, source: str) -> Path:
    """Where the adapter for `base_dir` lives: beside the base model's own files, so a
    re-prepared base (another version) gets new adapters too."""
    return base_dir.parent / f"{base_dir.name}.lora-{seed_of(source)}"


def resolve_adapter(source: str, base_dir: Path | None, prepare: bool) -> str:
    """A local adapter directory for `source` (made now for a random adapter when `prepare`);
    other sources (a local path, a Hugging Face id) are vLLM's to load."""
    if not is_random_lora(source):
        return source
    if base_dir is None:
        raise ValueError(f"lora adapter {source!r} needs the base model on this machine "
                         "(a local directory or an embedded model)")
    out = adapter_dir(base_dir, source)
    if prepare and not _current(out):
        make_random_adapter(base_dir, out, seed_of(source))
    return str(out)


def make_random_adapter(base_dir: Path, out: Path, seed: int) -> Path:
    """An adapter whose low-rank updates are about as large as the base weights they add to
    (PEFT initialises B to zero, which would change nothing): answers differ from the base
    model's and from another seed's."""
    # torch and safetensors: only making an adapter needs them.
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    pattern = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(\w+)\.weight$")
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(base_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                m = pattern.match(key)
                if m is None or m.group(2) not in TARGETS:
                    continue
                n_out, n_in = st.get_slice(key).get_shape()
                std = float(st.get_tensor(key).float().std())
                name = f"base_model.model.model.layers.{m.group(1)}.self_attn.{m.group(2)}"
                # B·A has entries of about SCALE × the base weights' spread.
                tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, n_in, generator=gen)
                tensors[f"{name}.lora_B.weight"] = torch.randn(n_out, RANK, generator=gen) \
                    * SCALE * std / RANK ** 0.5
    if not tensors:
        raise ValueError(f"{base_dir}: no attention projections ({', '.join(TARGETS)}) found "
                         "for a LoRA adapter")
    # Engine replicas and routers may prepare the same adapter at once: each writes its own
    # directory and the first rename wins.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(tmp / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": RANK,
              "target_modules": list(TARGETS), "bias": "none", "lora_dropout": 0.0,
              "base_model_name_or_path": str(base_dir), "fan_in_fan_out": False,
              "modules_to_save": None, "use_rslora": False, "use_dora": False}
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=1))
    (tmp / _MARKER).write_text(json.dumps({"seed": seed, "format": _FORMAT}))
    if out.exists() and not _current(out):
        shutil.rmtree(out, ignore_errors=True)  # partial, or from an older version
    try:
        tmp.rename(out)
    except OSError:
        if not _current(out):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _current(out: Path) -> bool:
    try:
        return json.loads((out / _MARKER).read_text()).get("format") == _FORMAT
    except (OSError, ValueError):
        return False
