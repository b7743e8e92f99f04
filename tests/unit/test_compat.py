"""rayattn.compat: the vLLM-version differences, against the installed vLLM."""

from __future__ import annotations

import dataclasses
import types

import pytest

from rayattn import compat


def test_version_range_and_parsing():
    assert compat.version_tuple("0.25.0") == (0, 25)
    assert compat.version_tuple("0.32.0+cpu") == (0, 32)
    assert compat.version_tuple("0.26.0rc1") == (0, 26)
    assert compat.is_supported("0.25.0") and compat.is_supported("0.32.1")
    assert not compat.is_supported("0.24.3") and not compat.is_supported("0.33.0")
    assert compat.vllm_version() is not None


def test_iteration_details_probe_matches_scheduler_stats():
    from vllm.v1.metrics.stats import SchedulerStats

    names = {f.name for f in dataclasses.fields(SchedulerStats)}
    assert compat.has_iteration_details() == ("iteration_details" in names)


def test_step_metrics_kwargs(monkeypatch, caplog):
    m = types.SimpleNamespace(step_metrics_available=None)
    monkeypatch.setattr(compat, "has_iteration_details", lambda: True)
    assert compat.step_metrics_kwargs(m) == {"enable_logging_iteration_details": True}
    assert m.step_metrics_available is True
    # vLLM 0.25: no flag (it would log a line per step), gauge 0, one warning only.
    monkeypatch.setattr(compat, "has_iteration_details", lambda: False)
    monkeypatch.setattr(compat, "_step_warning_logged", False)
    with caplog.at_level("WARNING", logger="rayattn.compat"):
        assert compat.step_metrics_kwargs(m) == {}
        assert compat.step_metrics_kwargs(m) == {}
    assert m.step_metrics_available is False
    assert sum("per-step" in r.message for r in caplog.records) == 1


def test_flashinfer_sampler_env(monkeypatch):
    monkeypatch.setattr(compat, "flashinfer_available", lambda: False)
    monkeypatch.setattr(compat, "torch_libgomp", lambda: None)
    assert compat.engine_env_defaults("cuda") == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    assert compat.engine_env_defaults("cpu") == {}
    env = {"VLLM_USE_FLASHINFER_SAMPLER": "1"}
    assert compat.apply_engine_env(env, "cuda") == {}  # the user's setting wins
    env = {}
    assert compat.apply_engine_env(env, "rocm") == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    monkeypatch.setattr(compat, "flashinfer_available", lambda: True)
    assert compat.engine_env_defaults("cuda") == {}


def test_tcpstore_port_window_per_ray_executor_engine(monkeypatch):
    """vLLM 0.25: every TP > 1 engine of a node probed TCPStore port 100 (DP2 × TP2 on
    4 × H200 failed with EADDRINUSE); each such engine gets its own window."""
    monkeypatch.setattr(compat, "flashinfer_available", lambda: True)
    monkeypatch.setattr(compat, "tcpstore_port_race", lambda: True)
    monkeypatch.setattr(compat, "torch_libgomp", lambda: None)
    tp2 = {"distributed_executor_backend": "ray", "data_parallel_size": 1}
    ports = {int(compat.engine_env_defaults("cuda", tp2)["VLLM_DP_MASTER_PORT"])
             for _ in range(3)}
    assert all(p > 0 for p in ports)
    assert compat.engine_env_defaults("cuda", {}) == {}  # TP1: in-process worker
    assert compat.engine_env_defaults("cpu", tp2) == {}
    # vLLM's own DP (dp_attention) owns the variable.
    assert compat.engine_env_defaults("rocm", {**tp2, "data_parallel_size": 8}) == {}
    env = {"VLLM_DP_MASTER_PORT": "31000"}  # the user's setting wins
    assert compat.apply_engine_env(env, "cuda", tp2) == {}
    assert env["VLLM_DP_MASTER_PORT"] == "31000"
    monkeypatch.setattr(compat, "tcpstore_port_race", lambda: False)
    assert compat.engine_env_defaults("cuda", tp2) == {}


def test_tcpstore_port_race_probe_matches_installed_vllm():
    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

    compat.tcpstore_port_race.cache_clear()
    assert compat.tcpstore_port_race() == hasattr(RayExecutorV2, "_select_tcpstore_port")


def test_cpu_engines_preload_pytorchs_openmp_before_any_engine_process_starts(monkeypatch):
    """vLLM's CPU platform sets LD_PRELOAD to PyTorch's libgomp while building its config; a
    prestarted engine core started before that, and the loader reads it only at a start."""
    found = compat.torch_libgomp()
    if found is None:
        pytest.skip("this torch has no libgomp of its own")
    assert "libgomp" in found and found.endswith(tuple(f".so{s}" for s in ("", ".1")))
    assert compat.engine_env_defaults("cpu") == {"LD_PRELOAD": found}
    env = {"LD_PRELOAD": "/opt/libiomp5.so"}
    assert compat.apply_engine_env(env, "cpu") == {}  # the user's (or vLLM's own) wins
    monkeypatch.setattr(compat, "flashinfer_available", lambda: True)
    assert "LD_PRELOAD" not in compat.engine_env_defaults("cuda")
