"""rayattn.integrations.serve_private: Ray Serve's private API as rayattn calls it, and the
private and undocumented parts of Serve that rayattn relies on elsewhere."""

from __future__ import annotations

import asyncio

from rayattn.integrations import serve_private


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
