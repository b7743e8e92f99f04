"""`rayattn serve`'s hold on `serve run` (rayattn/serve_run.py), with a stand-in child that
says which signal reached it: a SIGTERM or SIGINT to the parent's process group reaches the
child once, as SIGINT, even where the parent was started with SIGINT ignored (a shell's
background job); a second one as SIGTERM; the parent's death kills the child."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.unit.server.test_haproxy_admin import FakeAdmin

# The child: writes its pid; on KeyboardInterrupt (SIGINT handled as Python does by default)
# writes "INT" and exits 0, or with "linger" waits (a drain) until a SIGTERM ends it.
CHILD = """
import os, sys, time
out = open(sys.argv[1], "a", buffering=1)
out.write(f"pid {os.getpid()}\\n")
try:
    while True:
        time.sleep(0.05)
except KeyboardInterrupt:
    out.write("INT\\n")
    if sys.argv[2] == "linger":
        time.sleep(120)
"""


def _start(tmp_path: Path, mode: str = "exit", drain_s: float = 0,
           env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "child.log"
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    parent = subprocess.Popen(
        [sys.executable, "-c", "import sys; from rayattn import serve_run; "
         f"sys.exit(serve_run.run([sys.executable, {str(child)!r}, {str(log)!r}, {mode!r}], "
         f"drain_s={drain_s}))"],
        start_new_session=True, env={**os.environ, **(env or {})},
        # As a shell's background job starts it: SIGINT ignored, which exec keeps.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.time() + 60
    while not (log.exists() and log.read_text().startswith("pid")):
        assert parent.poll() is None and time.time() < deadline, "the child did not start"
        time.sleep(0.05)
    return parent, log


def _child(log: Path) -> psutil.Process:
    return psutil.Process(int(log.read_text().split()[1]))


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines()[1:]


def test_a_sigterm_to_the_group_reaches_the_child_once_as_sigint(tmp_path):
    parent, log = _start(tmp_path)
    child = _child(log)
    try:
        # Its own process group: a signal to the parent's group does not reach it directly.
        assert os.getpgid(child.pid) != os.getpgid(parent.pid)
        os.killpg(parent.pid, signal.SIGTERM)
        assert parent.wait(timeout=60) == 0
        assert _lines(log) == ["INT"]
    finally:
        parent.kill()
        if child.is_running():
            child.kill()


def test_a_second_signal_stops_it_without_the_drain(tmp_path):
    parent, log = _start(tmp_path, "linger")
    try:
        os.killpg(parent.pid, signal.SIGINT)
        deadline = time.time() + 60
        while "INT" not in log.read_text():
            assert time.time() < deadline, "the first signal did not reach the child"
            time.sleep(0.05)
        os.killpg(parent.pid, signal.SIGINT)
        # The child ended by SIGTERM: the status a shell reports, 128 + 15.
        assert parent.wait(timeout=60) == 128 + signal.SIGTERM
        assert _lines(log) == ["INT"]
    finally:
        parent.kill()


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_the_child_dies_with_the_parent(tmp_path):
    parent, log = _start(tmp_path)
    child = _child(log)
    try:
        parent.kill()
        parent.wait(timeout=10)
        child.wait(timeout=30)  # psutil.TimeoutExpired if it outlived its parent
    finally:
        if child.is_running():
            child.kill()


@pytest.fixture
def front_door(tmp_path_factory) -> Iterator[tuple[FakeAdmin, dict[str, str]]]:
    """A stand-in for the cluster's HAProxy admin socket with one stream in flight, and the
    environment that points `rayattn serve` at it."""
    d = tempfile.mkdtemp(prefix="rah-t", dir="/tmp")  # AF_UNIX paths are short
    os.mkdir(os.path.join(d, "node1"))
    fake = FakeAdmin(os.path.join(d, "node1", "admin.sock"), 1, falls=False)
    yield fake, {"RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(d, "admin.sock")}
    fake.close()
    shutil.rmtree(d, ignore_errors=True)


def _stop_and_see_the_drain(parent: subprocess.Popen, fake: FakeAdmin, looks: int) -> None:
    """SIGTERM to the parent's group, then wait until the drain looked `looks` times."""
    os.killpg(parent.pid, signal.SIGTERM)
    deadline = time.time() + 60
    while fake.commands.count("show stat") < looks:
        assert time.time() < deadline, f"no drain: {fake.commands}"
        time.sleep(0.05)


def test_a_stop_reaches_the_child_once_the_front_door_has_drained(tmp_path, front_door):
    fake, env = front_door
    parent, log = _start(tmp_path, drain_s=60, env=env)
    try:
        _stop_and_see_the_drain(parent, fake, looks=3)  # closed, and looked at a few times
        assert "disable frontend http_frontend" in fake.commands
        assert _lines(log) == []  # still waiting for the stream in flight
        fake.streams = 0
        assert parent.wait(timeout=60) == 0
        assert _lines(log) == ["INT"]
    finally:
        parent.kill()


def test_a_second_stop_ends_the_drain(tmp_path, front_door):
    fake, env = front_door
    parent, log = _start(tmp_path, drain_s=60, env=env)
    try:
        _stop_and_see_the_drain(parent, fake, looks=1)
        os.killpg(parent.pid, signal.SIGINT)  # Ctrl-C again: stop waiting, not SIGTERM
        assert parent.wait(timeout=60) == 0
        assert _lines(log) == ["INT"]
    finally:
        parent.kill()
