"""Ports rayattn chooses itself: the tests' and benchmarks' servers (Serve's HTTP port,
HAProxy's stats and metrics, Ray's metrics export, Prometheus), an engine's TCPStore window
(`VLLM_DP_MASTER_PORT`, compat.py).

Asking the kernel for port 0 and closing the socket hands out a port of the ephemeral range:
until the server that is given the number binds it, any outgoing connection on the machine
can take it (seen: every integration test erroring at HAProxy's `Address already in use`
while a download ran beside the suite). So `pick_port` chooses outside that range, where
the kernel never assigns a port by itself, and above Ray's worker ports (10002-19999 by
default). Two rayattn processes on one host do not pick the same port: each holds a
`flock` on a file named for its port for as long as it lives.

Ray Serve's routers bind their own ports in ranges of their own (direct ingress); those are
left out too. Where the machine leaves nothing outside the ephemeral range (a widened
`ip_local_port_range`), a port the kernel hands out is the fallback, with a warning.

`holder` names the process listening on a port, for start-up errors that say who holds it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import random
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
RESERVED_PORTS_FILE = "/proc/sys/net/ipv4/ip_local_reserved_ports"
LOWEST = 20000
"""Below: Ray's worker ports (10002-19999) and the well-known services' ports."""
DEFAULT_EPHEMERAL = (32768, 60999)
"""Linux's default, for a machine that does not say."""
_INGRESS = "RAY_SERVE_DIRECT_INGRESS_"
SERVE_RANGES = {(f"{_INGRESS}MIN_HTTP_PORT", f"{_INGRESS}MAX_HTTP_PORT"): (30000, 31000),
                (f"{_INGRESS}MIN_GRPC_PORT", f"{_INGRESS}MAX_GRPC_PORT"): (40000, 41000)}
"""Where Ray Serve's router replicas bind their own HTTP and gRPC ports: variables, Ray's
defaults (ray/serve/_private/constants.py)."""
LOCK_DIR = Path(tempfile.gettempdir()) / f"rayattn-ports-{os.getuid()}"

_held: dict[int, int] = {}
"""Port → descriptor of its lock file, kept open for the life of this process."""


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's range for ports it assigns itself (bind to 0, connect), inclusive."""
    try:
        lo, hi = (int(x) for x in Path(path).read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def _reserved(path: str = RESERVED_PORTS_FILE) -> set[int]:
    out: set[int] = set()
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return out
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _serve_ranges(environ: Mapping[str, str]) -> list[tuple[int, int]]:
    out = []
    for (lo_var, hi_var), (lo, hi) in SERVE_RANGES.items():
        try:
            out.append((int(environ.get(lo_var, lo)), int(environ.get(hi_var, hi))))
        except ValueError:
            out.append((lo, hi))
    return out


def candidates(ephemeral: tuple[int, int] | None = None,
               environ: Mapping[str, str] = os.environ) -> list[int]:
    """Ports `pick_port` may choose: from LOWEST up, outside the ephemeral range and Serve's
    router ranges."""
    taken = [ephemeral or ephemeral_range(), *_serve_ranges(environ)]
    reserved = _reserved()
    return [p for p in range(LOWEST, 65536)
            if p not in reserved and not any(lo <= p <= hi for lo, hi in taken)]


def bindable(port: int) -> bool:
    """Nothing is bound to `port` on any address (no SO_REUSEADDR: a port in TIME_WAIT
    counts as taken, as it does for most servers)."""
    for family, host in ((socket.AF_INET, ""), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family) as s:
                s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False
            if family == socket.AF_INET:
                raise
            # No IPv6 on this machine: the IPv4 answer is the answer.
    return True


def _lock(port: int) -> bool:
    """Hold `port`'s lock file (False where another process holds it, or it cannot be
    made)."""
    try:
        LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(LOCK_DIR / str(port), os.O_CREAT | os.O_RDWR, 0o600)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _held[port] = fd
    return True


def release(port: int, span: int = 1) -> None:
    """Let other rayattn processes pick `port` (and the `span - 1` after it) again."""
    for p in range(port, port + span):
        fd = _held.pop(p, None)
        if fd is not None:
            os.close(fd)


def _kernel_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def pick_port(span: int = 1) -> int:
    """A port, with the `span - 1` after it, that nothing binds now, that the kernel will
    not hand to an outgoing connection, and that no other rayattn process on this host
    picks while this one lives (every port of the window is held)."""
    pool = candidates()
    allowed = set(pool)
    for port in random.sample(pool, len(pool)):
        window = range(port, port + span)
        if any(p in _held or p not in allowed for p in window):
            continue
        locked = 0
        for p in window:
            if not _lock(p):
                break
            locked += 1
        if locked == span and all(bindable(p) for p in window):
            return port
        release(port, locked)
    lo, hi = ephemeral_range()
    log.warning("no free port from %d outside the ephemeral range %d-%d and Serve's router "
                "ranges: using one the kernel hands out, which another process may take "
                "before it is bound", LOWEST, lo, hi)
    return _kernel_port()


def holder(port: int) -> str | None:
    """`name (pid N)` of the process listening on TCP `port`, or None when none is seen."""
    # psutil: only once a port is found held (the CLI imports this module on every start).
    import psutil

    try:
        conns = psutil.net_connections("tcp")
    except psutil.AccessDenied:
        conns = []
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
            if c.pid is None:
                return "a process of another user"
            try:
                return f"{psutil.Process(c.pid).name()} (pid {c.pid})"
            except psutil.Error:
                return f"pid {c.pid}"
    return None
