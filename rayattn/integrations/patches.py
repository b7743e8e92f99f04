"""Every run-time patch rayattn makes to a library, in one place: what it changes, why, and
where it is applied. Each application site logs one INFO line of what it applied
(`log_applied`): an engine replica when it builds its serving layer, a router when it builds a
model's renderer, a benchmark rival's Ray worker when its setup hook runs.

Not patches (documented extension points, nothing of the library changed): the device report
(vLLM's `worker_extension_cls`, devices.py), the engine replica's Serve request router
(rayattn/server/fleet/pinning.py), environment variables set before an engine or Ray starts
(rayattn/compat.py, rayattn/cluster_env.py).

Module-level imports are standard library only: Ray workers import this module (a setup hook).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import multiprocessing.context
import os
import sys
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Patch:
    name: str
    target: str
    """What in which library it changes."""
    why: str
    where: str
    """Where rayattn applies it."""


RENDER_ONCE = Patch(
    "render_once",
    "vLLM's OnlineRenderer.render_chat / render_completion, on the engine's own serving "
    "objects' renderer (instance attributes)",
    "the engine serves the prompt the router already rendered (its block hashes came from "
    "it) instead of rendering the body again on its event loop",
    "engine replica, building its OpenAI layer (rayattn/engine/openai_layer.py)")
INCREMENTAL_TOKENIZER = Patch(
    "incremental_tokenizer",
    "the router renderer's transformers tokenizer: its __class__ swapped for a subclass "
    "whose __call__ reuses the ids of earlier prompts' heads",
    "a conversation's next turn tokenizes only its new text (identical ids, self-tested)",
    "router, building a model's renderer (rayattn/server/prompts/incremental_tokenizer.py)")
MOVED_VLLM_MODULES = Patch(
    "moved_vllm_modules",
    "sys.meta_path: a finder that imports vllm.entrypoints.chat_utils as "
    "vllm.renderers.chat_utils",
    "Ray 2.60's KV-aware tokenizer imports vLLM 0.29's module name, which vLLM 0.32 moved "
    "unchanged",
    "the benchmark rival's Ray workers (worker_process_setup_hook, "
    "bench/peers/ray_serve_llm.py)")

PRESTARTED_ENGINE_CORE = Patch(
    "prestarted_engine_core",
    "vLLM's engine-core launcher (vllm.v1.engine.utils.get_mp_context): a forkserver "
    "context in place of spawn, its server started, importing vLLM's engine core, before the "
    "replica imports vLLM",
    "the engine core process's interpreter start and vLLM's imports (the longest part of its "
    "start) run beside the replica's own instead of after them; each engine core still starts "
    "from a fresh interpreter (never a fork of the Ray actor) with the environment vLLM gave "
    "it at launch",
    "engine replica, around loading vLLM (rayattn/engine/replica.py; engine.prestart_core)")

PATCHES = (RENDER_ONCE, INCREMENTAL_TOKENIZER, MOVED_VLLM_MODULES, PRESTARTED_ENGINE_CORE)


def log_applied(where: str, applied: Iterable[Patch]) -> None:
    """One INFO line: the run-time patches `where` (an engine, a router's model) applied."""
    names = [f"{p.name} ({p.target})" for p in applied]
    log.info("%s: run-time library patches applied: %s", where, "; ".join(names) or "none")


# --- render_once ----------------------------------------------------------------------------
def serve_rendered_prompts(state: Any, given: Any) -> bool:
    """RENDER_ONCE. Make the engine's serving layer take prompts the router already rendered:
    while the context variable `given` holds a request's engine inputs, vLLM's OnlineRenderer
    returns them instead of rendering the body again (a request without them renders as
    usual). Everything else in the serving layer (model check, sampling parameters,
    streaming, parsers of the output) stays vLLM's. False where the installed vLLM's serving
    objects render through something else: the engine then renders every request itself."""
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


# --- incremental_tokenizer ------------------------------------------------------------------
def swap_tokenizer_call(tokenizer: Any, call: Callable[..., Any]) -> None:
    """INCREMENTAL_TOKENIZER. `tokenizer` becomes an instance of a subclass of its own class
    whose __call__ is `call` (a class swap: its class and every other tokenizer keep theirs;
    `call` reaches the original as `type(tokenizer).__call__` taken before the swap)."""
    base = type(tokenizer)
    layer = type(f"IncrementallyTokenizing{base.__name__}", (base,), {"__call__": call})
    tokenizer.__class__ = layer


# --- moved_vllm_modules ---------------------------------------------------------------------
MOVED_MODULES = {"vllm.entrypoints.chat_utils": "vllm.renderers.chat_utils"}
"""Old name → where vLLM 0.32 has it, for Ray 2.60's KV-aware tokenizer (built for 0.29)."""


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves a moved module's old name to its new module, only when imported under the
    old name and only where the installed vLLM has no module there (consulted after the
    regular finders)."""

    def find_spec(self, name: str, path: Any = None,
                  target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED_MODULES[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        pass  # the new module is already executed


def restore_moved_vllm_modules() -> None:
    """MOVED_VLLM_MODULES. In each of the rival's Ray workers (a worker setup hook): vLLM
    modules that moved since Ray 2.60's vLLM answer to their old names too."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
        log_applied("Ray Serve LLM worker (benchmark rival)", [MOVED_VLLM_MODULES])


# --- prestarted_engine_core -----------------------------------------------------------------
ENGINE_CORE_MODULE = "vllm.v1.engine.core"
"""What the forkserver imports before it forks anything: the engine core's entry point and,
through it, vLLM's config, torch and the model executor."""
LOADER_VARIABLES = ("LD_PRELOAD",)
"""Read by the dynamic loader only when a program starts: a forkserver's child has what the
forkserver started with, whatever its launch environment says. (LD_LIBRARY_PATH is not here:
what imports add to it, OpenCV's and vLLM's own, the forkserver's imports add too, after its
start as after a spawned engine core's.)"""
_server_loader_env: dict[str, str | None] = {}


class LaunchEnvProcess(multiprocessing.context.ForkServerProcess):
    """A forkserver process that runs in the environment its launcher had at start(), not the
    one the forkserver was started with: vLLM sets variables between the two (RAY_ADDRESS,
    each DP rank's devices)."""

    _launch_env: dict[str, str]

    def start(self) -> None:
        self._launch_env = dict(os.environ)
        super().start()

    def __reduce__(self) -> tuple[Any, ...]:
        # Unpickled in the new process: the environment is entered first, before what the
        # process's arguments import while they are unpickled (an executor class's module).
        return (enter_launch_env, (type(self), self._launch_env), self.__dict__.copy())


def enter_launch_env(cls: type[LaunchEnvProcess], env: dict[str, str]) -> LaunchEnvProcess:
    """In a new forkserver process: its launch environment, its title kept, its end tied to
    the forkserver's; then the process object, whose state pickle fills in afterwards."""
    keep_process_title()
    os.environ.clear()
    os.environ.update(env)
    die_with_parent()
    return cls.__new__(cls)


class LaunchEnvForkServerContext(multiprocessing.context.ForkServerContext):
    Process = LaunchEnvProcess  # type: ignore[assignment]


def keep_process_title() -> None:
    """setproctitle (vLLM names its engine core `VLLM::EngineCore` with it) finds the memory it
    may overwrite from the environment's layout as the process started: let it find it before
    the environment is rewritten, or the title never changes."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.getproctitle()


def die_with_parent() -> None:
    """This process gets SIGKILL when its parent, the forkserver, ends. A spawned engine
    core is a child of its replica, which Ray's worker cleanup and rayattn's reaper both
    end with it; a forkserver's child is its grandchild, and Ray's cleanup, ending the
    replica's children at once (the forkserver and the reaper among them), would leave it
    running. The forkserver's one thread lives as long as the forkserver, so the signal
    comes with the forkserver's end and nothing else. Linux only (prctl)."""
    import ctypes
    import signal

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the forkserver ended before the signal was asked for
        os._exit(1)


def prestart_engine_core() -> None:
    """PRESTARTED_ENGINE_CORE, first half. Start this process's forkserver now, importing
    ENGINE_CORE_MODULE: call with the engine's environment final and before importing vLLM,
    so that the two imports run side by side. Returns at once (the server imports while this
    process goes on; a launch waits for it)."""
    from multiprocessing import forkserver

    _server_loader_env.update({k: os.environ.get(k) for k in LOADER_VARIABLES})
    forkserver.set_forkserver_preload([ENGINE_CORE_MODULE])
    forkserver.ensure_running()


def launch_engine_cores_prestarted() -> bool:
    """PRESTARTED_ENGINE_CORE, second half. vLLM's engine-core launcher takes its processes
    from the forkserver where it would spawn them (vLLM's own checks still run first, and
    decide: a fork stays a fork), unless vLLM changed what the loader reads at a program's
    start since the forkserver started: then it spawns, as without the prestart, and says why
    once. False where the installed vLLM launches through something else: its engine cores are
    then spawned as before."""
    import vllm.v1.engine.utils as launcher

    spawn_context = getattr(launcher, "get_mp_context", None)
    if spawn_context is None:
        return False
    prestarted = LaunchEnvForkServerContext()
    warned: list[str] = []

    def get_mp_context() -> Any:
        context = spawn_context()
        if context.get_start_method() != "spawn":
            return context
        changed = [k for k in LOADER_VARIABLES if os.environ.get(k) != _server_loader_env.get(k)]
        if changed:
            if not warned:
                warned.append("")
                log.warning("engine core spawned, not prestarted: %s changed since the "
                            "forkserver started (%s)", ", ".join(changed),
                            "; ".join(f"{k}={os.environ.get(k)}" for k in changed))
            return context
        return prestarted

    launcher.get_mp_context = get_mp_context
    return True
