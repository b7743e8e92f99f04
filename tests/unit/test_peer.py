"""The rival runs on the same engines: the `vllm serve` flags rayattn's bench builds parse
back (with vLLM's own argument parser) into exactly the deployment's engine settings."""

from __future__ import annotations

import yaml

from rayattn.bench.peer import serve_flags
from rayattn.config.loader import parse_args
from rayattn.config.plan import build_plan
from tests.conftest import ROOT


def test_serve_flags_round_trip_through_vllms_parser():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = yaml.safe_load((ROOT / "deployments" / "local.yaml").read_text())
    # vLLM's parser resolves the model: prepare it (cached after the first time).
    plan = build_plan(parse_args(args["applications"][0]["args"]), prepare_model=True)
    kw = dict(plan.engine_kwargs)
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    ns = parser.parse_args(["--model", kw["model"], *serve_flags(kw)])
    parsed = AsyncEngineArgs.from_cli_args(ns)
    for k, v in kw.items():
        got = getattr(parsed, k)
        assert got == v or (isinstance(v, list) and list(got) == v), (k, got, v)
    assert parsed.dtype == "float32" and parsed.block_size == 32
