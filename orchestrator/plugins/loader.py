"""User code named as ``module:name`` (``rl.reward``, ``rl.environment``): parsed and imported
alike, each failure a ValueError that names the config key and what is wrong."""

from __future__ import annotations

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
        raise ValueError(f"{key}={spec!r}: cannot import {module_name}: {e}") from None
    found = getattr(module, attr, None)
    if not accept(found):
        raise ValueError(f"{key}={spec!r}: {module_name} has no {noun} {attr}")
    return found
