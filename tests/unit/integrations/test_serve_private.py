"""rayattn.integrations.serve_private: Ray Serve's private API as rayattn calls it, and the
private and undocumented parts of Serve that rayattn relies on elsewhere."""

from __future__ import annotations

import asyncio
import os

from rayattn.integrations import serve_private
from tests.unit.integrations import pins


class _Controller:
    """Serve's controller as serve_private.serve_autoscales calls it (one deployment's config)."""

    def __init__(self, configs: dict | Exception) -> None:
        self.configs, self.asked = configs, []

        async def remote(deployment_id):
            self.asked.append(deployment_id)
            if isinstance(self.configs, Exception):
                raise self.configs
            return self.configs.get((deployment_id.app_name, deployment_id.name))

        self.get_deployment_config = type("Method", (), {"remote": staticmethod(remote)})


def test_serve_autoscales_reads_one_deployments_config(monkeypatch):
    # Plain asyncio.run: the GPU image's pytest has no asyncio plugin.
    from ray.serve._private.config import DeploymentConfig

    def config(**auto):
        return DeploymentConfig(autoscaling_config=auto or None,
                                num_replicas=None if auto else 2)

    ctl = _Controller({("app", "elastic"): config(min_replicas=1, max_replicas=3),
                       ("app", "pinned"): config(min_replicas=2, max_replicas=2),
                       ("app", "fixed"): config()})
    monkeypatch.setattr(serve_private, "_serve_controller", lambda: ctl)
    assert asyncio.run(serve_private.serve_autoscales("app", "elastic")) is True
    assert asyncio.run(serve_private.serve_autoscales("app", "pinned")) is False  # bounds equal
    assert asyncio.run(serve_private.serve_autoscales("app", "fixed")) is False
    assert asyncio.run(serve_private.serve_autoscales("app", "gone")) is None  # no answer, not "no"
    assert [(d.app_name, d.name) for d in ctl.asked] == [
        ("app", "elastic"), ("app", "pinned"), ("app", "fixed"), ("app", "gone")]
    monkeypatch.setattr(serve_private, "_serve_controller",
                        lambda: _Controller(RuntimeError("down")))
    assert asyncio.run(serve_private.serve_autoscales("app", "elastic")) is None


# --- pins: the private API serve_private.py calls ---------------------------------------------
USER = "rayattn/integrations/serve_private.py"


def test_the_controller_is_found_by_name_and_asked_for_one_deployments_config():
    from ray.serve._private import constants
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.config import DeploymentConfig
    from ray.serve._private.controller import ServeController
    from ray.serve.config import AutoscalingConfig

    pins.attrs(constants, "SERVE_CONTROLLER_NAME", "SERVE_NAMESPACE",
               user=f"{USER} _serve_controller")
    pins.params(ServeController.get_deployment_config, "deployment_id", leading=True,
                user=f"{USER} serve_autoscales")
    pins.attrs(DeploymentID, "name", "app_name", user=f"{USER} serve_autoscales")
    pins.attrs(DeploymentConfig, "autoscaling_config", user=f"{USER} serve_autoscales")
    pins.attrs(AutoscalingConfig, "min_replicas", "max_replicas",
               user=f"{USER} serve_autoscales")


def test_serve_start_hands_out_a_client_that_deploys_a_config():
    from ray.serve._private.api import serve_start
    from ray.serve._private.client import ServeControllerClient

    pins.no_required(serve_start, user=f"{USER} deploy_apps")
    pins.params(ServeControllerClient.deploy_apps, "config", leading=True,
                user=f"{USER} deploy_apps")


def test_serve_reads_the_haproxy_settings_rayattn_sets_and_reports():
    """rayattn sets these variables before Ray starts (server/front_door.py, app.py, the
    benchmark's rival), copies Serve's defaults of some (ports.py, front_door.HAPROXY_PORTS)
    and reads what Serve decided from its private constants (front_door.report)."""
    from ray.serve._private import constants

    from rayattn import ports
    from rayattn.app import ROUTER_SERVE_ENV
    from rayattn.server import front_door

    pins.attrs(constants, "RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_HAPROXY_BALANCE_ALGORITHM",
               user=f"{USER} haproxy_ingress")
    pins.attrs(constants, "RAY_SERVE_HAPROXY_BINARY_PATH", *front_door.PRIVATE_PATHS,
               *ROUTER_SERVE_ENV, user="rayattn/server/front_door.py apply, rayattn/app.py")
    defaults = {**front_door.HAPROXY_PORTS,
                **{k: v for pair, span in ports.SERVE_RANGES.items()
                   for k, v in zip(pair, span, strict=True)}}
    pins.attrs(constants, *defaults, user="rayattn/ports.py, rayattn/server/front_door.py")
    changed = {k: (getattr(constants, k), v) for k, v in defaults.items()
               if k not in os.environ and int(getattr(constants, k)) != v}
    assert not changed, (f"{pins.version('ray')}: Serve's defaults moved ({changed}: now, "
                         "rayattn's copy); rayattn/ports.py and front_door.py copy them")


# --- pins: private or undocumented parts of Serve that rayattn relies on elsewhere -------------
def test_a_request_router_knows_its_deployment_and_the_pending_calls_arguments():
    from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

    user = "rayattn/server/fleet/pinning.py PinnedRequestRouter"
    pins.source_says(RequestRouter.__init__, r"self\._deployment_id\s*=\s*deployment_id",
                     user=f"{user}.update_replicas (self._deployment_id)")
    pins.params(RequestRouter.choose_replicas, "candidate_replicas", "pending_request",
                leading=True, user=user)
    pins.params(RequestRouter.update_replicas, "replicas", leading=True, user=user)
    pins.attrs(PendingRequest, "args", "routing_context", user=user)
    from ray.serve._private.request_router.common import RequestRoutingContext

    pins.attrs(RequestRoutingContext, "should_backoff", user=user)
    pins.attrs(RunningReplica, "replica_id", user=user)
    from ray.serve._private.common import ReplicaID

    pins.attrs(ReplicaID, "unique_id", user=user)


def test_serve_awaits_the_coroutine_a_replicas_del_returns():
    """EngineReplica.__del__ returns a coroutine (drain direct calls, then stop the engine)
    that Serve awaits on graceful shutdown: undocumented behaviour of its replica wrapper."""
    from ray.serve._private.replica import UserCallableWrapper

    user = "rayattn/engine/replica.py EngineReplica.__del__"
    pins.source_says(UserCallableWrapper.call_destructor,
                     r"_call_func_or_gen\( self\._callable\.__del__", user=user)
    pins.source_says(UserCallableWrapper._call_func_or_gen,
                     r"result = callable\(\*args, \*\*kwargs\) if inspect\.iscoroutine\(result\)"
                     r": result = await result", user=user)


def test_a_handle_can_call_by_value_with_pickle():
    """The router's gRPC and direct transports call the engine deployment by value, with the
    standard pickle (the private `_by_reference` option of a handle)."""
    from ray.serve.handle import DeploymentHandle

    pins.params(DeploymentHandle.options, "stream", "_by_reference", "request_serialization",
                "response_serialization",
                user="rayattn/server/forwarding/transport.py")


def test_replacing_at_once_reaches_serves_deployment_config():
    """The share survives Serve's own serialization of the deployment (what the controller
    gets from a declarative deploy), as a user-set option."""
    from ray import serve
    from ray.serve.deployment import deployment_to_schema

    @serve.deployment
    class D:
        pass

    d = serve_private.replacing_at_once(D.options(max_surge_percent=100), 1.0)
    schema = deployment_to_schema(d)
    assert schema.rolling_update_percentage == 1.0
    assert "rolling_update_percentage" in d._deployment_config.user_configured_option_names
    # The unmodified deployment leaves it to Serve's default, the share app.py compares with.
    assert deployment_to_schema(D).rolling_update_percentage != 1.0
    assert 0 < serve_private.default_rolling_share() < 1
