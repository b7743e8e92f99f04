"""Ray Serve's private API, as rayattn uses it: its controller (one deployment's config), its
client's declarative deploy, a rolling update's share, and the HAProxy ingress settings Serve
read at import. Each is pinned by tests/unit/integrations/test_serve_private.py."""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve.deployment import Deployment


def default_rolling_share() -> float:
    """The share of replicas Serve's rolling update replaces at a time unless told (read
    when asked: `rayattn check` and `render-k8s` import this module without Ray)."""
    from ray.serve._private.constants import DEFAULT_ROLLING_UPDATE_PERCENTAGE

    return DEFAULT_ROLLING_UPDATE_PERCENTAGE


def replacing_at_once(deployment: Deployment, share: float) -> Deployment:
    """`deployment` with Serve's rolling_update_percentage set to `share`: Serve's config
    files take it, `Deployment.options()` does not. Marked as user-set, as the config file
    would, so a redeploy keeps it."""
    config = deployment._deployment_config
    config.rolling_update_percentage = share
    config.user_configured_option_names.add("rolling_update_percentage")
    return deployment


async def serve_autoscales(app: str, deployment: str) -> bool | None:
    """Whether Serve may change a deployment's replica count under load (an
    autoscaling_config with max_replicas above min_replicas), as Serve's controller has it
    now: a live change to the bounds reaches neither the replicas' context nor their args.
    None: no answer (not under Serve, or Ray's layout differs). Asked for the one
    deployment's config: the whole instance's details grow with every application and
    replica, and each engine replica asks every few seconds."""
    try:
        from ray.serve._private.common import DeploymentID

        # The lookup is a blocking call to Ray's GCS (once: cached), not on the caller's loop.
        controller = await asyncio.to_thread(_serve_controller)
        config = await controller.get_deployment_config.remote(
            DeploymentID(name=deployment, app_name=app))
        if config is None:  # no such deployment
            return None
        auto = config.autoscaling_config
        return auto is not None and auto.max_replicas > auto.min_replicas
    except Exception:
        return None


@functools.cache
def _serve_controller() -> Any:
    """Serve's controller (a detached actor: its handle outlives a restart of it), looked up
    once: the lookup is a blocking call to Ray's GCS."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)


def deploy_apps(schema: Any) -> None:
    """Deploy a ServeDeploySchema's applications declaratively, as `serve run <file>` and
    `serve deploy` do, through the client of the Serve instance this process is connected to
    (started where it is not running)."""
    from ray.serve._private.api import serve_start

    serve_start().deploy_apps(schema)


def haproxy_ingress() -> tuple[bool, str]:
    """Serve's HAProxy ingress as Serve in this Ray process decided at import: whether it is
    on (RAY_SERVE_ENABLE_HA_PROXY) and HAProxy's balance algorithm ("" where not set; off
    where Ray's layout moved)."""
    try:
        from ray.serve._private import constants
    except ImportError:  # pragma: no cover - Ray's layout moved
        constants = None
    return (bool(getattr(constants, "RAY_SERVE_ENABLE_HA_PROXY", False)),
            str(getattr(constants, "RAY_SERVE_HAPROXY_BALANCE_ALGORITHM", "")))
