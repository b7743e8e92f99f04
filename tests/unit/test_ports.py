"""rayattn/ports.py: ports chosen so that no other process can take them between choice
and use."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from rayattn import ports

# Run in a network namespace of its own (its ports and its ephemeral range are its own, so
# taking every ephemeral port there disturbs nothing else on the machine): another process
# takes every port the kernel hands out, as a busy download does, between the choice of a
# port and the server's bind.
_RACE = r"""
import json, socket, subprocess, sys, time
from rayattn import ports

old = [ports._kernel_port() for _ in range(5)]  # the old way: bind 0, close, hand it on
new = [ports.pick_port() for _ in range(5)]
hog = subprocess.Popen([sys.executable, "-c", '''
import socket, sys
lst = socket.create_server(("127.0.0.1", 0), backlog=4096)
out = []
while True:
    try:
        out.append(socket.create_connection(lst.getsockname()))
    except OSError:
        break
print(len(out), flush=True)
sys.stdin.read()
'''], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
taken = int(hog.stdout.readline())
served = {}
for p in new:  # what the server given the number does
    try:
        with socket.create_server(("127.0.0.1", p)):
            served[p] = True
    except OSError:
        served[p] = False
print(json.dumps({"taken": taken, "range": ports.ephemeral_range(),
                  "old_free": [ports.bindable(p) for p in old],
                  "new": new, "served": list(served.values())}))
hog.stdin.close()
hog.wait()
"""


def test_picked_ports_are_outside_the_ephemeral_range_distinct_and_free():
    lo, hi = ports.ephemeral_range()
    got = [ports.pick_port() for _ in range(20)]
    try:
        assert len(set(got)) == 20
        assert all(not lo <= p <= hi and p >= ports.LOWEST for p in got), (got, lo, hi)
        assert all(ports.bindable(p) for p in got)
    finally:
        for p in got:
            ports.release(p)


def test_picked_ports_avoid_serves_router_ranges(monkeypatch):
    monkeypatch.setenv("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "20000")
    monkeypatch.setenv("RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", "29999")
    pool = ports.candidates()
    assert pool and not any(20000 <= p <= 29999 or 40000 <= p <= 41000 for p in pool)


def test_a_window_of_ports_is_free_and_held_as_a_whole():
    p = ports.pick_port(span=32)
    try:
        lo, hi = ports.ephemeral_range()
        assert all(ports.bindable(p + i) and not lo <= p + i <= hi for i in range(32))
        # No other pick lands inside the window while it is held.
        others = [ports.pick_port() for _ in range(50)]
        assert not any(p <= o < p + 32 for o in others)
        for o in others:
            ports.release(o)
    finally:
        ports.release(p, 32)


def test_a_machine_with_no_port_outside_the_ephemeral_range_gets_a_kernel_port(monkeypatch,
                                                                               caplog):
    monkeypatch.setattr(ports, "candidates", lambda: [])
    port = ports.pick_port()
    assert 0 < port < 65536 and "ephemeral range" in caplog.text


def test_another_process_cannot_pick_a_port_this_one_holds():
    mine = {ports.pick_port() for _ in range(3)}
    try:
        code = ("import json; from rayattn import ports; "
                f"print(json.dumps([ports._lock(p) for p in {sorted(mine)!r}]))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout
        assert json.loads(out) == [False, False, False]
    finally:
        for p in mine:
            ports.release(p)
    # Released, the next process may take them.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert json.loads(out) == [True, True, True]


def test_holder_names_the_listening_process():
    import socket

    p = ports.pick_port()
    try:
        assert ports.holder(p) is None
        with socket.create_server(("127.0.0.1", p)):
            assert f"(pid {os.getpid()})" in (ports.holder(p) or "")
    finally:
        ports.release(p)


def test_a_process_taking_every_ephemeral_port_does_not_take_a_picked_one():
    """The port race, made certain: between the choice of a port and the bind,
    another process takes every port the kernel hands out. A port taken the old way (bind
    0, close) is gone; one from pick_port is still there for its server."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        pytest.skip("needs root, unshare and iproute2 for a network namespace of its own")
    # A small ephemeral range in the namespace: the other process takes all of it quickly.
    script = ("ip link set lo up && "
              "echo '40000 40999' > /proc/sys/net/ipv4/ip_local_port_range && "
              f"exec {sys.executable} -c \"$RACE\"")
    out = subprocess.run(["unshare", "--net", "sh", "-c", script], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "RACE": _RACE})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["range"] == [40000, 40999]
    assert got["taken"] >= 900, got  # the other process holds (nearly) the whole range
    assert not any(got["old_free"]), got  # the race: every kernel-chosen port was taken
    assert all(not 40000 <= p <= 40999 for p in got["new"]), got
    assert all(got["served"]), got  # every picked port still binds for its server
