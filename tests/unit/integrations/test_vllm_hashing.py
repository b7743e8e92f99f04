"""Pins: vLLM's prefix-cache block hashing as the router repeats it
(rayattn/integrations/vllm_hashing.py, rayattn/routing/hashing.py). Parity of the hashes
themselves: tests/unit/routing/test_hashing.py."""

from __future__ import annotations

import ast
import inspect
import textwrap

from rayattn.integrations import vllm_hashing
from tests.unit.integrations import pins

USER = "rayattn/integrations/vllm_hashing.py"


def test_hash_block_tokens_chains_a_block_onto_its_parent():
    pins.params(vllm_hashing.block_hasher(), "hash_function", "parent_block_hash",
                "curr_block_token_ids", "extra_keys", leading=True,
                user="rayattn/routing/hashing.py BlockHasher.full_hashes")
    from vllm.utils.hashing import get_hash_fn_by_name

    pins.params(get_hash_fn_by_name, "hash_fn_name", leading=True, user=f"{USER} hash_function")


def test_extra_keys_come_from_a_request_and_a_token_range():
    from vllm.v1.core import kv_cache_utils

    pins.params(kv_cache_utils.generate_block_hash_extra_keys, "request", "start_token_idx",
                "end_token_idx", "start_mm_idx", leading=True, user=f"{USER} block_extra_keys")


def _request_fields_read(module, name: str, seen: set[str]) -> set[str]:
    """`request.<field>` read by `name` of `module` and the module's functions it calls."""
    if name in seen or not inspect.isfunction(getattr(module, name, None)):
        return set()
    seen.add(name)
    tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(module, name))))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id == "request":
            out.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            out |= _request_fields_read(module, node.func.id, seen)
    return out


def test_the_stand_in_request_has_every_field_vllm_reads():
    """block_extra_keys hands vLLM's function a stand-in for a request: a field vLLM starts
    reading would raise (or, read with getattr, key blocks differently from the engine)."""
    from vllm.v1.core import kv_cache_utils

    read = _request_fields_read(kv_cache_utils, "generate_block_hash_extra_keys", set())
    given = set(vars(vllm_hashing.request_stand_in(None, None)))
    missing = read - given
    assert read and not missing, (
        f"{pins.version('vllm')}: generate_block_hash_extra_keys reads request."
        f"{', request.'.join(sorted(missing))}, which {USER} request_stand_in lacks")


def test_a_lora_request_is_name_id_and_path_in_that_order():
    from vllm.lora.request import LoRARequest

    fields = list(getattr(LoRARequest, "__struct_fields__", ()) or
                  inspect.signature(LoRARequest).parameters)
    assert fields[:3] == ["lora_name", "lora_int_id", "lora_path"], (
        f"{pins.version('vllm')}: LoRARequest's first fields are {fields[:3]}; "
        f"{USER} block_extra_keys passes (name, id, path) by position")


def test_salt_and_adapter_keys_are_hashed_as_vllm_does():
    assert vllm_hashing.block_extra_keys(None, None, True) is None
    salted = vllm_hashing.block_extra_keys("s", None, True)
    assert salted and any("s" in (k if isinstance(k, tuple) else (k,)) for k in salted)
    assert vllm_hashing.block_extra_keys("s", None, False) is None  # the first block only
    adapter = vllm_hashing.block_extra_keys(None, ("a", "/p"), False)
    assert adapter and any("a" in (k if isinstance(k, tuple) else (k,)) for k in adapter)
