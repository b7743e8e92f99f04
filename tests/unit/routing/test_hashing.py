"""The router's block keys are the engine's block hashes."""

from __future__ import annotations

import random

import pytest

from rayattn.routing.hashing import BlockHasher, to_key


@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_parity_with_vllm_request_block_hasher(block_size, algo, monkeypatch):
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    rng = random.Random(block_size)
    tokens = [rng.randrange(50_000) for _ in range(block_size * 5 + 3)]
    ours = BlockHasher(block_size, algo, seed="0")
    mine = ours.full_hashes(tokens)

    hash_fn = get_hash_fn_by_name(algo)
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # what every engine runs with
    init_none_hash(hash_fn)
    req = Request(request_id="r", prompt_token_ids=tokens,
                  sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                  block_hasher=get_request_block_hasher(block_size, hash_fn))
    assert len(mine) == 5 == len(req.block_hashes)
    assert mine == list(req.block_hashes)
    # Index keys are what vLLM's KV events carry for these blocks.
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    event_keys = [maybe_convert_block_hash(h) for h in req.block_hashes]
    assert all(isinstance(k, int) for k in event_keys)
    assert ours.keys(tokens) == event_keys
    assert [to_key(k) for k in event_keys] == event_keys


def test_chaining_makes_keys_prefix_dependent():
    h = BlockHasher(4)
    a = h.keys([1, 2, 3, 4, 5, 6, 7, 8])
    b = h.keys([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[1] != b[1]  # same second block, different prefix
    assert h.keys([1, 2, 3, 4, 5, 6, 7, 8, 9]) == a  # partial trailing block not hashed
    assert BlockHasher(4, seed="1").keys([1, 2, 3, 4]) != h.keys([1, 2, 3, 4])


@pytest.mark.parametrize("salt", ["tenant-a", "tenant-b:client-salt"])
def test_a_cache_salt_keys_every_block_as_vllm_does(salt, monkeypatch):
    """Salted requests (per-tenant isolation) keep exact affinity: the router's keys are
    vLLM's hashes of the salted request, and differ from the unsalted prompt's in every
    block (chaining carries the first block's salt)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    bs = 16
    tokens = [random.Random(7).randrange(50_000) for _ in range(bs * 4 + 1)]
    hash_fn = get_hash_fn_by_name("sha256")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    init_none_hash(hash_fn)
    req = Request(request_id="r", prompt_token_ids=tokens,
                  sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                  cache_salt=salt, block_hasher=get_request_block_hasher(bs, hash_fn))
    ours = BlockHasher(bs, "sha256", seed="0")
    assert ours.full_hashes(tokens, salt=salt) == list(req.block_hashes)
    plain = ours.keys(tokens)
    assert all(a != b for a, b in zip(ours.keys(tokens, salt=salt), plain, strict=True))


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_a_lora_adapter_keys_every_block_as_vllm_does(salt, monkeypatch):
    """A prompt under a LoRA adapter is cached under other blocks than the base model's and
    another adapter's (vLLM hashes the adapter into every block): the router's keys are
    vLLM's hashes of the adapter's request, with or without a cache salt."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    bs = 16
    tokens = [random.Random(9).randrange(50_000) for _ in range(bs * 4 + 5)]
    hash_fn = get_hash_fn_by_name("sha256")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    init_none_hash(hash_fn)
    ours = BlockHasher(bs, "sha256", seed="0")
    keys = {}
    for name, int_id in (("pirate", 1), ("poet", 7)):
        path = f"/models/lora-{name}"
        req = Request(request_id=name, prompt_token_ids=tokens,
                      sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                      cache_salt=salt, lora_request=LoRARequest(name, int_id, path),
                      block_hasher=get_request_block_hasher(bs, hash_fn))
        assert ours.full_hashes(tokens, salt=salt, adapter=(name, path)) == \
            list(req.block_hashes)
        keys[name] = ours.keys(tokens, salt=salt, adapter=(name, path))
    base = ours.keys(tokens, salt=salt)
    for a, b, c in zip(keys["pirate"], keys["poet"], base, strict=True):
        assert len({a, b, c}) == 3
    # A conversation's next turn hashes only its new blocks: the same keys as from scratch.
    full = ours.full_hashes(tokens, salt=salt, adapter=("poet", "/models/lora-poet"))
    grown = tokens + [5] * bs
    assert ours.full_hashes(grown, full[:2], salt, ("poet", "/models/lora-poet")) == \
        ours.full_hashes(grown, salt=salt, adapter=("poet", "/models/lora-poet"))
