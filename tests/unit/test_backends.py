"""The backend catalog against the installed vLLM: names exist, and the facts we wrote down
match the backend classes wherever they import on this machine."""

from __future__ import annotations

import pytest
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from rayattn import backends

SEEDS = ["TRITON_ATTN", "ROCM_AITER_UNIFIED_ATTN", "ROCM_ATTN", "ROCM_AITER_FA", "TRITON_MLA",
         "ROCM_AITER_MLA", "ROCM_AITER_TRITON_MLA"]


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


def test_every_name_exists_in_vllm():
    missing = [n for n in backends.CATALOG if n not in AttentionBackendEnum.__members__]
    assert not missing
    # All seven ROCm seed backends import on CPU, so their facts are checked below.
    assert set(SEEDS) <= set(IMPORTABLE)


@pytest.mark.parametrize("name", sorted(IMPORTABLE))
def test_catalog_entry_matches_vllm(name):
    spec = backends.CATALOG[name]
    cls = IMPORTABLE[name]
    assert spec.kind == ("mla" if cls.is_mla() else "mha")
    assert spec.supports_sinks == bool(cls.supports_sink())
    assert set(spec.kv_dtypes) == set(cls.supported_kv_cache_dtypes)
    assert set(spec.head_sizes) == set(cls.get_supported_head_sizes())
    sizes = cls.get_supported_kernel_block_sizes()
    exact = sorted(s for s in sizes if isinstance(s, int))
    multiples = [s.base for s in sizes if not isinstance(s, int)]
    assert sorted(spec.block_sizes) == exact
    assert (multiples[0] if multiples else None) == spec.block_size_multiple


def test_rocm_env_vars_exist_in_vllm():
    import vllm.envs as envs

    for spec in backends.CATALOG.values():
        for var in spec.env:
            assert var in envs.environment_variables, var
