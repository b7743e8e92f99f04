"""rayattn.integrations.devices: the engines' device report (vLLM's worker extension)."""

from __future__ import annotations

import asyncio
import dataclasses
import types

from rayattn.integrations import devices


def test_device_report_kwargs():
    assert devices.device_report_kwargs("cpu", {}) == {}
    kw = devices.device_report_kwargs("cuda", {})
    assert kw == {"worker_extension_cls": "rayattn.integrations.devices.DeviceReportExtension"}
    assert devices.device_report_kwargs("rocm", {"worker_extension_cls": "my.Ext"}) == {}
    from vllm.engine.arg_utils import AsyncEngineArgs

    assert "worker_extension_cls" in {f.name for f in dataclasses.fields(AsyncEngineArgs)}


def test_extension_does_not_clash_with_vllm_workers():
    # vLLM refuses an extension whose attributes the worker class already has.
    from vllm.v1.worker.worker_base import WorkerBase

    for attr in dir(devices.DeviceReportExtension):
        if not attr.startswith("__"):
            assert not hasattr(WorkerBase, attr), attr
    info = devices.DeviceReportExtension().rayattn_device_info()
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
    out = asyncio.run(devices.engine_device_info(rep))
    assert out["devices"] == ["GPU-a", "GPU-b"]
    assert out["worker_placement_groups"] == ["pg1", "pg1"]
    assert asyncio.run(devices.engine_device_info(rep)) is out and eng.calls == 1


def test_engine_device_info_on_cpu_and_on_failure():
    eng = _Engine(fail=True)
    assert asyncio.run(devices.engine_device_info(_replica("cpu", eng)))["devices"] == []
    assert eng.calls == 0
    out = asyncio.run(devices.engine_device_info(_replica("cuda", eng)))
    assert isinstance(out["devices"], list) and eng.calls == 1
