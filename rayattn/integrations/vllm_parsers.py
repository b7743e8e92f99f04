"""The installed vLLM's reasoning and tool-call parser names, for `rayattn check`: read from
the private registry tables in the packages' __init__ without importing vLLM (that takes
seconds, and `rayattn check` runs anywhere)."""

from __future__ import annotations

import ast
import functools
import importlib.util
import os

REGISTRIES = {"reasoning": ("vllm.reasoning", "_REASONING_PARSERS_TO_REGISTER"),
              "tool": ("vllm.tool_parsers", "_TOOL_PARSERS_TO_REGISTER")}
"""Kind → (package, the registry table in its __init__)."""


@functools.cache
def parser_names(kind: str) -> frozenset[str] | None:
    """Names of the installed vLLM's reasoning (`kind="reasoning"`) or tool-call (`"tool"`)
    parsers; None without vLLM or where the table is not found (then nothing is checked)."""
    package, table = REGISTRIES[kind]
    try:
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            return None
        root = os.path.join(list(spec.submodule_search_locations)[0],
                            *package.split(".")[1:], "__init__.py")
        with open(root) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ImportError, ValueError):
        return None
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == table and \
                isinstance(node.value, ast.Dict):
            return frozenset(k.value for k in node.value.keys
                             if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return None
