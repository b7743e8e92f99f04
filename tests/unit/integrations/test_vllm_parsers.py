"""Pins: the private parser registry tables `rayattn check` reads from vLLM's source
(rayattn/integrations/vllm_parsers.py): without them parser names go unchecked, silently."""

from __future__ import annotations

import pytest

from rayattn.integrations import vllm_parsers
from tests.unit.integrations import pins


@pytest.mark.parametrize("kind", sorted(vllm_parsers.REGISTRIES))
def test_the_registry_table_is_in_the_packages_init(kind):
    package, table = vllm_parsers.REGISTRIES[kind]
    assert vllm_parsers.parser_names(kind), (
        f"{pins.version('vllm')}: no {table} dict in {package}/__init__.py; "
        f"rayattn/integrations/vllm_parsers.py reads the {kind} parser names from it")
