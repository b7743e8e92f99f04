"""Facts of the installed vLLM kept on disk per installation: read once, then from disk."""

from __future__ import annotations

from rayattn.integrations import vllm_facts


def test_a_fact_is_read_once_per_installation_then_from_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYATTN_CACHE", str(tmp_path))
    reads: list[str] = []

    def read() -> list[str]:
        reads.append("read")
        return ["A", "B"]

    assert vllm_facts.cached("names", read) == ["A", "B"]
    assert vllm_facts.cached("names", read) == ["A", "B"]
    assert reads == ["read"]
    (kept,) = (tmp_path / "vllm-facts").iterdir()
    # Another installation (a reinstall, another venv) has facts of its own.
    monkeypatch.setattr(vllm_facts, "_installation", lambda: "another vLLM")
    assert vllm_facts.cached("names", read) == ["A", "B"] and len(reads) == 2
    assert len(list((tmp_path / "vllm-facts").iterdir())) == 2
    # A damaged file is read again, not trusted.
    kept.write_text("{not json")
    monkeypatch.undo()
    monkeypatch.setenv("RAYATTN_CACHE", str(tmp_path))
    assert vllm_facts.cached("names", read) == ["A", "B"] and len(reads) == 3


def test_backend_facts_from_disk_equal_those_read_from_vllm(tmp_path, monkeypatch):
    from rayattn.integrations import vllm_backends

    monkeypatch.setenv("RAYATTN_CACHE", str(tmp_path))
    fresh = vllm_backends._read_facts("CPU_ATTN")
    vllm_backends.backend_facts.cache_clear()
    vllm_backends.installed_backend_names.cache_clear()
    try:
        first = vllm_backends.backend_facts("CPU_ATTN")
        vllm_backends.backend_facts.cache_clear()
        again = vllm_backends.backend_facts("CPU_ATTN")  # from the file
    finally:
        vllm_backends.backend_facts.cache_clear()
        vllm_backends.installed_backend_names.cache_clear()
    assert fresh is not None and first == fresh and again == fresh


def test_a_failed_read_is_read_again_unless_told_to_keep_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYATTN_CACHE", str(tmp_path))
    answers = iter([None, ["A"]])
    assert vllm_facts.cached("names", lambda: next(answers)) is None
    assert vllm_facts.cached("names", lambda: next(answers)) == ["A"]  # read again
    reads: list[int] = []
    assert vllm_facts.cached("cls", lambda: reads.append(1), keep_none=True) is None
    assert vllm_facts.cached("cls", lambda: reads.append(1), keep_none=True) is None
    assert reads == [1]
