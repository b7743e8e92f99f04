"""`rayattn serve`'s hold on `serve run` (rayattn/serve_run.py), with a stand-in child that
says which signal reached it: a SIGTERM or SIGINT to the parent's process group reaches the
child once, as SIGINT; a second one as SIGTERM; the parent's death kills the child."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

# The child: writes its pid, then on SIGINT writes "INT" and exits 0 unless a later SIGTERM
# comes within 2 s (a drain that a second signal cuts short: it then writes "TERM", exits 3).
CHILD = """
import os, signal, sys, time
out = open(sys.argv[1], "a", buffering=1)
def on_int(*_):
    out.write("INT\\n")
    deadline = time.time() + 2
    while time.time() < deadline:
        time.sleep(0.05)
    sys.exit(0)
def on_term(*_):
    out.write("TERM\\n")
    sys.exit(3)
signal.signal(signal.SIGINT, on_int)
signal.signal(signal.SIGTERM, on_term)
out.write(f"pid {os.getpid()} pgid {os.getpgid(0)}\\n")
while True:
    time.sleep(0.05)
"""


def _start(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "child.log"
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    parent = subprocess.Popen(
        [sys.executable, "-c", "import sys; from rayattn import serve_run; "
         f"sys.exit(serve_run.run([sys.executable, {str(child)!r}, {str(log)!r}]))"],
        start_new_session=True)
    deadline = time.time() + 30
    while not (log.exists() and log.read_text().startswith("pid")):
        assert parent.poll() is None and time.time() < deadline, "the child did not start"
        time.sleep(0.05)
    return parent, log


def _child_pid(log: Path) -> int:
    return int(log.read_text().split()[1])


def test_a_sigterm_to_the_group_reaches_the_child_once_as_sigint(tmp_path):
    parent, log = _start(tmp_path)
    # Its own process group: a signal to the parent's group does not reach it directly.
    assert os.getpgid(_child_pid(log)) != os.getpgid(parent.pid)
    os.killpg(parent.pid, signal.SIGTERM)
    assert parent.wait(timeout=30) == 0
    assert log.read_text().splitlines()[1:] == ["INT"]


def test_a_second_signal_stops_it_without_the_drain(tmp_path):
    parent, log = _start(tmp_path)
    os.killpg(parent.pid, signal.SIGINT)
    deadline = time.time() + 10
    while "INT" not in log.read_text():
        assert time.time() < deadline
        time.sleep(0.05)
    os.killpg(parent.pid, signal.SIGINT)
    assert parent.wait(timeout=30) == 3
    assert log.read_text().splitlines()[1:] == ["INT", "TERM"]


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_the_child_dies_with_the_parent(tmp_path):
    parent, log = _start(tmp_path)
    child = psutil.Process(_child_pid(log))
    parent.kill()
    parent.wait(timeout=10)
    child.wait(timeout=10)  # psutil.TimeoutExpired if it outlived its parent
