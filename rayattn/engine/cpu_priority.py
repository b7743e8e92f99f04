"""Engines at the host's normal CPU priority, as `vllm serve` runs.

Ray starts every worker process at nice 15 (its `RAY_worker_niceness`), and a Serve replica's
children inherit it: vLLM's EngineCore, whose scheduler step feeds the accelerator, and on
CPU the model's own workers. Against a nice-0 process the kernel then gives them about 1/29
of the CPU (weights 36 against 1024): a benchmark client, a node exporter or Ray's own
daemons take the cores first, and the engine's step waits. The rivals' `vllm serve` runs at
nice 0, so rayattn's engines would be measured, and would serve, handicapped.

Each Ray worker reads the setting from its own environment as it starts (a worker at 0 calls
`nice(0)`, which changes nothing, so it needs no privilege). Two ways carry it, from this one
declaration: the engine and router deployments' `runtime_env` (rayattn/app.py), whatever
started the cluster; and the environment of what starts Ray (`make serve`, the tests,
`rayattn bench`, the KubeRay pods), so that Serve's own actors (its controller, the
HAProxy that is the front door) run at 0 too. An operator's own value is kept.

The cost: at nice 15 Ray's daemons (GCS, raylet) and the driver took the CPU before a busy
worker; at 0 they share it evenly with the engines. On a host with spare cores that is
nothing; on a 2-core CPU machine the engines' workers keep both cores busy and the daemons
wait their turn, as they do beside `vllm serve`. A value in between is the operator's to set.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping


def cluster_env() -> dict[str, str]:
    """What the process that starts Ray needs in its environment for normal-priority
    workers (the Makefile and the KubeRay manifests carry the same)."""
    return {"RAY_worker_niceness": "0"}


def apply(environ: MutableMapping[str, str] = os.environ) -> None:
    """Before `ray.init` starts a cluster in this process."""
    for k, v in cluster_env().items():
        environ.setdefault(k, v)


def warning() -> str | None:
    """What to tell the operator when this process runs below normal priority (None when
    it does not)."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice <= 0:
        return None
    return (f"this engine runs at nice {nice}: any normal-priority process on the host takes "
            "the CPU before its scheduler step; start Ray with "
            + " ".join(f"{k}={v}" for k, v in cluster_env().items())
            + " (rayattn/engine/cpu_priority.py)")
