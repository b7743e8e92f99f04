"""The front door's drain before a stop (rayattn/server/haproxy_admin.py) against a stand-in
for HAProxy's admin socket: the frontends are disabled first, then the wait lasts until no
backend stream is left (idle client connections do not count), the timeout, or a second
stop."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest

from rayattn.server import haproxy_admin

HEADER = "# pxname,svname,qcur,qmax,scur,smax\n"


class FakeAdmin:
    """Answers `show info` (its `pid`), `disable frontend` and `show stat`; the in-flight
    streams fall by one per look from `streams` unless `falls` is False."""

    def __init__(self, path: str, streams: int, falls: bool = True) -> None:
        self.commands: list[str] = []
        self.streams, self.falls, self.pid = streams, falls, 4242
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        self.server.listen()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                line = conn.recv(1024).decode().strip()
                self.commands.append(line)
                if line == "show info":
                    conn.sendall(f"Name: HAProxy\nPid: {self.pid}\n".encode())
                if line == "show stat":
                    rows = [f"http_frontend,FRONTEND,,,{self.streams + 3},9",  # + idle clients
                            f"router_backend,BACKEND,0,0,{self.streams},9",
                            "stats,BACKEND,0,0,1,1"]
                    conn.sendall((HEADER + "\n".join(rows) + "\n").encode())
                    if self.falls and self.streams:
                        self.streams -= 1

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def admin_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="rah-t", dir="/tmp")  # AF_UNIX paths are short
    os.mkdir(os.path.join(d, "node1"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_sockets_are_found_per_node(admin_dir):
    env = {"RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(admin_dir, "admin.sock")}
    fake = FakeAdmin(os.path.join(admin_dir, "node1", "admin.sock"), 0)
    try:
        assert haproxy_admin.sockets(env) == [os.path.join(admin_dir, "node1", "admin.sock")]
        assert haproxy_admin.sockets({}) == []
    finally:
        fake.close()


def test_drain_disables_the_frontends_then_waits_for_the_streams(admin_dir):
    path = os.path.join(admin_dir, "node1", "admin.sock")
    fake = FakeAdmin(path, 2)
    try:
        left = haproxy_admin.drain([path], timeout_s=30, stop_waiting=lambda: False,
                                   poll_s=0.01)
        assert left == 0
        assert fake.commands[:3] == ["show info", "disable frontend http_frontend",
                                     "disable frontend grpc_frontend"]
        # 2 streams, then 1, then none: three looks, the idle clients and `stats` not counted.
        looks = [c for c in fake.commands if c != "show info"][2:]
        assert looks == ["show stat"] * 3
    finally:
        fake.close()


def test_drain_ends_at_its_timeout_or_a_second_stop(admin_dir):
    path = os.path.join(admin_dir, "node1", "admin.sock")
    fake = FakeAdmin(path, 1, falls=False)
    try:
        t0 = time.monotonic()
        assert haproxy_admin.drain([path], 0.3, lambda: False, poll_s=0.01) == 1
        assert 0.3 <= time.monotonic() - t0 < 10
        stops = iter([False, True])
        assert haproxy_admin.drain([path], 30, lambda: next(stops), poll_s=0.01) == 1
    finally:
        fake.close()


def test_a_socket_that_does_not_answer_is_not_waited_for(admin_dir):
    assert haproxy_admin.drain([os.path.join(admin_dir, "node1", "gone.sock")], 30,
                               lambda: False) == 0


def test_a_reload_during_the_drain_is_disabled_too_and_its_predecessor_awaited(admin_dir):
    """Serve reloads HAProxy as its targets change: the new process answers on the socket
    with its frontends open, the old one finishes its streams where no `show stat` sees
    them. The drain disables the new one and waits for the old one to end."""
    path = os.path.join(admin_dir, "node1", "admin.sock")
    old = subprocess.Popen(["sleep", "60"])  # the old HAProxy, serving one stream
    fake = FakeAdmin(path, 1, falls=False)
    fake.pid = old.pid

    def reload() -> None:
        fake.pid, fake.streams = 4343, 0  # the new process: nothing in flight it can see

    threading.Timer(0.2, reload).start()
    # Ended and reaped (its parent, Serve's HAProxyManager, reaps the real one).
    threading.Timer(0.6, lambda: (old.kill(), old.wait())).start()
    try:
        t0 = time.monotonic()
        assert haproxy_admin.drain([path], 30, lambda: False, poll_s=0.01) == 0
        assert time.monotonic() - t0 >= 0.6  # until the old process ended
        assert fake.commands.count("disable frontend http_frontend") == 2  # old, then new
    finally:
        old.kill()
        old.wait()
        fake.close()
