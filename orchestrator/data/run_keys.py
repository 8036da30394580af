"""The reward and environment a data folder names for its tasks, which a run takes unless its
command line sets them.

``<data-path>/demo.json`` (what ``orchestrator demo-data`` writes) may hold::

    "run_keys": {"rl.reward": "orchestrator.rewards:math", "rl.environment": "orchestrator.demo.calculator:Calculator"}

A run takes each of :data:`KEYS` from there when its command line does not set it; a key
given on the command line wins, and an ``rl.agent`` given there stands for the folder's
``rl.environment`` (both say how a sample runs). The values taken are the config's like any other, so they
enter the config fingerprint: every rank (and a resume) must reach the same effective reward.
"""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.errors import ConfigError

FILE = "demo.json"
FIELD = "run_keys"
KEYS = ("rl.reward", "rl.environment")
"""The only keys a data folder may name: what its tasks need, not how to train on them."""


def path(data_path: Path) -> Path:
    return Path(data_path) / FILE


def read(data_path: Path) -> dict[str, str]:
    """The keys the folder names ({} when it has no demo.json or the file names none).
    Raises ConfigError for a key outside :data:`KEYS` or a value that is not a string."""
    where = path(data_path)
    try:
        body = json.loads(where.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: cannot be read as JSON ({e}): remake it with `orchestrator demo-data`, or remove it") from None
    named = body.get(FIELD, {}) if isinstance(body, dict) else {}
    if not isinstance(named, dict):
        raise ConfigError(f"{where}: {FIELD} must be an object of config keys, e.g. {{\"rl.reward\": \"orchestrator.rewards:math\"}}")
    for key, value in named.items():
        if key not in KEYS:
            raise ConfigError(f"{where}: {FIELD} names {key!r}, but a data folder names only {' and '.join(KEYS)}")
        if not isinstance(value, str):
            raise ConfigError(f"{where}: {FIELD}[{key!r}] must be a string (module:name), got {value!r}")
    return named


def apply(sections: dict[str, dict[str, object]], data_path: Path) -> tuple[str, ...]:
    """Fill each key of :data:`KEYS` that ``sections`` (parsed overrides, by section) leaves
    unset from the folder's demo.json; return what was taken, as ``key=value`` lines for the log."""
    taken = []
    for key, value in read(data_path).items():
        section, _, name = key.partition(".")
        if key == "rl.environment" and "agent" in sections.get("rl", {}):
            continue
        if name not in sections.setdefault(section, {}):
            sections[section][name] = value
            taken.append(f"{key}={value}")
    return tuple(taken)
