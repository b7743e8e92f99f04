"""Device visibility and placement on multi-GPU nodes, per platform and TP.

Rule (rayattn/backends.py RAY_EXECUTOR_ENV, rayattn/config/plan.py): a single-GPU replica
keeps Ray's per-replica device assignment (Ray sets CUDA_/HIP_/ROCR_VISIBLE_DEVICES for the
replica actor and its engine core inherits it), so no RAY_EXPERIMENTAL_NOSET_* there: with it
every DP rank of a node ran on device 0 (2 × H200, see docs/log/gpu-first-run.md). Only where
vLLM's own Ray executor runs the workers (TP×PP > 1) is NOSET set, on ROCm, and copied to the
workers through VLLM_RAY_EXTRA_ENV_VARS_TO_COPY.
"""

from __future__ import annotations

import pytest

from rayattn.app import engine_options
from rayattn.config.loader import parse_args
from rayattn.config.plan import build_plan

NOSET = {"rocm": ["RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES",
                  "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES"],
         "cuda": ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]}
ALL_NOSET = [v for vs in NOSET.values() for v in vs]


def _plan(platform: str, tp: int, dp: int = 2, pp: int = 1, env: dict | None = None):
    backend = "ROCM_AITER_FA" if platform == "rocm" else "FLASH_ATTN"
    args = {"model": {"source": "meta-llama/Llama-3.1-8B-Instruct"},
            "platform": {"kind": platform, "gpus_per_node": 8},
            "attention": {"backend": backend},
            "parallelism": {"tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                            "data_parallel_size": dp},
            "engine": {"env": env or {}}}
    return build_plan(parse_args(args))


@pytest.mark.parametrize("platform", ["rocm", "cuda"])
def test_single_gpu_replicas_keep_rays_device_assignment(platform):
    plan = _plan(platform, tp=1, dp=8)
    assert not [v for v in ALL_NOSET if v in plan.env], plan.env
    assert "distributed_executor_backend" not in plan.engine_kwargs  # in-process worker
    assert plan.bundles == [{"GPU": 1.0, "CPU": 1.0}] and plan.replicas == 8
    # Each DP rank's replica actor holds its one GPU: Ray sets its visibility variable.
    opts = engine_options(plan)
    assert opts["ray_actor_options"]["num_gpus"] == 1 and opts["num_replicas"] == 8
    assert opts["name"] == "engine" and opts["placement_group_strategy"] == "STRICT_PACK"
    assert not [v for v in ALL_NOSET if v in opts["ray_actor_options"]["runtime_env"]["env_vars"]]


@pytest.mark.parametrize("tp,pp", [(2, 1), (8, 1), (2, 2)])
def test_rocm_ray_executor_replicas_set_noset_and_copy_it(tp, pp):
    plan = _plan("rocm", tp=tp, pp=pp, dp=1)
    for var in NOSET["rocm"]:
        assert plan.env[var] == "1"
        assert var in plan.env["VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"].split(",")
    assert plan.engine_kwargs["distributed_executor_backend"] == "ray"
    assert len(plan.bundles) == tp * pp and all(b["GPU"] == 1 for b in plan.bundles)
    opts = engine_options(plan)
    # The replica actor holds no GPU itself: vLLM's Ray workers take the bundles' GPUs.
    assert opts["ray_actor_options"]["num_gpus"] == 0
    assert opts["placement_group_bundles"] == plan.bundles


@pytest.mark.parametrize("tp", [2, 8])
def test_cuda_ray_executor_replicas_need_no_noset(tp):
    # vLLM's Ray executor sets CUDA_VISIBLE_DEVICES for its workers itself; TP2 ran inside
    # the replica's placement group on 2 × H200 without any NOSET variable.
    plan = _plan("cuda", tp=tp, dp=1)
    assert not [v for v in ALL_NOSET if v in plan.env], plan.env
    assert plan.engine_kwargs["distributed_executor_backend"] == "ray"
    assert engine_options(plan)["ray_actor_options"]["num_gpus"] == 0


def test_user_env_still_wins():
    plan = _plan("rocm", tp=1, env={"RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1"})
    assert plan.env["RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"] == "1"


def test_rocm_platform_env_kept_at_tp1():
    plan = _plan("rocm", tp=1)
    assert plan.env["HIP_FORCE_DEV_KERNARG"] == "1"
    assert plan.env["VLLM_ROCM_USE_AITER"] == "1"


@pytest.mark.parametrize("platform", ["rocm", "cuda"])
@pytest.mark.parametrize("how", ["dp_attention", "engine_dp_size"])
def test_dp_ranks_of_one_gpu_each_are_one_bundle_the_replica_holds(platform, how):
    """vLLM starts an engine's DP ranks as child processes of the replica: the replica actor
    holds all their GPUs (one bundle), Ray sets their visibility, no Ray executor."""
    args = {"model": {"source": "deepseek-ai/DeepSeek-V3"},
            "platform": {"kind": platform, "gpus_per_node": 8},
            "attention": {"backend": "TRITON_MLA"},
            "parallelism": ({"tensor_parallel_size": 4, "enable_expert_parallel": True,
                             "dp_attention": True} if how == "dp_attention"
                            else {"engine_dp_size": 4, "data_parallel_size": 2})}
    plan = build_plan(parse_args(args))
    assert plan.engine_kwargs["data_parallel_size"] == 4
    assert plan.engine_kwargs["tensor_parallel_size"] == 1
    assert plan.engine_kwargs["distributed_executor_backend"] == "mp"
    assert plan.bundles == [{"GPU": 4.0, "CPU": 1.0}]
    assert plan.engines_per_node == 2
    opts = engine_options(plan)
    assert opts["ray_actor_options"]["num_gpus"] == 4.0
    assert not [v for v in ALL_NOSET if v in plan.env]


def test_dp_ranks_of_several_gpus_each_are_refused():
    """Each rank's Ray executor would take the same bundles of the replica's one placement
    group: refused with the way out, not started to hang."""
    from rayattn.config.plan import PlanError

    args = {"model": {"source": "meta-llama/Llama-3.1-8B-Instruct"},
            "platform": {"kind": "cuda", "gpus_per_node": 8},
            "attention": {"backend": "FLASH_ATTN"},
            "parallelism": {"tensor_parallel_size": 2, "engine_dp_size": 2}}
    with pytest.raises(PlanError, match="parallelism.data_parallel_size"):
        build_plan(parse_args(args))
