"""Pins: Ray core's private API (rayattn/integrations/ray_private.py)."""

from __future__ import annotations

from rayattn.integrations import ray_private
from tests.unit.integrations import pins


def test_ray_counts_this_machines_cpus():
    from ray._private.utils import get_num_cpus

    pins.no_required(get_num_cpus, user="rayattn/integrations/ray_private.py num_cpus")
    assert ray_private.num_cpus() >= 1
