"""Catalog of vLLM attention backends rayattn can configure, with the facts that decide
whether a (model, platform, backend) combination can run.

The facts come from the backend classes in vLLM (`get_supported_head_sizes`,
`get_supported_kernel_block_sizes`, `supports_sink`, `supported_kv_cache_dtypes`, the metadata
builder's CUDA-graph support). They are written out here, not imported, because ROCm and CUDA
backends do not import on other platforms and `rayattn check` must run anywhere;
tests/unit/test_backends.py checks every entry against the installed vLLM where it imports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

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
        # Ray would otherwise rewrite HIP_VISIBLE_DEVICES per actor, hiding the GPUs vLLM's
        # own Ray workers were assigned (vLLM PR 21522 / Ray issue 53737).
        "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1",
        "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES": "1",
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
    },
}

# vLLM's Ray executor copies only some prefixes (VLLM_, NCCL_, …) into its workers; these
# must be added through VLLM_RAY_EXTRA_ENV_VARS_TO_COPY.
RAY_EXTRA_ENV_PREFIXES = ("HIP_", "ROCR_", "SAFETENSORS_", "TORCH_NCCL_", "RAY_EXPERIMENTAL_")


def get(name: str) -> BackendSpec:
    try:
        return CATALOG[name]
    except KeyError:
        raise ValueError(
            f"attention.backend: unknown backend {name!r}; allowed: auto, "
            + ", ".join(sorted(CATALOG))
        ) from None


def resolve(name: str, platform: str, kind: Kind) -> tuple[BackendSpec, str]:
    """Return the backend and a sentence saying how it was chosen."""
    if name == "auto":
        chosen = RECOMMENDED[(platform, kind)]
        why = f"recommended {kind.upper()} backend on {platform}"
        return CATALOG[chosen], f"auto -> {chosen} ({why})"
    return get(name), f"{name} (named in config)"
