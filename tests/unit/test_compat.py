"""rayattn.compat: the vLLM-version differences, against the installed vLLM."""

from __future__ import annotations

import asyncio
import dataclasses
import types

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
    assert compat.engine_env_defaults("cuda") == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    assert compat.engine_env_defaults("cpu") == {}
    env = {"VLLM_USE_FLASHINFER_SAMPLER": "1"}
    assert compat.apply_engine_env(env, "cuda") == {}  # the user's setting wins
    env = {}
    assert compat.apply_engine_env(env, "rocm") == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    monkeypatch.setattr(compat, "flashinfer_available", lambda: True)
    assert compat.engine_env_defaults("cuda") == {}


def test_device_report_kwargs():
    assert compat.device_report_kwargs("cpu", {}) == {}
    kw = compat.device_report_kwargs("cuda", {})
    assert kw == {"worker_extension_cls": "rayattn.compat.DeviceReportExtension"}
    assert compat.device_report_kwargs("rocm", {"worker_extension_cls": "my.Ext"}) == {}
    from vllm.engine.arg_utils import AsyncEngineArgs

    assert "worker_extension_cls" in {f.name for f in dataclasses.fields(AsyncEngineArgs)}


def test_extension_does_not_clash_with_vllm_workers():
    # vLLM refuses an extension whose attributes the worker class already has.
    from vllm.v1.worker.worker_base import WorkerBase

    for attr in dir(compat.DeviceReportExtension):
        if not attr.startswith("__"):
            assert not hasattr(WorkerBase, attr), attr
    info = compat.DeviceReportExtension().rayattn_device_info()
    assert info["uuid"] is None and info["placement_group"] is None


class _Engine:
    def __init__(self, workers=None, fail=False):
        self.workers, self.fail, self.calls = workers, fail, 0

    async def collective_rpc(self, method):
        self.calls += 1
        assert method == "rayattn_device_info"
        if self.fail:
            raise RuntimeError("no such method")
        return self.workers


def _replica(platform, engine):
    from rayattn.config.schema import ParallelismConfig

    cfg = types.SimpleNamespace(platform=types.SimpleNamespace(kind=platform),
                                parallelism=ParallelismConfig())
    return types.SimpleNamespace(cfg=cfg, engine=engine)


# Plain asyncio.run: these also run where pytest-asyncio is absent (the GPU machine).
def test_engine_device_info_reports_worker_uuids_once():
    eng = _Engine([{"uuid": "GPU-a", "placement_group": "pg1"},
                   {"uuid": "GPU-b", "placement_group": "pg1"}])
    rep = _replica("cuda", eng)
    out = asyncio.run(compat.engine_device_info(rep))
    assert out["devices"] == ["GPU-a", "GPU-b"]
    assert out["worker_placement_groups"] == ["pg1", "pg1"]
    assert asyncio.run(compat.engine_device_info(rep)) is out and eng.calls == 1


def test_engine_device_info_on_cpu_and_on_failure():
    eng = _Engine(fail=True)
    assert asyncio.run(compat.engine_device_info(_replica("cpu", eng)))["devices"] == []
    assert eng.calls == 0
    out = asyncio.run(compat.engine_device_info(_replica("cuda", eng)))
    assert isinstance(out["devices"], list) and eng.calls == 1


def test_tcpstore_port_window_per_ray_executor_engine(monkeypatch):
    """vLLM 0.25: every TP > 1 engine of a node probed TCPStore port 100 (DP2 × TP2 on
    4 × H200 failed with EADDRINUSE); each such engine gets its own window."""
    monkeypatch.setattr(compat, "flashinfer_available", lambda: True)
    monkeypatch.setattr(compat, "tcpstore_port_race", lambda: True)
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


class _Controller:
    """Serve's controller as compat.serve_autoscales calls it (one deployment's config)."""

    def __init__(self, configs: dict | Exception) -> None:
        self.configs, self.asked = configs, []

        async def remote(deployment_id):
            self.asked.append(deployment_id)
            if isinstance(self.configs, Exception):
                raise self.configs
            return self.configs.get((deployment_id.app_name, deployment_id.name))

        self.get_deployment_config = type("Method", (), {"remote": staticmethod(remote)})


def test_serve_autoscales_reads_one_deployments_config(monkeypatch):
    # Plain asyncio.run: the GPU image's pytest has no asyncio plugin.
    from ray.serve._private.config import DeploymentConfig

    def config(**auto):
        return DeploymentConfig(autoscaling_config=auto or None,
                                num_replicas=None if auto else 2)

    ctl = _Controller({("app", "elastic"): config(min_replicas=1, max_replicas=3),
                       ("app", "pinned"): config(min_replicas=2, max_replicas=2),
                       ("app", "fixed"): config()})
    monkeypatch.setattr(compat, "_serve_controller", lambda: ctl)
    assert asyncio.run(compat.serve_autoscales("app", "elastic")) is True
    assert asyncio.run(compat.serve_autoscales("app", "pinned")) is False  # bounds equal
    assert asyncio.run(compat.serve_autoscales("app", "fixed")) is False
    assert asyncio.run(compat.serve_autoscales("app", "gone")) is None  # no answer, not "no"
    assert [(d.app_name, d.name) for d in ctl.asked] == [
        ("app", "elastic"), ("app", "pinned"), ("app", "fixed"), ("app", "gone")]
    monkeypatch.setattr(compat, "_serve_controller", lambda: _Controller(RuntimeError("down")))
    assert asyncio.run(compat.serve_autoscales("app", "elastic")) is None
