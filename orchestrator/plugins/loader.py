"""User code named as ``module:name`` (``rl.reward``, ``rl.environment``): parsed and imported
alike, each failure a ValueError that names the config key and what is wrong."""

from __future__ import annotations

import difflib
import importlib
from typing import Callable


def parse(spec: str, *, key: str, form: str, example: str) -> tuple[str, str]:
    """(module, name) of ``module:name``; ValueError when it is not of that form. ``form``: the
    name's kind as the message spells it (``function``, ``Class``)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{key}={spec!r} is not of the form module:{form} (e.g. {example})")
    return module_name, attr


def resolve(spec: str, *, key: str, form: str, example: str, noun: str, accept: Callable[[object], bool]) -> object:
    """What ``module:name`` names, imported; ValueError when the module cannot be imported or
    it has no ``noun`` of that name that ``accept`` takes."""
    module_name, attr = parse(spec, key=key, form=form, example=example)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        missing = getattr(e, "name", None)
        where = (f"; {missing} must be importable by every rank's Python: installed, or its directory on PYTHONPATH "
                 f"(docs/rl.md, \"Rewards\"; docs/environments.md)") if missing and module_name.startswith(missing) else ""
        raise ValueError(f"{key}={spec!r}: cannot import {module_name}: {e}{where}") from None
    found = getattr(module, attr, None)
    if not accept(found):
        raise ValueError(f"{key}={spec!r}: {module_name} has no {noun} {attr}{_suggest(module, attr, accept)}")
    return found


def _suggest(module, attr: str, accept: Callable[[object], bool]) -> str:
    """", did you mean X?" for the closest of the module's own names that ``accept`` takes,
    else the names it has (a few), else nothing."""
    public = getattr(module, "__all__", None)  # a module that re-exports names lists them
    own = sorted(n for n, v in vars(module).items() if not n.startswith("_") and accept(v)
                 and (n in public if public is not None else getattr(v, "__module__", None) == module.__name__))
    close = difflib.get_close_matches(attr, own, n=3, cutoff=0.6) or [n for n in own if n.startswith(attr) or attr in n][:3]
    if close:
        return f": did you mean {' or '.join(close)}?"
    return f" (it has {', '.join(own[:8])})" if own else ""
