"""Config model and `rayattn check`: valid deployments pass, impossible combinations are
rejected with a message naming the field."""

from __future__ import annotations

import copy
import typing
from pathlib import Path

import pytest
import yaml

from rayattn.cli import main
from rayattn.config.loader import ConfigError, parse_args
from rayattn.config.plan import PlanError, build_plan
from rayattn.config.schema import KVCacheDType, PrefixCachingHashAlgo
from rayattn.integrations.vllm_engine import config_objects
from rayattn.integrations.vllm_parsers import parser_names

ROOT = Path(__file__).resolve().parents[3]
DEPLOYMENTS = sorted((ROOT / "deployments").glob("*.yaml"))


def test_several_models_share_sections_and_differ_where_an_entry_says():
    from rayattn.config.loader import ConfigError, load_serve_config, rayattn_apps

    apps = dict(rayattn_apps(load_serve_config(ROOT / "deployments" / "local-multi.yaml")))
    smol, tiny = apps["rayattn-multi/smollm2"], apps["rayattn-multi/tiny-llama"]
    # Shared: the platform, the block size, max_num_seqs; the tiny model's own KV size.
    assert smol.platform == tiny.platform and smol.attention == tiny.attention
    assert smol.engine.max_num_seqs == tiny.engine.max_num_seqs == 32
    assert (smol.engine.kv_cache_memory_bytes, tiny.engine.kv_cache_memory_bytes) == \
        (1 << 30, 256 << 20)
    # Replica counts from each model's own engine deployment entry.
    assert (smol.parallelism.data_parallel_size, tiny.parallelism.data_parallel_size) == (2, 1)
    assert [a.name for a in smol.model.lora.adapters] == ["smollm2-pirate", "smollm2-poet"]
    assert not tiny.model.lora.enabled

    from rayattn.config.loader import parse_models

    base = {"platform": {"kind": "cpu"}, "engine": {"kv_cache_memory_bytes": 1 << 30}}
    for shared in ("router", "tracing"):
        with pytest.raises(ConfigError, match=f"models.1.{shared}: shared by every model"):
            parse_models({**base, "models": [{"model": {"source": "a"}},
                                             {"model": {"source": "b"}, shared: {}}]})
    with pytest.raises(ConfigError, match="models.1.engine.max_num_seqs"):
        parse_models({**base, "models": [{"model": {"source": "a"}}, {
            "model": {"source": "b"}, "engine": {"max_num_seqs": 0}}]})
    with pytest.raises(ConfigError, match="give engine deployments"):
        parse_models({**base, "models": [{"model": {"source": "o/m", "served_name": "o/m"}},
                                         {"model": {"source": "o-m"}}]})
    with pytest.raises(ConfigError, match="served names must be distinct"):
        parse_models({**base, "models": [{"model": {"source": "x/a"}},
                                         {"model": {"source": "y/a"}}]})
    with pytest.raises(ConfigError, match="needs its own name"):
        parse_models({**base, "models": [
            {"model": {"source": "a", "lora": {"adapters": [{"name": "b", "source": "/l"}]}}},
            {"model": {"source": "b"}}]})


def test_engine_settings_rayattn_models_cannot_be_set_twice():
    args = {**_args("local.yaml"), "engine": {**_args("local.yaml")["engine"],
                                              "extra_engine_kwargs": {"max_loras": 4},
                                              "env": {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}}}
    with pytest.raises(PlanError) as e:
        build_plan(parse_args(args))
    assert "'max_loras' is set by model.lora.max_loras" in str(e.value)
    assert "VLLM_ENABLE_RESPONSES_API_STORE is set by engine.responses_store" in str(e.value)


def test_one_models_entry_names_its_engine_deployment_engine():
    """`rayattn check` reads the replica count from the deployment Serve will create."""
    from rayattn.config.loader import app_args

    app = {"args": {**_args("local.yaml"), "models": [{"model": _args("local.yaml")["model"]}]},
           "deployments": [{"name": "engine", "num_replicas": 3}]}
    del app["args"]["model"]
    args = app_args(app)
    assert args["models"][0]["parallelism"]["data_parallel_size"] == 3


def _args(name: str) -> dict:
    return yaml.safe_load((ROOT / "deployments" / name).read_text())["applications"][0]["args"]


def test_every_deployment_passes_check(capsys):
    assert len(DEPLOYMENTS) >= 4
    assert main(["check", *map(str, DEPLOYMENTS)]) == 0
    out = capsys.readouterr().out
    # One OK per model: local-multi.yaml serves two base models.
    assert out.count(": OK") == len(DEPLOYMENTS) + 1
    assert "[rayattn-multi/tiny-llama]: OK" in out
    assert "ROCM_AITER_TRITON_MLA" in out and "ROCM_AITER_FA" in out and "CPU_ATTN" in out


def test_auto_resolves_to_seed_recommendation_and_says_so():
    args = _args("llama.yaml")
    args["attention"]["backend"] = "auto"
    plan = build_plan(parse_args(args))
    assert plan.backend.name == "ROCM_AITER_FA"
    assert "auto -> ROCM_AITER_FA" in plan.backend_reason
    args = _args("deepseek.yaml")
    args["attention"]["backend"] = "auto"
    assert build_plan(parse_args(args)).backend.name == "ROCM_AITER_TRITON_MLA"


def test_plan_env_and_placement_for_rocm_tp8():
    plan = build_plan(parse_args(_args("deepseek.yaml")))
    assert plan.env["VLLM_ROCM_USE_AITER"] == "1"
    assert plan.env["VLLM_ROCM_USE_AITER_MLA"] == "1"
    assert plan.env["RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"] == "1"
    assert "HIP_FORCE_DEV_KERNARG" in plan.env["VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"]
    assert len(plan.bundles) == 8 and all(b["GPU"] == 1 for b in plan.bundles)
    assert plan.engine_kwargs["attention_backend"] == "ROCM_AITER_TRITON_MLA"
    assert plan.engine_kwargs["distributed_executor_backend"] == "ray"
    assert plan.engine_kwargs["kv_cache_dtype"] == "fp8"


def test_dp_attention_maps_to_vllm_dp_inside_replica():
    args = _args("deepseek.yaml")
    args["parallelism"].update(enable_expert_parallel=True, dp_attention=True)
    kw = build_plan(parse_args(args)).engine_kwargs
    assert (kw["tensor_parallel_size"], kw["data_parallel_size"]) == (1, 8)
    assert kw["enable_expert_parallel"] is True


def test_engine_dp_size_runs_vllms_dp_inside_one_replica_on_cpu():
    args = _args("local.yaml")
    args["parallelism"] = {"engine_dp_size": 2}
    plan = build_plan(parse_args(args))
    kw = plan.engine_kwargs
    assert (kw["data_parallel_size"], kw["tensor_parallel_size"]) == (2, 1)
    # Inside a Ray actor vLLM would start its DP ranks on its Ray executor, unsupported on
    # CPU; each rank's engine core runs its model in-process, with no worker process.
    assert kw["distributed_executor_backend"] == "uni"
    assert plan.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # or vLLM's CPU platform picks mp
    assert "2 DP ranks per engine" in plan.describe()


def test_dp_attention_and_engine_dp_size_are_one_setting_too_many():
    from rayattn.config.plan import PlanError

    args = _args("deepseek.yaml")
    args["parallelism"].update(enable_expert_parallel=True, dp_attention=True,
                               engine_dp_size=2)
    with pytest.raises(PlanError, match="parallelism.engine_dp_size"):
        build_plan(parse_args(args))


def _mutate(name: str, path: str, value) -> dict:
    args = copy.deepcopy(_args(name))
    node = args
    *parents, leaf = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return args


# (deployment, field to change, value, field the message must name, fragment of the message)
INVALID = [
    ("llama.yaml", "attention.backend", "ROCM_AITER_MLA", "attention.backend", "MLA backend"),
    ("deepseek.yaml", "attention.backend", "ROCM_AITER_FA", "attention.backend", "MHA backend"),
    ("llama.yaml", "attention.backend", "NOT_A_BACKEND", "attention.backend", "unknown"),
    ("llama.yaml", "platform.kind", "cuda", "attention.backend", "runs on rocm"),
    ("llama.yaml", "parallelism.tensor_parallel_size", 3, "parallelism.tensor_parallel_size",
     "does not divide"),
    ("local.yaml", "attention.block_size", 100, "attention.block_size", "multiples of"),
    ("qwen3.yaml", "attention.block_size", 64, "attention.block_size", "allowed: 16, 32"),
    ("deepseek.yaml", "attention.kv_cache_dtype", "fp8_inc", "attention.kv_cache_dtype",
     "ROCM_AITER_TRITON_MLA"),
    ("llama.yaml", "parallelism.enable_expert_parallel", True,
     "parallelism.enable_expert_parallel", "not MoE"),
    ("qwen3.yaml", "parallelism.all2all_backend", "deepep_low_latency",
     "parallelism.all2all_backend", "CUDA-only"),
    ("llama.yaml", "platform.accelerator_type", "H100", "platform.accelerator_type", None),
    ("llama.yaml", "parallelism.tensor_parallel_size", 16, "parallelism.tensor_parallel_size",
     "do not fit one node"),
    ("qwen3.yaml", "attention.kv_cache_dtype", "turboquant_4bit_nc",
     "attention.kv_cache_dtype", None),
    ("llama.yaml", "parallelism.dp_attention", True, "parallelism.dp_attention", None),
    ("llama.yaml", "engine.extra_engine_kwargs", {"no_such_flag": 1},
     "engine.extra_engine_kwargs", "no_such_flag"),
    ("local.yaml", "engine.kv_cache_memory_bytes", None, "engine.kv_cache_memory_bytes", None),
    ("llama.yaml", "engine.gpu_memory_utilization", 1.5, "engine.gpu_memory_utilization", None),
    ("llama.yaml", "attention.surprise", 1, "attention.surprise", "unknown field"),
    ("llama.yaml", "router.policy", "random", "router.policy", None),
    ("deepseek.yaml", "model.reasoning_parser", "deepseek_r2", "model.reasoning_parser",
     "not a reasoning parser"),
    ("qwen3.yaml", "model.tool_call_parser", "hermes2", "model.tool_call_parser",
     "not a tool parser"),
    ("llama.yaml", "model.chat_template", "templates/missing.jinja", "model.chat_template",
     "neither a file"),
]


@pytest.mark.parametrize("name,path,value,field,fragment", INVALID,
                         ids=[f"{i[1]}={i[2]}" for i in INVALID])
def test_invalid_combination_is_rejected_naming_the_field(name, path, value, field, fragment):
    args = _mutate(name, path, value)
    with pytest.raises((ConfigError, PlanError)) as e:
        build_plan(parse_args(args))
    assert field in str(e.value)
    if fragment:
        assert fragment in str(e.value)


def test_sinks_model_needs_sink_backend():
    args = _args("llama.yaml")
    args["model"]["source"] = "openai/gpt-oss-120b"
    args["attention"]["backend"] = "ROCM_ATTN"
    with pytest.raises(PlanError, match="attention.backend: the model uses attention sinks"):
        build_plan(parse_args(args))
    args["attention"]["backend"] = "ROCM_AITER_UNIFIED_ATTN"
    args["attention"]["kv_cache_dtype"] = "auto"
    assert build_plan(parse_args(args)).backend.supports_sinks


def test_aiter_mla_head_rule():
    args = _args("deepseek.yaml")
    args["model"]["source"] = "unknown/model"
    args["model"]["architecture"] = dict(is_mla=True, num_attention_heads=24, head_dim=576)
    args["attention"]["backend"] = "ROCM_AITER_MLA"
    args["parallelism"]["tensor_parallel_size"] = 1
    with pytest.raises(PlanError, match="multiple or divisor of 16, got 24"):
        build_plan(parse_args(args))
    args["parallelism"]["tensor_parallel_size"] = 8  # 3 heads per GPU: not a divisor of 16
    with pytest.raises(PlanError, match="got 3"):
        build_plan(parse_args(args))
    args["model"]["architecture"]["num_attention_heads"] = 128
    assert build_plan(parse_args(args)).arch.source == "model.architecture in YAML"


def test_check_cli_rejects_bad_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    doc = yaml.safe_load((ROOT / "deployments" / "llama.yaml").read_text())
    doc["applications"][0]["args"]["attention"]["backend"] = "FLASHMLA"
    bad.write_text(yaml.safe_dump(doc))
    assert main(["check", str(bad)]) == 1
    assert "attention.backend" in capsys.readouterr().err


def test_literals_mirror_installed_vllm():
    from vllm.config import cache

    ours = set(typing.get_args(KVCacheDType))
    assert ours <= set(typing.get_args(cache.CacheDType))
    assert set(typing.get_args(PrefixCachingHashAlgo)) == set(
        typing.get_args(cache.PrefixCachingHashAlgo))


def test_every_field_is_documented():
    """The field docs are the reference; a field without one is a bug."""
    import ast
    import inspect

    from rayattn.config import schema

    tree = ast.parse(inspect.getsource(schema))
    for cls in [n for n in tree.body if isinstance(n, ast.ClassDef)]:
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                documented = (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                              and isinstance(nxt.value.value, str))
                assert documented, f"{cls.name}.{node.target.id} has no doc string"


def test_parser_registries_are_read_without_importing_vllm():
    import sys

    loaded = "vllm.reasoning" in sys.modules
    names = parser_names("reasoning")
    assert {"deepseek_r1", "qwen3"} <= names
    assert {"hermes", "deepseek_v3"} <= parser_names("tool")
    assert ("vllm.reasoning" in sys.modules) == loaded


def test_frontend_settings_reach_engine_and_router_alike():
    from rayattn.config.plan import frontend_kwargs

    cfg = parse_args(_args("deepseek.yaml"))
    front = frontend_kwargs(cfg)
    assert front["reasoning_parser"] == "deepseek_r1" == build_plan(cfg).engine_kwargs[
        "reasoning_parser"]
    assert front["tool_call_parser"] == "deepseek_v3" and front["enable_auto_tool_choice"]
    assert front["enable_prompt_tokens_details"]  # cached_tokens in usage
    assert front["served_model_name"] == ["deepseek-r1"]


def test_engine_replica_counts_come_from_the_engine_deployment_entry():
    """`rayattn check` and the KubeRay renderer see the counts Serve will run: the engine
    deployment's autoscaling_config / num_replicas in the Serve config."""
    from rayattn.app import engine_options
    from rayattn.config.loader import app_args

    app = yaml.safe_load((ROOT / "deployments/llama.yaml").read_text())["applications"][0]
    cfg = parse_args(app_args(app))
    auto = cfg.serve.engine_autoscaling
    assert (auto.min_replicas, auto.max_replicas) == (2, 8)
    assert build_plan(cfg).replica_range == (2, 8)
    serve = engine_options(build_plan(cfg))["autoscaling_config"]
    assert serve["max_replicas"] == 8
    # The shipped targets reach Serve as they are written there (rayattn's policy).
    entry = next(d for d in app["deployments"] if d["name"] == "engine")
    assert serve["policy"]["policy_kwargs"] == {
        **entry["autoscaling_config"]["policy"]["policy_kwargs"], "hold_band": 0.6}
    assert auto.targets == {"ttft_p90_s": 2.0, "kv_usage": 0.85}
    app["deployments"] = [{"name": "engine", "num_replicas": 3}]
    assert parse_args(app_args(app)).parallelism.data_parallel_size == 3


@pytest.mark.parametrize("change,fragment", [
    ({"serve": {"engine_autoscaling": {"min_replicas": 3, "max_replicas": 2}}},
     "min_replicas (3) is above max_replicas (2)"),
    ({"parallelism": {"data_parallel_size": 2},
      "serve": {"engine_autoscaling": {"max_replicas": 2}}},
     "parallelism.data_parallel_size: a fixed engine replica count conflicts"),
    ({"serve": {"engine_autoscaling": {"max_replica": 2}}},
     "serve.engine_autoscaling.max_replica: unknown field"),
])
def test_engine_autoscaling_is_validated(change, fragment):
    args = {"model": {"source": "rayattn://smollm2-135m"}, "platform": {"kind": "cpu"},
            "engine": {"kv_cache_memory_bytes": 2**30}, **change}
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        parse_args(args)


def test_kv_offload_becomes_vllms_offloading_with_tier_events():
    args = _args("h200.yaml")
    args["engine"]["kv_offload"] = {"size_gib": 16}
    plan = build_plan(parse_args(args))
    kw = plan.engine_kwargs
    assert kw["kv_offloading_size"] == 16 and kw["kv_offloading_backend"] == "native"
    # The routers' index keys on the tier's real block hashes: vLLM must describe them.
    assert kw["kv_transfer_config"]["kv_connector_extra_config"] == {
        "self_describing_kv_events": True}
    assert "host 16 GiB per engine" in plan.describe()
    # 16 layers × 8 KV heads × 64 dims × K,V × bf16 = 32 KiB a token: 16 GiB hold 524,288.
    assert plan.kv_bytes_per_token == 32768 and "524,288 tokens" in plan.describe()
    kt = config_objects(kw)["kv_transfer_config"]  # the installed vLLM's object
    assert kt.kv_connector_extra_config["self_describing_kv_events"] and kt.is_kv_producer
    args["engine"]["kv_offload"] = {"size_gib": 0}
    assert "kv_offloading_size" not in build_plan(parse_args(args)).engine_kwargs


def test_kv_offload_rejected_where_it_cannot_run_or_fit():
    args = _args("local.yaml")
    args["engine"]["kv_offload"] = {"size_gib": 1}
    with pytest.raises(PlanError, match=r"engine.kv_offload: vLLM's CPU build"):
        build_plan(parse_args(args))
    args = _args("llama.yaml")  # TP4 on 8-GPU nodes: two engines per node
    args["engine"]["kv_offload"] = {"size_gib": 700}
    with pytest.raises(PlanError, match=r"engine.kv_offload.size_gib: 2 engine\(s\) or DP "
                                        r"rank\(s\) per node "
                                        r"× 700 GiB = 1400 GiB .* has 1280 GiB"):
        build_plan(parse_args(args))
    args["platform"]["host_memory_gib"] = 2048  # a bigger node takes it
    assert build_plan(parse_args(args)).engine_kwargs["kv_offloading_size"] == 700
    args["engine"]["enable_prefix_caching"] = False
    with pytest.raises(PlanError, match="needs engine.enable_prefix_caching"):
        build_plan(parse_args(args))


def test_check_prints_kv_formats_as_capacity_levers(capsys):
    assert main(["check", str(ROOT / "deployments" / "deepseek.yaml")]) == 0
    out = capsys.readouterr().out
    # DeepSeek's latent: 61 layers × 576 × 1 byte (fp8) = 35,136 B a token.
    assert "35,136 B/token with kv_cache_dtype=fp8" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("kv format:"))
    assert line.index("auto 15,279") < line.index("fp8 30,559")  # smallest first
    args = _args("llama.yaml")
    args["attention"]["kv_cache_dtype"] = "fp8_ds_mla"
    with pytest.raises(PlanError, match="fp8_ds_mla is DeepSeek's MLA latent format"):
        build_plan(parse_args(args))


def test_turboquant_capacity_follows_vllms_packing():
    from rayattn.config.architecture import Architecture
    from rayattn.config.kv_capacity import bytes_per_token

    arch = Architecture(False, 32, 8, 128, False, False, "test", num_layers=32)
    # fp8 keys (128 B) + 4-bit values (64 + 4 B) = 196 B a head on 28 layers; the first and
    # last two layers stay bf16 (512 B a head).
    assert bytes_per_token(arch, "turboquant_k8v4", 2) == 8 * (4 * 512 + 28 * 196)
    assert bytes_per_token(arch, "fp8", 2) == 32 * 8 * 256
    assert bytes_per_token(arch, "fp8_ds_mla", 2) is None
    assert bytes_per_token(Architecture(False, 1, 1, 64, False, False, "t"), "auto", 2) is None
