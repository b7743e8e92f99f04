"""How clients reach the router: Ray Serve's HAProxy ingress, not its Python HTTP proxy.

With `RAY_SERVE_ENABLE_HA_PROXY=1` (Ray ≥ 2.60) HAProxy listens on Serve's HTTP port and
forwards each connection to a router replica's own HTTP server. Without it, every request
and every streamed chunk crosses Serve's proxy actor and a Ray call between it and the
router: on a fast engine that hop was most of rayattn's time to first token
(docs/benchmarks.md, "The front door").

Ray reads the flag once, at import, in each of its processes, which inherit it from whatever
started Ray: so it goes into that environment (`make serve`, the tests, `rayattn bench`, the
KubeRay pods), never into the application's config. An explicit
`RAY_SERVE_ENABLE_HA_PROXY=0` keeps Serve's proxy.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from rayattn.config.schema import RouterConfig


def cluster_env(session_header: str = RouterConfig.model_fields["session_header"].default
                ) -> dict[str, str]:
    """What the process that starts Ray needs in its environment (the Makefile and the
    KubeRay manifests carry the same; tests/unit/test_front_door.py checks they agree).

    With several router replicas, HAProxy picks one by a hash of the conversation's session
    header (`router.session_header`), so every turn of a conversation meets the router that
    routed the one before: its own record of where the history went, the tokens it already
    tokenized and hashed. Requests without the header are spread by round robin."""
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1",
            "RAY_SERVE_HAPROXY_BALANCE_ALGORITHM": f"hdr({session_header})"}


CLUSTER_ENV = cluster_env()


def apply(environ: MutableMapping[str, str] = os.environ) -> None:
    """Before `ray.init` in this process: the cluster it starts uses HAProxy, unless the
    operator chose otherwise."""
    for k, v in CLUSTER_ENV.items():
        environ.setdefault(k, v)


def mode() -> str:
    """`haproxy` or `serve_proxy`: what Serve in this Ray process decided at import."""
    try:
        from ray.serve._private import constants
    except ImportError:  # pragma: no cover - Ray's layout moved
        return "serve_proxy"
    return "haproxy" if getattr(constants, "RAY_SERVE_ENABLE_HA_PROXY", False) \
        else "serve_proxy"
