"""rayattn/integrations/patches.py: every run-time patch of a library is registered there,
applied only from there, and logged in one INFO line where it is applied."""

from __future__ import annotations

import ast
import asyncio
import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from rayattn.integrations import patches

PACKAGE = Path(patches.__file__).resolve().parents[1]
LIBRARIES = ("vllm", "ray", "transformers", "tokenizers", "starlette", "fastapi")


@pytest.fixture(autouse=True)
def _caplog_sees_rayattn(monkeypatch):
    # rayattn/logs.py stops rayattn's records at its own handler in a Ray process.
    monkeypatch.setattr(logging.getLogger("rayattn"), "propagate", True)


def test_the_registry_says_what_why_and_where():
    names = [p.name for p in patches.PATCHES]
    assert len(names) == len(set(names))
    for p in patches.PATCHES:
        assert p.target and p.why and p.where, p


def _library_modules(tree: ast.AST) -> set[str]:
    """Names bound to library modules by the file's imports (`import ray`, `from ray import
    serve`, `from vllm.x import y as z`)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names
                    if a.name.split(".")[0] in LIBRARIES}
        elif isinstance(node, ast.ImportFrom) and node.module and \
                node.module.split(".")[0] in LIBRARIES:
            out |= {a.asname or a.name for a in node.names}
    return out


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def test_no_library_is_patched_outside_the_registry():
    """Class swaps, import-system hooks and assignments into a library's modules or classes
    happen in patches.py only."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == Path(patches.__file__).resolve():
            continue
        tree = ast.parse(path.read_text())
        libraries = _library_modules(tree)
        where = path.relative_to(PACKAGE.parent)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(el, ast.Attribute) and (
                            el.attr == "__class__" or _root(el) in libraries):
                        found.append(f"{where}:{node.lineno} assigns {ast.unparse(el)}")
            if isinstance(node, ast.Attribute) and node.attr == "meta_path":
                found.append(f"{where}:{node.lineno} touches sys.meta_path")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id == "setattr" and node.args and _root(node.args[0]) in libraries:
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    assert found == []


def test_one_info_line_names_what_was_applied(caplog):
    with caplog.at_level(logging.INFO, logger="rayattn"):
        patches.log_applied("engine e1", [patches.RENDER_ONCE])
        patches.log_applied("router, renderer of m", [])
    lines = [r.getMessage() for r in caplog.records if r.name == patches.__name__]
    assert len(lines) == 2
    assert lines[0].startswith("engine e1: run-time library patches applied: render_once (")
    assert lines[1] == "router, renderer of m: run-time library patches applied: none"


def test_the_class_swap_changes_one_tokenizer_only():
    class Tok:
        def __call__(self, text):
            return "plain"

    base = Tok.__call__
    one, other = Tok(), Tok()
    patches.swap_tokenizer_call(one, lambda self, text: "layered " + base(self, text))
    assert one("x") == "layered plain" and other("x") == "plain"
    assert isinstance(one, Tok) and type(one).__name__ == "IncrementallyTokenizingTok"
    assert type(other) is Tok


def test_the_rivals_hook_applies_and_logs_once(caplog):
    before = list(sys.meta_path)
    try:
        sys.meta_path[:] = [f for f in sys.meta_path
                            if not isinstance(f, patches.MovedModuleFinder)]
        with caplog.at_level(logging.INFO, logger="rayattn"):
            patches.restore_moved_vllm_modules()
            patches.restore_moved_vllm_modules()
        lines = [r.getMessage() for r in caplog.records if r.name == patches.__name__]
        assert len(lines) == 1 and "moved_vllm_modules" in lines[0]
    finally:
        sys.meta_path[:] = before


def test_the_router_logs_its_renderers_patches_once(monkeypatch, caplog):
    from rayattn.server.prompts import rendering

    async def render_state(engine_kwargs, frontend):
        tokenizer = object()  # not callable: the incremental layer stays off
        return SimpleNamespace(online_renderer=SimpleNamespace(
            parser=None, renderer=SimpleNamespace(tokenizer=tokenizer)))

    monkeypatch.setattr(rendering, "render_state", render_state)
    monkeypatch.setattr(rendering, "frontend_kwargs", lambda cfg: {})
    cfg = SimpleNamespace(serve=SimpleNamespace(router_render_threads=1),
                          model=SimpleNamespace(name="m"))
    with caplog.at_level(logging.INFO, logger="rayattn"):
        r = asyncio.run(rendering.PromptRenderer.create(cfg, {}))
    assert r.incremental is None
    lines = [r.getMessage() for r in caplog.records if r.name == patches.__name__]
    assert lines == ["router, renderer of m: run-time library patches applied: none"]


@pytest.mark.parametrize("takes_rendered", [True, False])
def test_the_engine_logs_its_patches_once_its_serving_layer_is_built(
        monkeypatch, caplog, takes_rendered):
    from rayattn.engine import openai_layer
    from rayattn.engine import replica as engine_replica
    from rayattn.engine.replica import EngineReplica

    layer = SimpleNamespace(takes_rendered=takes_rendered)

    async def create(*args, **kwargs):
        return layer

    monkeypatch.setattr(openai_layer.OpenAILayer, "create", create)
    monkeypatch.setattr(engine_replica, "frontend_kwargs", lambda cfg: {})
    replica = SimpleNamespace(
        cfg=None, engine=None, plan=SimpleNamespace(adapters={}, engine_kwargs={}),
        replica_id="engine-1", rank=0, metrics=None,
        inflight=SimpleNamespace(report=None), tracing=None,
        _patches=[patches.PRESTARTED_ENGINE_CORE])
    lazy = openai_layer.LazyOpenAILayer(lambda: EngineReplica._build_openai(replica))

    async def twice() -> tuple[object, object]:
        return await lazy.get(), await lazy.get()

    with caplog.at_level(logging.INFO, logger="rayattn"):
        assert asyncio.run(twice()) == (layer, layer)
    lines = [r.getMessage() for r in caplog.records if r.name == patches.__name__]
    assert len(lines) == 1 and lines[0].startswith("engine engine-1: ")
    assert ("render_once" in lines[0]) == takes_rendered
    assert "prestarted_engine_core" in lines[0]  # applied at the start, logged here


PROBE_MODULE = """
import os, time
AT_IMPORT = os.environ.get("RAYATTN_PROBE")

def report(out):
    with open(out, "w") as f:
        f.write(f"{AT_IMPORT}|{os.environ.get('RAYATTN_PROBE')}")

def sleep():
    time.sleep(120)
"""
LAUNCH_ENV_SCRIPT = """
import os, sys, time
from multiprocessing import forkserver
from multiprocessing.context import ForkServerProcess
from rayattn.integrations import patches

out = sys.argv[1]
forkserver.set_forkserver_preload(["json"])
os.environ["RAYATTN_PROBE"] = "at the server's start"
forkserver.ensure_running()
os.environ["RAYATTN_PROBE"] = "at the launch"
sys.path.insert(0, os.path.dirname(out))
import probe
for cls, name in ((patches.LaunchEnvProcess, "env"),
                  (patches.LaunchEnvForkServerContext().Process, "ctx"),
                  (ForkServerProcess, "plain")):
    p = cls(target=probe.report, args=(f"{out}.{name}",))
    p.start()
    p.join(60)
    assert p.exitcode == 0, p.exitcode
# The engine core's end is tied to its forkserver's (Ray's cleanup ends the server alone).
p = patches.LaunchEnvProcess(target=probe.sleep)
p.start()
time.sleep(1)
os.kill(forkserver._forkserver._forkserver_pid, 9)
deadline = time.time() + 20
while p.exitcode is None and time.time() < deadline:
    try:
        os.kill(p.pid, 0)
    except ProcessLookupError:
        break
    time.sleep(0.1)
with open(f"{out}.orphan", "w") as f:
    f.write("gone" if time.time() < deadline else "running")
"""


def test_a_prestarted_engine_core_runs_in_the_environment_of_its_launch(tmp_path):
    """vLLM sets variables after the forkserver started (RAY_ADDRESS, a DP rank's devices):
    the process it launches sees them, already while its arguments are unpickled (a module
    they import reads them), where a plain forkserver process sees the server's. And it
    ends when its forkserver is killed."""
    import subprocess

    (tmp_path / "probe.py").write_text(PROBE_MODULE)
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-c", LAUNCH_ENV_SCRIPT, str(out)], check=True, timeout=120,
                   cwd=PACKAGE.parent)
    launch = "at the launch|at the launch"
    assert (tmp_path / "out.env").read_text() == launch
    assert (tmp_path / "out.ctx").read_text() == launch
    assert (tmp_path / "out.plain").read_text() == "at the server's start|at the server's start"
    assert (tmp_path / "out.orphan").read_text() == "gone"


def test_vllm_launches_from_the_forkserver_only_where_it_would_spawn(monkeypatch):
    import multiprocessing

    import vllm.v1.engine.utils as launcher

    original = launcher.get_mp_context
    monkeypatch.setattr(launcher, "get_mp_context", original)  # restored after
    # As prestart_engine_core records it when the forkserver starts.
    monkeypatch.setattr(patches, "_server_loader_env",
                        {k: os.environ.get(k) for k in patches.LOADER_VARIABLES})
    assert patches.launch_engine_cores_prestarted()
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    assert isinstance(launcher.get_mp_context(), patches.LaunchEnvForkServerContext)
    # What the loader reads at a start changed since (vLLM's CPU platform preloads its
    # OpenMP runtime): spawned, as without the prestart.
    monkeypatch.setenv("LD_PRELOAD", "/opt/elsewhere/libgomp.so.1")
    assert launcher.get_mp_context().get_start_method() == "spawn"
    monkeypatch.setattr(patches, "_server_loader_env", {"LD_PRELOAD": os.environ["LD_PRELOAD"]})
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    # vLLM's own choice: fork, or spawn where it must (CUDA initialized in this process, a
    # Ray actor); only a spawn becomes the forkserver.
    expected = original()
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    if expected.get_start_method() == "fork":
        assert launcher.get_mp_context() is multiprocessing.get_context("fork")
    else:
        assert isinstance(launcher.get_mp_context(), patches.LaunchEnvForkServerContext)
