"""The devices an engine runs on: vLLM's workers report the UUIDs of their GPUs through a
worker extension (`collective_rpc`, on every vLLM version in the range), the replica reads its
own through NVML, and each says the Ray placement group it was scheduled in.

Module-level imports are standard library only: vLLM's worker processes import this module
(the worker extension).
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)


class DeviceReportExtension:
    """Mixed into vLLM's worker class (engine argument `worker_extension_cls`), so that
    `collective_rpc("rayattn_device_info")` returns, per worker (TP×PP order), the GPU it
    runs on and the Ray placement group it was scheduled in (None outside Ray actors)."""

    def rayattn_device_info(self) -> dict[str, Any]:
        device = getattr(self, "device", None)
        info: dict[str, Any] = {"pid": os.getpid(), "uuid": None, "placement_group": None,
                                "device": str(device)}
        try:
            import torch

            if device is not None and getattr(device, "type", "") == "cuda":
                info["uuid"] = _torch_uuid(torch.cuda.get_device_properties(device))
        except Exception as e:
            info["error"] = repr(e)
        info["placement_group"] = _current_placement_group()
        return info


_EXTENSION = f"{__name__}.DeviceReportExtension"


def device_report_kwargs(platform: str, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Engine arguments that let the engine report its devices: the worker extension on GPU
    platforms, unless the user configured an extension of their own."""
    if platform == "cpu" or engine_kwargs.get("worker_extension_cls"):
        return {}
    return {"worker_extension_cls": _EXTENSION}


async def engine_device_info(replica: Any) -> dict[str, Any]:
    """Devices of an EngineReplica's engine, computed once and cached on the replica:
    `devices` (GPU UUIDs, one per worker; [] on CPU), `worker_placement_groups` (the Ray
    placement group each worker runs in) and `placement_group` (the replica's own)."""
    cached = getattr(replica, "_rayattn_devices", None)
    if cached is not None:
        return cached
    platform = replica.cfg.platform.kind
    out: dict[str, Any] = {"devices": [], "worker_placement_groups": [],
                           "placement_group": _current_placement_group()}
    par = replica.cfg.parallelism
    if platform != "cpu" and par.dp_ranks > 1 and par.devices_per_rank == 1:
        # vLLM's DP client answers collective_rpc with rank 0's workers only; rank r of one
        # device each runs on the replica's r-th visible device.
        out["devices"] = local_device_uuids(platform)[:par.dp_ranks]
    if platform != "cpu" and not out["devices"]:
        try:
            workers = await replica.engine.collective_rpc("rayattn_device_info")
            out["devices"] = [w.get("uuid") for w in workers]
            out["worker_placement_groups"] = [w.get("placement_group") for w in workers]
        except Exception as e:  # no extension (user's own), or an older engine
            log.warning("engine did not report its devices (%r); using the replica's", e)
            out["devices"] = local_device_uuids(platform)
    replica._rayattn_devices = out
    return out


def local_device_uuids(platform: str) -> list[str]:
    """UUIDs of the GPUs visible to this process, through NVML (no CUDA context is made);
    [] on CPU or where they cannot be read."""
    if platform != "cuda":
        return []
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            n = pynvml.nvmlDeviceGetCount()
            ids = [x.strip() for x in visible.split(",") if x.strip()] if visible is not None \
                else [str(i) for i in range(n)]
            out = []
            for i in ids:
                h = (pynvml.nvmlDeviceGetHandleByUUID(i) if not i.isdigit()
                     else pynvml.nvmlDeviceGetHandleByIndex(int(i)))
                u = pynvml.nvmlDeviceGetUUID(h)
                out.append(u.decode() if isinstance(u, bytes) else u)
            return out
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return []


def _torch_uuid(props: Any) -> str | None:
    u = getattr(props, "uuid", None)
    if u is None:
        return None
    s = str(u)
    # torch prints the bare UUID; nvidia-smi and NVML name it GPU-<uuid>.
    return s if s.startswith(("GPU-", "MIG-")) else f"GPU-{s}"


def _current_placement_group() -> str | None:
    try:
        import ray

        if not ray.is_initialized():
            return None
        pg = ray.util.get_current_placement_group()
        return pg.id.hex() if pg is not None else None
    except Exception:
        return None
