"""Pins: the attention-backend facts read from the installed vLLM's classes
(rayattn/integrations/vllm_backends.py). Read within a try: an API vLLM changed would fall
back to the static table silently, so at least one backend class of this build must answer."""

from __future__ import annotations

from rayattn.integrations import vllm_backends
from tests.unit.integrations import pins

USER = "rayattn/integrations/vllm_backends.py backend_facts"


def test_some_installed_backend_answers_every_fact():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    names = vllm_backends.installed_backend_names()
    assert names, f"{pins.version('vllm')}: AttentionBackendEnum has no members"
    answered = [n for n in sorted(names) if vllm_backends.backend_facts(n) is not None]
    importable = []
    for n in sorted(names):
        try:
            importable.append(AttentionBackendEnum[n].get_class())
        except Exception:
            continue
    assert importable, f"{pins.version('vllm')}: no backend class imports on this build"
    for cls in importable[:1]:
        pins.attrs(cls, "get_supported_kernel_block_sizes", "is_mla", "supports_sink",
                   "get_supported_head_sizes", "supported_kv_cache_dtypes", user=USER)
    assert answered, f"{pins.version('vllm')}: no backend's facts are readable; see {USER}"
