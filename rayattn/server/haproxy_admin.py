"""Drain Serve's HAProxy front door before a stop, through HAProxy's admin socket.

Serve's shutdown kills its HAProxy first (ray/serve/_private/haproxy.py, `HAProxyApi.stop`)
and only then lets the replicas finish their requests, so a stream in flight through the
front door is cut by every stop. Before `rayattn serve` passes a stop on to `serve run`
(rayattn/serve_run.py), it disables the front door's frontends (new connections are
refused: a load balancer or client retries elsewhere; the requests already in are served)
and waits until no request is in flight at HAProxy's backends. Streams, not connections,
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


def drain(paths: list[str], timeout_s: float, stop_waiting: Callable[[], bool],
          poll_s: float = 0.2) -> int:
    """Disable the frontends behind `paths`, then wait until no request is in flight there,
    `timeout_s` passes or `stop_waiting()` is true. Returns what was still in flight (0:
    drained). A socket that does not answer counts as drained: there is nothing to wait for."""
    live = []
    for path in paths:
        try:
            for name in FRONTENDS:
                answer = command(path, f"disable frontend {name}").strip()
                if answer and not answer.startswith("No such frontend"):
                    log.warning("front door %s: disable frontend %s: %s", path, name, answer)
            live.append(path)
        except OSError as e:
            log.warning("front door %s: not drained (%s)", path, e)
    deadline = time.monotonic() + timeout_s
    left = 0
    while live:
        left = 0
        for path in list(live):
            try:
                left += in_flight(command(path, "show stat"))
            except (OSError, ValueError) as e:
                log.warning("front door %s: no longer answers (%s)", path, e)
                live.remove(path)
        if left == 0 or stop_waiting() or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    return left
