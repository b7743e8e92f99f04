"""Drain Serve's HAProxy front door before a stop, through HAProxy's admin socket.

Serve's shutdown kills its HAProxy first (ray/serve/_private/haproxy.py, `HAProxyApi.stop`)
and only then lets the replicas finish their requests, so a stream in flight through the
front door is cut by every stop. Before `rayattn serve` passes a stop on to `serve run`
(rayattn/serve_run.py), it disables the front door's frontends (new connections are
refused: a load balancer or client retries elsewhere; the connections already open are
served) and waits until no request is in flight at HAProxy's backends. Streams, not connections,
are counted: a client's idle keep-alive connection holds no backend stream.

The socket is Serve's, one per node (`<dir of RAY_SERVE_HAPROXY_SOCKET_PATH>/<node id>/<name>`,
`level admin` in Serve's HAProxy template); front_door.apply puts it in a directory of this
process's own."""

from __future__ import annotations

import csv
import glob
import logging
import os
import socket
import time
from collections.abc import Callable

import psutil

log = logging.getLogger("rayattn.serve")

FRONTENDS = ("http_frontend", "grpc_frontend")
"""The frontends of Serve's HAProxy template that take requests (not `stats`, `prometheus`)."""


def sockets(environ: dict[str, str] | None = None) -> list[str]:
    """This cluster's HAProxy admin sockets (none: the front door is not HAProxy)."""
    path = (environ if environ is not None else os.environ).get("RAY_SERVE_HAPROXY_SOCKET_PATH")
    if not path:
        return []
    folder, name = os.path.split(path)
    return sorted(glob.glob(os.path.join(glob.escape(folder), "*", glob.escape(name))))


def command(path: str, line: str, timeout: float = 5.0) -> str:
    """One command on the admin socket; its answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(line.encode() + b"\n")
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def in_flight(stat_csv: str) -> int:
    """Requests being served: the streams at every backend (`show stat`'s BACKEND rows, scur)."""
    rows = csv.DictReader(stat_csv.lstrip("# ").splitlines())
    return sum(int(r.get("scur") or 0) for r in rows
               if r.get("svname") == "BACKEND" and r.get("pxname") != "stats")


def pid(path: str) -> int | None:
    """The pid of the HAProxy answering on `path` (`show info`)."""
    for line in command(path, "show info").splitlines():
        if line.startswith("Pid:"):
            return int(line.split(":", 1)[1])
    return None


def drain(paths: list[str], timeout_s: float, stop_waiting: Callable[[], bool],
          poll_s: float = 0.2) -> int:
    """Close the frontends behind `paths` to new connections, then wait until no request is
    in flight there, `timeout_s` passes or `stop_waiting()` is true. Returns what was still in
    flight (0: drained). A socket that does not answer counts as drained: there is nothing to
    wait for. Requests on connections already open still come in (HAProxy's `disable
    frontend` pauses the listeners only): under steady keep-alive load the wait lasts to its
    timeout.

    Serve reloads HAProxy when its targets change (a router leaving as the load goes): the
    new process takes the socket with its frontends open, and the old one finishes its
    streams unseen. So each look at a socket disables the frontends of a process it has not
    seen yet, and the wait lasts while an earlier process lives."""
    seen: dict[str, set[int | None]] = {path: set() for path in paths}
    deadline = time.monotonic() + timeout_s
    left = 0
    while seen:
        left = 0
        for path in list(seen):
            try:
                now = pid(path)
                if now not in seen[path]:
                    _disable(path)
                    seen[path].add(now)
                left += in_flight(command(path, "show stat"))
                earlier = [p for p in seen[path]
                           if p is not None and p != now and psutil.pid_exists(p)]
                left += len(earlier)  # their streams, unseen: at least one each
            except (OSError, ValueError) as e:
                log.warning("front door %s: not drained (%s)", path, e)
                del seen[path]
        if left == 0 or stop_waiting() or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    return left


def _disable(path: str) -> None:
    for name in FRONTENDS:
        answer = command(path, f"disable frontend {name}").strip()
        if answer and not answer.startswith("No such frontend"):
            log.warning("front door %s: disable frontend %s: %s", path, name, answer)
