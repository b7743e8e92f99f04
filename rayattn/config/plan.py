"""Turn a validated RayAttnConfig into a deployment plan, rejecting combinations that cannot
run: wrong backend for the model or platform, unsupported head/block sizes or KV dtypes,
parallel layouts that do not divide the model.

The plan is what `rayattn check` prints and what the engine deployment and the KubeRay
renderer consume, so the three never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayattn import backends, compat
from rayattn.config import kv_capacity
from rayattn.config.architecture import Architecture, local_model_dir, lookup
from rayattn.config.router_tier import config_bounds
from rayattn.config.schema import RayAttnConfig
from rayattn.integrations import vllm_engine
from rayattn.integrations.vllm_parsers import parser_names
from rayattn.routing import policies

_ROCM_ACCELERATORS = {"MI300X", "MI325X", "MI355X"}
_CUDA_ACCELERATORS = {"H100", "H200", "B200"}


class PlanError(ValueError):
    """One or more problems, each naming the config field at fault."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass
class Plan:
    config: RayAttnConfig
    arch: Architecture
    backend: backends.BackendSpec
    backend_reason: str
    block_size: int
    env: dict[str, str]
    engine_kwargs: dict[str, Any]
    bundles: list[dict[str, float]]
    strategy: str
    replicas: int
    """Engine replicas at start (the autoscaling minimum when the engines autoscale)."""
    notes: list[str] = field(default_factory=list)
    adapters: dict[str, str] = field(default_factory=dict)
    """LoRA adapters by served name: the path (or id) engines load each from. vLLM hashes
    name and path into every block of an adapter's requests, so routers hash with these."""

    @property
    def replica_range(self) -> tuple[int, int]:
        """Fewest and most engine replicas (equal unless the engines autoscale)."""
        return self.config.engine_replica_range

    @property
    def gpus_per_replica(self) -> int:
        return 0 if self.config.platform.kind == "cpu" else \
            self.config.parallelism.gpus_per_replica

    @property
    def engines_per_node(self) -> int:
        """Engine replicas one GPU node holds (each owns TP × PP × its DP ranks' GPUs)."""
        per = self.gpus_per_replica
        return self.config.platform.gpus_per_node // per if per else 1

    @property
    def kv_bytes_per_token(self) -> int | None:
        c = self.config
        return kv_capacity.bytes_per_token(
            self.arch, c.attention.kv_cache_dtype,
            kv_capacity.native_bytes(c.model.dtype, c.platform.kind))

    def _kv_text(self) -> list[str]:
        c = self.config
        per_token = self.kv_bytes_per_token
        native = kv_capacity.native_bytes(c.model.dtype, c.platform.kind)
        lines = []
        if per_token:
            allowed = self.backend.kv_dtypes
            lever = ", ".join(f"{k}{'' if k in allowed else '*'} {v:,}" for k, v in
                              kv_capacity.levers(self.arch, native).items())
            lines.append(f"kv format:  {per_token:,} B/token with kv_cache_dtype="
                         f"{c.attention.kv_cache_dtype}; tokens per GiB: {lever}"
                         + (f" (* not with {self.backend.name})" if "*" in lever else ""))
        off = c.engine.kv_offload
        if off.enabled:
            tokens = f" ≈ {int(off.size_gib * kv_capacity.GIB // per_token):,} tokens" \
                if per_token and off.backend == "native" else ""
            lines.append(f"kv tiers:   GPU + host {off.size_gib:g} GiB per engine "
                         f"({off.backend}{tokens}), {self.engines_per_node} engine(s) per "
                         f"node = {off.size_gib * self.engines_per_node:g} GiB of "
                         f"{c.platform.host_memory_gib} GiB host memory")
        return lines

    def describe(self) -> str:
        c = self.config
        lines = [
            f"model:      {c.model.source} (served as {c.model.name!r})",
            f"arch:       {self.arch.kind.upper()}, {self.arch.num_attention_heads} heads, "
            f"head_dim {self.arch.head_dim}, moe={self.arch.is_moe}, sinks={self.arch.has_sinks}"
            f"  [from {self.arch.source}]",
            f"platform:   {c.platform.kind}"
            + (f" ({c.platform.accelerator_type})" if c.platform.accelerator_type else ""),
            f"backend:    {self.backend_reason}",
            f"kv cache:   dtype={c.attention.kv_cache_dtype}, block_size={self.block_size}, "
            f"prefix caching={c.engine.enable_prefix_caching} "
            f"({c.engine.prefix_caching_hash_algo}, PYTHONHASHSEED={c.engine.hash_seed})",
            f"parallel:   TP={c.parallelism.tensor_parallel_size} "
            f"PP={c.parallelism.pipeline_parallel_size} EP={c.parallelism.enable_expert_parallel}"
            f" DP-attention={c.parallelism.dp_attention}"
            + (f", {c.parallelism.dp_ranks} DP ranks per engine (each a routing target: "
               f"router.dp_rank_routing={c.router.dp_rank_routing})"
               if c.parallelism.dp_ranks > 1 else ""),
            f"replicas:   {self._replicas_text()} engine replica(s) (DP), "
            f"{self._routers_text()} router replica(s), policy={c.router.policy}",
            *self._kv_text(),
            f"placement:  {self.strategy} {self.bundles} per replica",
            "env:        " + ", ".join(f"{k}={v}" for k, v in sorted(self.env.items())),
        ]
        lora = c.model.lora
        if lora.enabled:
            lines.append(f"lora:       {', '.join(f'{n} <- {p}' for n, p in self.adapters.items())}"
                         f"; {lora.max_loras} per batch, {lora.cached} loaded per engine, "
                         f"rank <= {lora.max_lora_rank}")
        lines += [f"note:       {n}" for n in self.notes]
        return "\n".join(lines)

    def _replicas_text(self) -> str:
        lo, hi = self.replica_range
        if lo == hi:
            return str(lo)
        auto = self.config.serve.engine_autoscaling
        on = ", ".join([f"{auto.target_ongoing_requests:g} requests in flight",
                        *(f"{k}={v:g}" for k, v in auto.targets.items())]) if auto else ""
        return f"{lo}..{hi} (autoscaled on {on})" if on else f"{lo}..{hi} (autoscaled)"

    def _routers_text(self) -> str:
        c = self.config
        bounds = config_bounds(c)
        if bounds.fixed:
            return str(bounds)
        tier = c.serve.router_tier
        unset = tier.max_replicas is None
        return (f"{bounds} (on their CPU at {tier.target_cpu} cores each"
                + (", the most from the cluster's spare cores at start" if unset else "") + ")")


def _check(cfg: RayAttnConfig, arch: Architecture, spec: backends.BackendSpec,
           block_size: int) -> list[str]:
    """Every problem of the configuration for this model and backend, one line each naming
    the field."""
    return (_check_backend(cfg, arch, spec, block_size) + _check_parallelism(cfg, arch, spec)
            + _check_placement(cfg) + _check_kv_formats(cfg, arch)
            + _check_extra_kwargs(cfg.engine.extra_engine_kwargs)
            + _check_declared_once(cfg) + _check_frontend(cfg.model))


def _check_backend(cfg: RayAttnConfig, arch: Architecture, spec: backends.BackendSpec,
                   block_size: int) -> list[str]:
    """The attention backend against the platform and the model's attention."""
    p: list[str] = []
    plat, att = cfg.platform, cfg.attention
    if plat.kind not in spec.platforms:
        p.append(f"attention.backend: {spec.name} runs on {'/'.join(spec.platforms)}, not on "
                 f"platform.kind={plat.kind!r}; allowed on {plat.kind}: "
                 + ", ".join(n for n, b in backends.CATALOG.items() if plat.kind in b.platforms))
    if spec.kind != arch.kind:
        p.append(f"attention.backend: {spec.name} is an {spec.kind.upper()} backend but the model "
                 f"uses {arch.kind.upper()}; allowed: "
                 + ", ".join(n for n, b in backends.CATALOG.items()
                             if b.kind == arch.kind and plat.kind in b.platforms))
    if arch.has_sinks and not spec.supports_sinks:
        p.append(f"attention.backend: the model uses attention sinks and {spec.name} does not "
                 "support them; allowed: " + ", ".join(
                     n for n, b in backends.CATALOG.items()
                     if b.supports_sinks and plat.kind in b.platforms))
    if spec.head_sizes and arch.head_dim not in spec.head_sizes:
        p.append(f"attention.backend: {spec.name} supports head sizes {list(spec.head_sizes)}, "
                 f"the model's head size is {arch.head_dim}")
    if att.kv_cache_dtype not in spec.kv_dtypes:
        p.append(f"attention.kv_cache_dtype: {att.kv_cache_dtype!r} is not supported by "
                 f"{spec.name}; allowed: {', '.join(spec.kv_dtypes)}")
    if att.kv_cache_dtype.startswith("turboquant_") and spec.name != "TURBOQUANT":
        p.append("attention.kv_cache_dtype: turboquant_* KV needs attention.backend TURBOQUANT")
    if not spec.block_size_ok(block_size):
        p.append(f"attention.block_size: {block_size} is not supported by {spec.name}; "
                 f"allowed: {spec.allowed_block_sizes()}")
    return p


def _check_parallelism(cfg: RayAttnConfig, arch: Architecture,
                       spec: backends.BackendSpec) -> list[str]:
    """TP, EP, DP and their all-to-all against the model and the platform."""
    p: list[str] = []
    plat, par = cfg.platform, cfg.parallelism
    tp = par.tensor_parallel_size
    attn_tp = 1 if par.dp_attention else tp
    if arch.num_attention_heads % attn_tp:
        p.append(f"parallelism.tensor_parallel_size: {tp} does not divide the model's "
                 f"{arch.num_attention_heads} attention heads")
    if spec.name == "ROCM_AITER_MLA":
        heads = arch.num_attention_heads // attn_tp if arch.num_attention_heads % attn_tp == 0 \
            else 0
        if heads and heads % 16 and 16 % heads:
            p.append(f"parallelism.tensor_parallel_size: ROCM_AITER_MLA needs heads per GPU to "
                     f"be a multiple or divisor of 16, got {heads} "
                     f"({arch.num_attention_heads} heads / TP {attn_tp})")
    if par.enable_expert_parallel and not arch.is_moe:
        p.append("parallelism.enable_expert_parallel: the model has no experts (not MoE)")
    if par.dp_attention and not par.enable_expert_parallel:
        p.append("parallelism.dp_attention: needs parallelism.enable_expert_parallel=true")
    a2a = par.all2all_backend or ""
    if a2a.startswith("mori") and plat.kind != "rocm":
        p.append(f"parallelism.all2all_backend: {a2a} is AMD's (ROCm only)")
    if (a2a.startswith("deepep") or a2a == "pplx") and plat.kind != "cuda":
        p.append(f"parallelism.all2all_backend: {a2a} is CUDA-only; on ROCm use "
                 "mori_high_throughput, mori_low_latency or allgather_reducescatter")
    if a2a and not par.enable_expert_parallel:
        p.append("parallelism.all2all_backend: only used with enable_expert_parallel=true")
    return p


def _check_placement(cfg: RayAttnConfig) -> list[str]:
    """Where the replicas' devices come from, and the scheduler's batch against the model."""
    p: list[str] = []
    plat, par = cfg.platform, cfg.parallelism
    acc = plat.accelerator_type
    if acc and ((plat.kind == "rocm" and acc not in _ROCM_ACCELERATORS)
                or (plat.kind == "cuda" and acc not in _CUDA_ACCELERATORS)
                or plat.kind == "cpu"):
        p.append(f"platform.accelerator_type: {acc} does not match platform.kind={plat.kind!r}")
    if (plat.kind != "cpu" and cfg.serve.placement_strategy == "STRICT_PACK"
            and par.gpus_per_replica > plat.gpus_per_node):
        p.append(f"parallelism.tensor_parallel_size: {par.gpus_per_replica} GPUs a replica "
                 f"(TP×PP×DP ranks inside) do not "
                 f"fit one node of platform.gpus_per_node={plat.gpus_per_node} under "
                 "serve.placement_strategy STRICT_PACK")
    if plat.kind == "cpu" and par.devices_per_rank > 1:
        p.append("parallelism.tensor_parallel_size: rayattn runs CPU engines unsharded (1)")
    if par.dp_ranks > 1 and par.devices_per_rank > 1 and plat.kind != "cpu":
        # vLLM starts each rank's Ray executor with the first TP × PP bundles of the one
        # placement group (VLLM_RAY_BUNDLE_INDICES is process-wide): the ranks collide.
        p.append(f"parallelism: DP ranks inside an engine run on one device each here; "
                 f"{par.dp_ranks} ranks × {par.devices_per_rank} devices (TP × PP) would "
                 "share one placement group's bundles. Use parallelism.data_parallel_size "
                 "(engine replicas) for ranks of several devices")
    if par.dp_attention and par.engine_dp_size > 1:
        p.append("parallelism.engine_dp_size: dp_attention already makes the TP ranks the "
                 "engine's DP ranks; leave engine_dp_size at 1")
    if (cfg.model.max_model_len and cfg.engine.max_num_batched_tokens
            and not cfg.engine.enable_chunked_prefill
            and cfg.engine.max_num_batched_tokens < cfg.model.max_model_len):
        p.append("engine.max_num_batched_tokens: must be ≥ model.max_model_len when "
                 "enable_chunked_prefill is false")
    return p


HOST_RESERVE_GIB_PER_GPU = 32
"""Host memory kept for each GPU's engine processes (weights staging, Python, NCCL) before
any goes to KV offloading."""


def _check_kv_formats(cfg: RayAttnConfig, arch: Architecture) -> list[str]:
    """KV dtypes that do not apply to the model, and a host tier that cannot run or does
    not fit the node."""
    p: list[str] = []
    dtype, plat = cfg.attention.kv_cache_dtype, cfg.platform
    if dtype == "fp8_ds_mla" and not arch.is_mla:
        p.append("attention.kv_cache_dtype: fp8_ds_mla is DeepSeek's MLA latent format; "
                 "the model uses MHA (use fp8 or a turboquant_* preset)")
    if dtype.startswith("turboquant_") and arch.is_mla:
        p.append(f"attention.kv_cache_dtype: {dtype} packs MHA keys and values; for MLA "
                 "use fp8 or fp8_ds_mla")
    off = cfg.engine.kv_offload
    if not off.enabled:
        return p
    if plat.kind == "cpu":
        p.append("engine.kv_offload: vLLM's CPU build has no KV offloading (the KV cache is "
                 "already in host memory); set size_gib 0 on platform.kind cpu")
        return p
    if not cfg.engine.enable_prefix_caching:
        p.append("engine.kv_offload: offloaded blocks are found by their prefix hashes; "
                 "needs engine.enable_prefix_caching")
    per = cfg.parallelism.gpus_per_replica
    # Every DP rank inside an engine keeps a host tier of its own.
    engines = max(1, plat.gpus_per_node // per) * cfg.parallelism.dp_ranks
    need = engines * off.size_gib
    room = plat.host_memory_gib - HOST_RESERVE_GIB_PER_GPU * plat.gpus_per_node
    if off.backend == "native" and need > room:
        p.append(f"engine.kv_offload.size_gib: {engines} engine(s) or DP rank(s) per node × "
                 f"{off.size_gib:g} GiB = {need:g} GiB of pinned host memory, but a node "
                 f"has {room} GiB for it (platform.host_memory_gib {plat.host_memory_gib} "
                 f"less {HOST_RESERVE_GIB_PER_GPU} GiB per GPU for the engine processes)")
    return p


def _check_frontend(m: Any) -> list[str]:
    """Parser names against the installed vLLM's registries (skipped without vLLM), and a
    chat template given as a path must exist (vLLM would take a mistyped path for a
    one-line template)."""
    p = []
    for name_field, kind in (("reasoning_parser", "reasoning"), ("tool_call_parser", "tool")):
        name, known = getattr(m, name_field), parser_names(kind)
        if name is not None and known is not None and name not in known:
            p.append(f"model.{name_field}: {name!r} is not a {kind} parser of the installed vLLM "
                     f"{compat.vllm_version()} (known: {', '.join(sorted(known))})")
    t = m.chat_template
    if t is not None and not any(c in t for c in "{}\n") and not Path(t).expanduser().is_file():
        p.append(f"model.chat_template: {t!r} is neither a file nor a Jinja template")
    return p


# Set through the config's own fields (the router prices what they say): refused where the
# escape hatches would set them a second time.
_OWN_KWARGS = {"data_parallel_size": "parallelism.engine_dp_size (or dp_attention)",
               "enable_lora": "model.lora", "max_loras": "model.lora.max_loras",
               "max_cpu_loras": "model.lora.max_cpu_loras",
               "max_lora_rank": "model.lora.max_lora_rank"}
_OWN_ENV = {"VLLM_ENABLE_RESPONSES_API_STORE": "engine.responses_store",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "model.lora.runtime_updates"}


def _check_declared_once(cfg: RayAttnConfig) -> list[str]:
    e = cfg.engine
    return ([f"engine.extra_engine_kwargs: {k!r} is set by {f}" for k, f in _OWN_KWARGS.items()
             if k in e.extra_engine_kwargs]
            + [f"engine.env: {k} is set by {f}" for k, f in _OWN_ENV.items() if k in e.env])


def _check_extra_kwargs(extra: dict[str, Any]) -> list[str]:
    known = vllm_engine.engine_arg_names() if extra else None
    if known is None:  # nothing to check, or vLLM absent (manifests rendered on a laptop)
        return []
    return [f"engine.extra_engine_kwargs: {k!r} is not an AsyncEngineArgs field"
            for k in extra if k not in known]


def worker_in_engine_core(cfg: RayAttnConfig) -> bool:
    """Whether vLLM runs each rank's one CPU worker inside the rank's engine core process
    (engine_env says why, and sets what makes it so)."""
    omp_own = any(k.startswith(("OMP_", "VLLM_CPU_OMP")) for k in cfg.engine.env)
    return (cfg.platform.kind == "cpu" and cfg.parallelism.devices_per_rank == 1
            and not omp_own)


def engine_env(cfg: RayAttnConfig, spec: backends.BackendSpec) -> dict[str, str]:
    """The engine processes' environment: the platform's and the backend's, the hash seed
    the routers share, what the config's own fields switch on, then engine.env."""
    plat = cfg.platform.kind
    env = {**backends.PLATFORM_ENV[plat], **spec.env,
           "PYTHONHASHSEED": cfg.engine.hash_seed, "VLLM_NO_USAGE_STATS": "1"}
    if cfg.parallelism.devices_per_rank > 1 and plat != "cpu":
        # TP×PP > 1 per rank: vLLM's own Ray executor places the workers in the replica's placement
        # group and sets their device visibility itself, so Ray must not (RAY_EXPERIMENTAL_
        # NOSET_* on ROCm). A single-GPU replica keeps Ray's per-replica device assignment:
        # with NOSET there, every DP rank of a node would run on device 0.
        env.update(backends.RAY_EXECUTOR_ENV[plat])
    if worker_in_engine_core(cfg):
        # One CPU worker per rank: vLLM runs it inside the (rank's) engine core process
        # instead of spawning a worker process of its own (vllm/platforms/cpu.py switches
        # its `uni` executor to `mp` unless told), which saved an interpreter and vLLM's
        # imports at every start and the two processes' shared-memory polling at every
        # step. AsyncLLM's engine core stays a process of its own either way. vLLM forces
        # `mp` because its OpenMP set-up (thread binding) needs a process of its own:
        # right where rayattn's one unbound thread (PLATFORM_ENV) is not what the engine
        # runs, so not where engine.env sets OpenMP itself.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if plat == "rocm" and spec.name != "ROCM_AITER_FA":
        env.pop("VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT", None)
    if cfg.engine.responses_store:
        env["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"
    if cfg.model.lora.runtime_updates:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    env.update(cfg.engine.env)
    extra_copy = sorted(k for k in env if k.startswith(backends.RAY_EXTRA_ENV_PREFIXES))
    if extra_copy and cfg.parallelism.devices_per_rank > 1:  # only the Ray executor copies
        env["VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"] = ",".join(extra_copy)
    return env


def build_plan(cfg: RayAttnConfig, prepare_model: bool = False) -> Plan:
    arch = lookup(cfg.model, prepare=prepare_model)
    plat = cfg.platform.kind
    try:
        spec, reason = backends.resolve(cfg.attention.backend, plat, arch.kind)
    except ValueError as e:
        raise PlanError([str(e)]) from None
    block_size = cfg.attention.block_size or default_block_size(plat, spec)
    problems = _check(cfg, arch, spec, block_size)
    if problems:
        raise PlanError(problems)

    notes: list[str] = []
    env = engine_env(cfg, spec)

    kwargs = engine_kwargs(cfg, spec, block_size, prepare_model)
    if plat == "cpu" and arch.is_mla and cfg.attention.backend == "auto":
        # vLLM picks AMX_MLA itself where the CPU has AMX and CPU_MLA otherwise; forcing
        # CPU_MLA would turn prefix caching off.
        kwargs.pop("attention_backend")
        notes.append("MLA on CPU: vLLM picks AMX_MLA (keeps prefix caching) where the CPU has "
                     "AMX, else CPU_MLA (no prefix caching, no extend path)")
    if not cfg.engine.enable_prefix_caching and \
            policies.spec(cfg.router.policy).uses_prefix_cache:
        notes.append("prefix caching is off: the affinity router can only balance load")

    bundles, strategy = placement(cfg)
    replicas = cfg.engine_replica_range[0]
    if replicas == 1 and cfg.serve.engine_max_surge_percent == 0:
        notes.append("one engine replica and serve.engine_max_surge_percent 0: an engine "
                     "update stops it before its replacement serves (set the surge to 100 "
                     "if a spare replica's devices exist)")
    auto = cfg.serve.engine_autoscaling
    if auto is not None and auto.targets and auto.target_ongoing_requests * 4 <= (
            cfg.engine.max_num_seqs or 256):
        notes.append(f"engine autoscaling: {auto.target_ongoing_requests:g} requests in flight "
                     "per engine is a target too, and at that count it decides before "
                     f"{', '.join(auto.targets)} do; raise target_ongoing_requests toward what "
                     "one engine runs at once (engine.max_num_seqs) to scale on those")
    return Plan(cfg, arch, spec, reason, block_size, env, kwargs, bundles, strategy,
                replicas, notes, adapter_paths(cfg, prepare_model))


def adapter_paths(cfg: RayAttnConfig, prepare_model: bool) -> dict[str, str]:
    from rayattn.models.lora import resolve_adapter

    adapters = cfg.model.lora.adapters
    if not adapters:
        return {}
    base = local_model_dir(cfg.model.source, prepare=prepare_model)
    try:
        return {a.name: resolve_adapter(a.source, base, prepare_model) for a in adapters}
    except ValueError as e:
        raise PlanError([f"model.lora.adapters: {e}"]) from None


def default_block_size(platform: str, spec: backends.BackendSpec) -> int:
    default = backends.DEFAULT_BLOCK_SIZE[platform]
    if spec.block_size_ok(default):
        return default
    return spec.block_sizes[0] if spec.block_sizes else spec.block_size_multiple or default


def placement(cfg: RayAttnConfig) -> tuple[list[dict[str, float]], str]:
    """One bundle per GPU (the first also holds the replica actor); CPUs only on `cpu`.
    DP ranks of one device each (dp_attention, engine_dp_size) are one bundle of all their
    GPUs: vLLM starts those ranks as child processes of the replica, which must hold the
    devices itself (an actor takes resources from one bundle)."""
    plat, par = cfg.platform, cfg.parallelism
    if plat.kind == "cpu":
        bundles: list[dict[str, float]] = [{"CPU": plat.cpus_per_engine}]
        if cfg.serve.engine_node_resource:
            bundles[0][cfg.serve.engine_node_resource] = 0.001
        return bundles, "STRICT_PACK"
    if par.devices_per_rank == 1:
        bundles = [{"GPU": float(par.dp_ranks), "CPU": plat.cpus_per_engine}]
    else:
        bundles = [{"GPU": 1.0, "CPU": plat.cpus_per_engine}
                   for _ in range(par.gpus_per_replica)]
    if plat.accelerator_type:
        # Ray's per-node accelerator resource keeps replicas on the intended GPU model.
        bundles[0][f"accelerator_type:{plat.accelerator_type}"] = 0.001
    if cfg.serve.engine_node_resource:
        # A node declaring 1 of it takes up to 1000 replicas: only its own model's.
        bundles[0][cfg.serve.engine_node_resource] = 0.001
    return bundles, cfg.serve.placement_strategy


def engine_kwargs(cfg: RayAttnConfig, spec: backends.BackendSpec, block_size: int,
                  prepare_model: bool) -> dict[str, Any]:
    m, e, par = cfg.model, cfg.engine, cfg.parallelism
    local = local_model_dir(m.source, prepare=prepare_model)
    tp = 1 if par.dp_attention else par.tensor_parallel_size
    kw: dict[str, Any] = dict(
        model=str(local) if local else m.source,
        served_model_name=[m.name],
        dtype="float32" if m.dtype == "auto" and cfg.platform.kind == "cpu" else m.dtype,
        max_model_len=m.max_model_len,
        trust_remote_code=m.trust_remote_code,
        reasoning_parser=m.reasoning_parser,
        attention_backend=spec.name,
        kv_cache_dtype=cfg.attention.kv_cache_dtype,
        block_size=block_size,
        tensor_parallel_size=tp,
        pipeline_parallel_size=par.pipeline_parallel_size,
        data_parallel_size=par.dp_ranks,
        enable_expert_parallel=par.enable_expert_parallel,
        gpu_memory_utilization=e.gpu_memory_utilization,
        kv_cache_memory_bytes=e.kv_cache_memory_bytes,
        max_num_batched_tokens=e.max_num_batched_tokens,
        max_num_seqs=e.max_num_seqs,
        enable_prefix_caching=e.enable_prefix_caching,
        enable_chunked_prefill=e.enable_chunked_prefill,
        prefix_caching_hash_algo=e.prefix_caching_hash_algo,
        enforce_eager=e.enforce_eager or cfg.platform.kind == "cpu",
        # Stats stay on because rayattn always passes custom stat loggers (AsyncLLM keeps
        # log_stats when any are given, so RequestOutput.metrics still feeds the per-path
        # metrics); this only drops vLLM's default logging stat logger, which would print
        # one line per engine step once iteration details are enabled.
        disable_log_stats=True,
    )
    if par.all2all_backend:
        kw["all2all_backend"] = par.all2all_backend
    if m.lora.enabled:
        kw.update(enable_lora=True, max_loras=m.lora.max_loras,
                  max_cpu_loras=m.lora.max_cpu_loras, max_lora_rank=m.lora.max_lora_rank)
    if e.kv_offload.enabled:
        kw["kv_offloading_size"] = e.kv_offload.size_gib
        kw["kv_offloading_backend"] = e.kv_offload.backend
        if e.kv_offload.backend == "native" and e.kv_events:
            # vLLM fills in the connector and its CPU bytes from kv_offloading_size; this
            # only asks it to publish the tier's blocks with their real block hashes (and
            # tokens), which the routers' index keys on.
            kw["kv_transfer_config"] = {
                "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"self_describing_kv_events": True}}
    if par.devices_per_rank > 1:
        # Workers of one rank on several devices: vLLM's Ray executor places them in the
        # replica's placement group.
        kw["distributed_executor_backend"] = "ray"
    elif par.dp_ranks > 1:
        # DP ranks of one device each: vLLM's own processes on the devices Ray gave the
        # replica (placement()). Inside a Ray actor vLLM would pick its Ray executor for DP.
        # On CPU each rank's engine core runs its worker itself, as a one-rank engine does
        # (worker_in_engine_core): vLLM's DP default ("mp") starts one more process per
        # rank, importing vLLM and loading the model again. GPUs keep "mp" until measured.
        kw["distributed_executor_backend"] = "uni" if worker_in_engine_core(cfg) else "mp"
    kw = {k: v for k, v in kw.items() if v is not None}
    kw.update(e.extra_engine_kwargs)
    return kw


def frontend_kwargs(cfg: RayAttnConfig) -> dict[str, Any]:
    """vLLM's OpenAI frontend settings (`vllm serve` flags beyond the engine's): the same for
    the engines' serving layer and the routers' renderer, so both render prompts alike."""
    m = cfg.model
    return {
        "chat_template": m.chat_template,
        "tool_call_parser": m.tool_call_parser,
        "enable_auto_tool_choice": m.tool_call_parser is not None,
        "reasoning_parser": m.reasoning_parser,
        # usage.prompt_tokens_details.cached_tokens: clients see their prefix-cache hits.
        "enable_prompt_tokens_details": True,
        "served_model_name": [m.name],
    }


def cpu_shortfall(apps: list[tuple[str, RayAttnConfig]], cpus: float) -> str | None:
    """Where the CPU engines of `apps` reserve more of Ray's CPUs at start than a cluster of
    `cpus` has, one line naming what each model asks and the setting to change (a Ray
    placement group that cannot be placed waits forever, and the engine never starts);
    None where they fit."""
    asked = []
    for name, cfg in apps:
        if cfg.platform.kind != "cpu":
            continue
        plan = build_plan(cfg, prepare_model=False)
        asked.append((name, plan.replicas, sum(b.get("CPU", 0) for b in plan.bundles)))
    need = sum(n * c for _, n, c in asked)
    if need <= cpus + 1e-9:
        return None
    parts = ", ".join(f"{name}: {n} x {c:g}" for name, n, c in asked)
    return (f"the engines reserve {need:g} CPUs at start ({parts}; platform.cpus_per_engine "
            f"x engine replicas) but Ray has {cpus:g} here: lower platform.cpus_per_engine "
            f"or the engine replicas")
