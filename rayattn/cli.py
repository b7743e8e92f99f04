"""`rayattn` command line: check configs, prepare the embedded model, make tiny test models,
render KubeRay manifests, benchmark policies on real engines, simulate a fleet."""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from rayattn.config.loader import ConfigError, load_serve_config, rayattn_apps
from rayattn.config.plan import PlanError, build_plan, cpu_shortfall
from rayattn.integrations import ray_private
from rayattn.models.embedded import resolve_embedded
from rayattn.models.tiny import SHAPES, make_shaped_model, make_tiny_model

# The other commands' modules are imported in their functions: every command starts here,
# and `rayattn check` and `render-k8s` run without vLLM, torch or Ray loaded.


def cmd_check(args: argparse.Namespace) -> int:
    status = 0
    for path in args.configs:
        try:
            apps = rayattn_apps(load_serve_config(path))
            for name, cfg in apps:
                plan = build_plan(cfg, prepare_model=False)
                print(f"== {path} [{name}]: OK\n{plan.describe()}\n")
        except (ConfigError, PlanError, ValueError, OSError) as e:
            print(f"== {path}: INVALID\n{e}\n", file=sys.stderr)
            status = 1
    return status


def cmd_prepare(args: argparse.Namespace) -> int:
    print(resolve_embedded(args.source))
    return 0


def cmd_tiny(args: argparse.Namespace) -> int:
    if args.arch in SHAPES:
        over = {k: v for k, v in (("num_hidden_layers", args.layers),
                                  ("n_routed_experts", args.experts),
                                  ("max_position_embeddings", args.max_pos)) if v}
        print(make_shaped_model(args.arch, args.out, args.tokenizer, **over))
    else:
        print(make_tiny_model(args.arch, args.out))
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from rayattn.k8s.render import main as render_main  # only this command renders

    return render_main(args)


def cmd_serve(args: argparse.Namespace) -> int:
    """`serve run <config>` in the environment the cluster it starts needs (HAProxy front
    door, worker priority: cluster_env.py), once the ports it binds are known to be free and
    its engines fit the CPUs Ray will find."""
    # The server's side: only this command sets up a cluster's environment.
    from rayattn import cluster_env
    from rayattn.server.front_door import ports_held

    try:
        config = load_serve_config(args.config)
        apps = rayattn_apps(config)
        cluster_env.apply(apps[0][1].router.session_header)
        problems = []
        if not os.environ.get("RAY_ADDRESS"):
            # `serve run` starts a Ray of this machine's CPUs, whose front door binds these.
            problems = ports_held(config)
            short = cpu_shortfall(apps, ray_private.num_cpus())
            problems += [short] if short else []
    except (ConfigError, PlanError, OSError) as e:
        problems = [f"{args.config}: " + " ".join(str(e).split())]
    for line in problems:
        print(f"rayattn serve: {line}", file=sys.stderr)
    if problems:
        return 1
    serve = os.path.join(os.path.dirname(sys.executable), "serve")
    serve = serve if os.access(serve, os.X_OK) else shutil.which("serve") or "serve"
    from rayattn import serve_run

    return serve_run.run([serve, "run", args.config],
                         drain_s=max(cfg.serve.front_door_drain_s for _, cfg in apps))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rayattn")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="validate Serve config files offline and print the plan")
    c.add_argument("configs", nargs="+")
    c.set_defaults(fn=cmd_check)
    m = sub.add_parser("prepare-model", help="prepare an embedded model (safetensors)")
    m.add_argument("source", nargs="?", default="rayattn://smollm2-135m")
    m.set_defaults(fn=cmd_prepare)
    t = sub.add_parser("tiny-model", help="generate a tiny random-weight model")
    t.add_argument("arch", choices=["llama", "qwen3-moe", "deepseek-mla",
                                    "llama-0.85b", "deepseek-v2-lite"],
                   help="tiny test models, or random models of a real shape (GPU benches)")
    t.add_argument("out")
    t.add_argument("--tokenizer", help="real shapes: copy this tokenizer (else train one)")
    t.add_argument("--layers", type=int, help="real shapes: override the layer count")
    t.add_argument("--experts", type=int, help="real shapes: override the routed experts")
    t.add_argument("--max-pos", type=int, help="real shapes: max_position_embeddings")
    t.set_defaults(fn=cmd_tiny)
    s = sub.add_parser("serve", help="`serve run` a Serve config with rayattn's cluster "
                       "environment, after checking its ports are free")
    s.add_argument("config")
    s.set_defaults(fn=cmd_serve)
    r = sub.add_parser("render-k8s", help="render a KubeRay RayService from a Serve config")
    r.add_argument("config")
    r.add_argument("-o", "--out", help="write here instead of stdout")
    r.add_argument("--image", default=None, help="ROCm vLLM image")
    r.set_defaults(fn=cmd_render)
    # Here, not at the top: `import rayattn.cli` (a Serve build path) stays without asyncio.
    from rayattn.bench.cli import add_parsers

    add_parsers(sub)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
