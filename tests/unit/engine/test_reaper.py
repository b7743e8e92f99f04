"""The reaper: once a replica's process is gone, however it went, its engine processes end
and its run directory (vLLM's IPC sockets, the KV-event sockets) is removed."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT

# A stand-in replica: an engine core of its own, the watcher (which has seen the engine once
# it is started), then nothing until a signal. On SIGTERM it ends its children and exits,
# as a Ray worker does on its way out.
REPLICA = """
import os, signal, subprocess, sys, time
import psutil
from rayattn.engine import reaper
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
reaper.start_for_current_process(sys.argv[1])
print(engine.pid, flush=True)
def leave(*_):
    for child in psutil.Process().children():
        child.kill()
    os._exit(0)
signal.signal(signal.SIGTERM, leave)
time.sleep(600)
"""


def _soon(check, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def _watchers(replica_pid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        if "rayattn.engine.reaper" in cmd and str(replica_pid) in cmd and \
                p.info["status"] != psutil.STATUS_ZOMBIE:
            out.append(p)
    return out


def _ended(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "exited"])
def test_a_replica_gone_leaves_neither_its_engine_nor_its_run_directory(tmp_path: Path, how):
    run_dir = tmp_path / "rayattn-engine-x"
    (run_dir / "rayattn-kv-y").mkdir(parents=True)
    (run_dir / "2f0c-ipc-socket").write_text("")  # what vLLM binds there
    replica = subprocess.Popen([sys.executable, "-c", REPLICA, str(run_dir)],
                               stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert replica.stdout is not None
        engine = psutil.Process(int(replica.stdout.readline()))
        [watcher] = _watchers(replica.pid)
        # Not the replica's child: a worker that ends its children on the way out
        # (SIGTERM here) does not end it.
        assert watcher.pid not in {c.pid for c in psutil.Process(replica.pid).children()}
        assert run_dir.exists()  # the replica lives: nothing is touched
        replica.send_signal(how)
        replica.wait(timeout=30)
        assert _soon(lambda: _ended(engine)), "the engine outlived its replica"
        assert _soon(lambda: not run_dir.exists()), "the run directory stayed"
        assert _soon(lambda: _ended(watcher)), "the watcher stayed"
    finally:
        if replica.poll() is None:
            replica.kill()


def test_a_watcher_that_cannot_start_is_reported_not_silent():
    from rayattn.engine import reaper

    out = subprocess.run([sys.executable, "-S", "-c", reaper.LAUNCH, sys.executable, "-c",
                          "import no_such_module_here"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1
    assert "no_such_module_here" in out.stderr
