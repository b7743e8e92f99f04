"""Catalog of vLLM attention backends rayattn can configure, with the facts that decide
whether a (model, platform, backend) combination can run.

The facts come from the backend classes in vLLM (`get_supported_head_sizes`,
`get_supported_kernel_block_sizes`, `supports_sink`, `supported_kv_cache_dtypes`, the metadata
builder's CUDA-graph support). The static table below holds them as vLLM `CATALOG_VLLM` has
them, because ROCm and CUDA backends do not import on every build and `rayattn check` must run
anywhere, vLLM or not. Where a vLLM in the supported range (rayattn.compat) is installed and a
backend's class imports, `resolve` overlays the installed class's facts (read by
rayattn/integrations/vllm_backends.py) on the static entry, so a plan is checked against the
vLLM that will run it. tests/unit/test_backends.py checks the static table against vLLM
`CATALOG_VLLM` and the overlay against whatever is installed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from rayattn import compat
from rayattn.integrations import vllm_backends

CATALOG_VLLM = "0.32.0"
"""The vLLM whose backend classes the static facts below were copied from."""

Kind = Literal["mha", "mla"]
_STD_KV = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class BackendSpec:
    name: str
    """AttentionBackendEnum member name, passed to vLLM as `attention_backend`."""
    platforms: tuple[str, ...]
    kind: Kind
    supports_sinks: bool
    head_sizes: tuple[int, ...] = ()
    """Supported head sizes; empty means any."""
    block_size_multiple: int | None = 16
    """Block sizes must be a multiple of this (None: only `block_sizes`)."""
    block_sizes: tuple[int, ...] = ()
    """Exact supported block sizes when the kernel takes a fixed list."""
    kv_dtypes: tuple[str, ...] = _STD_KV
    cudagraph: Literal["always", "uniform_batch", "never"] = "uniform_batch"
    env: dict[str, str] = field(default_factory=dict)
    """Environment the engine processes need for this backend."""
    notes: str = ""
    facts_from: str = f"static table (vLLM {CATALOG_VLLM})"
    """Where head/block sizes, KV dtypes and sinks come from: the static table, or the
    installed vLLM's backend class (see `installed`)."""

    def block_size_ok(self, block_size: int) -> bool:
        if block_size in self.block_sizes:
            return True
        return self.block_size_multiple is not None and block_size % self.block_size_multiple == 0

    def allowed_block_sizes(self) -> str:
        parts = [str(b) for b in self.block_sizes]
        if self.block_size_multiple:
            parts.append(f"multiples of {self.block_size_multiple}")
        return ", ".join(parts)


_AITER = {"VLLM_ROCM_USE_AITER": "1"}

CATALOG: dict[str, BackendSpec] = {
    b.name: b
    for b in [
        # --- ROCm MHA -------------------------------------------------------------
        BackendSpec(
            "ROCM_AITER_FA", ("rocm",), "mha", True, head_sizes=(64, 128, 256),
            block_size_multiple=None, block_sizes=(16, 32),
            env={**_AITER, "VLLM_ROCM_USE_AITER_MHA": "1",
                 # AITER's paged-attention decode reads a pre-shuffled KV layout.
                 "VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT": "1"},
            notes="Recommended MHA backend on ROCm: flash varlen prefill, chunked-context "
                  "extend with LSE merge, assembly paged-attention decode. Must be named "
                  "explicitly (vLLM's auto-selection picks ROCM_ATTN).",
        ),
        BackendSpec(
            "ROCM_AITER_UNIFIED_ATTN", ("rocm",), "mha", True,
            head_sizes=(32, 64, 80, 96, 128, 160, 192, 224, 256), cudagraph="always",
            env={**_AITER, "VLLM_ROCM_USE_AITER_MHA": "0",
                 "VLLM_ROCM_USE_AITER_UNIFIED_ATTENTION": "1"},
            notes="AITER's unified (single kernel for all paths) triton attention.",
        ),
        BackendSpec(
            "ROCM_ATTN", ("rocm",), "mha", False,
            head_sizes=(32, 64, 80, 96, 128, 160, 192, 224, 256), cudagraph="always",
            notes="vLLM's auto choice on ROCm; no sinks.",
        ),
        BackendSpec(
            "TRITON_ATTN", ("rocm", "cuda"), "mha", True, cudagraph="always",
            kv_dtypes=_STD_KV + ("int4_per_token_head", "int8_per_token_head",
                                 "fp8_per_token_head"),
            notes="Portable triton unified attention.",
        ),
        # --- ROCm MLA -------------------------------------------------------------
        BackendSpec(
            "ROCM_AITER_TRITON_MLA", ("rocm",), "mla", False, block_size_multiple=1,
            env={**_AITER, "VLLM_ROCM_USE_AITER_MLA": "1"},
            notes="Recommended MLA backend on ROCm: AITER assembly decode (absorbed), triton "
                  "flash-attention prefill/extend (non-absorbed, chunked context).",
        ),
        BackendSpec(
            "ROCM_AITER_MLA", ("rocm",), "mla", False, block_size_multiple=1,
            env={**_AITER, "VLLM_ROCM_USE_AITER_MLA": "1"},
            notes="AITER MLA with CK prefill. Decode kernels tile 16 heads: heads per GPU "
                  "must be a multiple or divisor of 16.",
        ),
        BackendSpec(
            "TRITON_MLA", ("rocm", "cuda"), "mla", False,
            kv_dtypes=("auto", "float16", "bfloat16", "fp8", "fp8_e4m3"),
            notes="Portable triton MLA.",
        ),
        # --- CUDA ---------------------------------------------------------------------
        BackendSpec("FLASH_ATTN", ("cuda",), "mha", False,
                    kv_dtypes=("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")),
        BackendSpec("FLASHINFER", ("cuda",), "mha", True, cudagraph="always",
                    notes="Sinks on Blackwell (TRTLLM kernels)."),
        BackendSpec("FLEX_ATTENTION", ("cuda",), "mha", False, cudagraph="always",
                    kv_dtypes=("auto", "float16", "bfloat16")),
        BackendSpec("FLASHMLA", ("cuda",), "mla", False, head_sizes=(320, 512, 576),
                    block_size_multiple=None, block_sizes=(64,),
                    kv_dtypes=("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")),
        BackendSpec("FLASH_ATTN_MLA", ("cuda",), "mla", False,
                    kv_dtypes=("auto", "float16", "bfloat16")),
        BackendSpec("CUTLASS_MLA", ("cuda",), "mla", False, block_size_multiple=None,
                    block_sizes=(128,),
                    kv_dtypes=("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")),
        BackendSpec("FLASHINFER_MLA", ("cuda",), "mla", False, block_size_multiple=None,
                    block_sizes=(32, 64),
                    kv_dtypes=("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")),
        BackendSpec("TURBOQUANT", ("cuda", "rocm"), "mha", False, block_size_multiple=None,
                    block_sizes=(16, 32, 64, 128),
                    kv_dtypes=("turboquant_k8v4", "turboquant_4bit_nc",
                               "turboquant_k3v4_nc", "turboquant_3bit_nc"),
                    notes="4/3-bit KV; selected with a turboquant_* kv_cache_dtype."),
        # --- CPU (what runs on this project's CI) -----------------------------------------
        BackendSpec("CPU_ATTN", ("cpu",), "mha", False,
                    head_sizes=(32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512),
                    block_size_multiple=32, kv_dtypes=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
                    cudagraph="never"),
        BackendSpec("AMX_MLA", ("cpu",), "mla", False, head_sizes=(576,),
                    block_size_multiple=32, kv_dtypes=("auto", "float16", "bfloat16"),
                    cudagraph="never",
                    notes="Chosen automatically on CPUs with AMX; keeps prefix caching."),
        BackendSpec("CPU_MLA", ("cpu",), "mla", False, head_sizes=(576,),
                    block_size_multiple=None, block_sizes=(16,), kv_dtypes=("auto",),
                    cudagraph="never",
                    notes="Disables prefix caching and chunked prefill in vLLM."),
    ]
}

# What `auto` resolves to: the seeds' recommendation on ROCm, vLLM's usual choice elsewhere.
RECOMMENDED: dict[tuple[str, Kind], str] = {
    ("rocm", "mha"): "ROCM_AITER_FA",
    ("rocm", "mla"): "ROCM_AITER_TRITON_MLA",
    ("cuda", "mha"): "FLASH_ATTN",
    ("cuda", "mla"): "FLASHMLA",
    ("cpu", "mha"): "CPU_ATTN",
    ("cpu", "mla"): "AMX_MLA",
}

DEFAULT_BLOCK_SIZE = {"rocm": 16, "cuda": 16, "cpu": 128}
"""vLLM's default KV block size per platform (CPU_ATTN needs a multiple of 32)."""

# The ROCm MLA backends pin the block size to 1 in vLLM's ROCm platform when unset; we
# keep vLLM's choice by not passing block_size unless the user does.
PLATFORM_ENV: dict[str, dict[str, str]] = {
    "rocm": {
        # RAY_EXPERIMENTAL_NOSET_* is not here: it is only right where vLLM's own Ray executor
        # runs the workers (TP×PP > 1); see RAY_EXECUTOR_ENV and rayattn/config/plan.py.
        "HIP_FORCE_DEV_KERNARG": "1",
        "NCCL_MIN_NCHANNELS": "112",
        "TORCH_NCCL_HIGH_PRIORITY": "1",
        "SAFETENSORS_FAST_GPU": "1",
    },
    "cuda": {},
    "cpu": {
        # One OpenMP thread per engine: several engines share few cores, and oversubscribed
        # OpenMP spinning made 32 tokens take seconds instead of tens of milliseconds.
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        # What vLLM's CPU platform sets at its engine config, set before any import: torch's
        # inductor reads them when imported, and a prestarted engine core (engine.prestart_core)
        # imports it before vLLM's config exists.
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
        "TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "1",
    },
}

# Set only for replicas whose engine runs vLLM's Ray executor (TP×PP > 1): there Ray must
# leave the device visibility variables alone in every actor, because vLLM's executor sets
# them itself for the workers it places in the replica's placement group (with Ray's
# per-actor HIP_VISIBLE_DEVICES the workers' GPUs are hidden, a known vLLM/Ray interaction). A
# single-GPU replica must NOT have them: its engine core then sees every GPU of the node and
# uses device 0, so all DP ranks of a node stack on GPU 0 and the second engine finds no
# memory for its cache blocks (the CUDA counterpart does the same).
# On CUDA vLLM's Ray executor sets CUDA_VISIBLE_DEVICES for its workers without it (a TP
# replica runs in its placement group, one GPU per worker: docs/log/gpu-first-run.md).
RAY_EXECUTOR_ENV: dict[str, dict[str, str]] = {
    "rocm": {
        "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1",
        "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES": "1",
    },
    "cuda": {},
    "cpu": {},
}

# vLLM's Ray executor copies only some prefixes (VLLM_, NCCL_, …) into its workers; these
# must be added through VLLM_RAY_EXTRA_ENV_VARS_TO_COPY.
RAY_EXTRA_ENV_PREFIXES = ("HIP_", "ROCR_", "SAFETENSORS_", "TORCH_NCCL_", "RAY_EXPERIMENTAL_")


def get(name: str) -> BackendSpec:
    """The static catalog entry (no vLLM needed)."""
    try:
        return CATALOG[name]
    except KeyError:
        raise ValueError(
            f"attention.backend: unknown backend {name!r}; allowed: auto, "
            + ", ".join(sorted(CATALOG))
        ) from None


def installed(spec: BackendSpec) -> BackendSpec:
    """`spec` with the facts of the installed vLLM's backend class where that class imports;
    the static entry unchanged where vLLM is absent or the class does not import here."""
    facts = vllm_backends.backend_facts(spec.name)
    if not facts:
        return spec
    facts = {k: v for k, v in facts.items() if k != "kind"}  # kind is checked by the tests
    return dataclasses.replace(spec, **facts,
                               facts_from=f"installed vLLM {compat.vllm_version()}")


def missing_from_installed(name: str) -> bool:
    """True when a vLLM is installed and its AttentionBackendEnum lacks `name` (e.g. AMX_MLA
    and CPU_MLA are not in vLLM 0.25)."""
    names = vllm_backends.installed_backend_names()
    return names is not None and name not in names


def resolve(name: str, platform: str, kind: Kind) -> tuple[BackendSpec, str]:
    """Return the backend (facts of the installed vLLM where readable) and a sentence saying
    how it was chosen and where its facts come from."""
    if name == "auto":
        chosen = RECOMMENDED[(platform, kind)]
        spec, why = CATALOG[chosen], f"auto -> {chosen} (recommended {kind.upper()} backend " \
                                     f"on {platform})"
    else:
        spec, why = get(name), f"{name} (named in config)"
    spec = installed(spec)
    why += f" [facts: {spec.facts_from}]"
    if missing_from_installed(spec.name):
        why += (f" [not a backend of the installed vLLM {compat.vllm_version()}: the engines "
                "need a vLLM that has it]")
    return spec, why
