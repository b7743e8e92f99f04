"""Ray core's private API, as rayattn uses it; pinned by
tests/unit/integrations/test_ray_private.py."""

from __future__ import annotations


def num_cpus() -> float:
    """The CPUs a Ray started on this machine (`serve run`, `ray start`) will find: Ray's own
    count (cgroup quotas, Docker's limits)."""
    from ray._private.utils import get_num_cpus

    return get_num_cpus()
