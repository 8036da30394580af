"""The base model a run starts from: the directory ``model.path`` names, what a usable one
holds, and the identity every rank compares at join.

``model.path`` is empty (``<data-path>/model``, where `orchestrator demo-data` puts the
demo's), a Hugging Face model directory (a relative one under ``--data-path``), or a hub id
such as ``Qwen/Qwen2.5-0.5B-Instruct`` found in the local Hugging Face cache, resolved the
way transformers does with ``local_files_only=True``: a run never downloads. A directory of
that name under ``--data-path`` wins over the cache, as a local directory wins in
transformers. Weights are safetensors only: the orchestrator never unpickles.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from orchestrator.errors import ConfigError

DEFAULT = "model"
"""The directory under ``--data-path`` an empty ``model.path`` names."""

_INDEX = "model.safetensors.index.json"
_VOCABULARIES = ("tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
_PICKLES = ("pytorch_model*.bin", "*.pt", "*.pth")


def resolve(spec: str, data_path: Path, key: str = "model.path") -> Path:
    """The directory ``model.path=spec`` (or ``key``) names on this node. Raises ConfigError when
    it is no directory under ``data_path`` and a hub id that the local Hugging Face cache lacks."""
    path = data_path / (spec or DEFAULT)  # an absolute spec stays as it is
    if not spec or Path(spec).is_absolute() or path.is_dir() or not is_hub_id(spec):
        return path
    from huggingface_hub import constants

    return _from_cache(spec, constants.HF_HUB_CACHE, data_path, key)


def is_hub_id(spec: str) -> bool:
    """Whether ``spec`` is shaped like a hub id (``name`` or ``org/name``)."""
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(spec)
    except ValueError:
        return False
    return True


@functools.lru_cache(maxsize=8)
def _from_cache(repo_id: str, cache_dir: str, data_path: Path, key: str = "model.path") -> Path:
    """The snapshot of ``repo_id``'s main revision in ``cache_dir``. Cached per process, so a
    download that moves ``refs/main`` mid-run does not change the model under a running rank."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True))
    except OSError as e:  # LocalEntryNotFoundError; IncompleteSnapshotError says where the partial snapshot is
        if getattr(e, "snapshot_path", None):
            return Path(e.snapshot_path)  # the files it lacks may be ones a run never reads: check() names those it needs
    raise ConfigError(f"{key}={repo_id!r}: no directory {data_path / repo_id}, and {repo_id} is not in the local Hugging Face "
                      f"cache {cache_dir} (set by HF_HUB_CACHE or HF_HOME; a run never downloads). Download it on every node first "
                      f"(hf download {repo_id}), or set {key} to a model directory")


def check(directory: Path, spec: str, key: str = "model.path") -> None:
    """Raise ConfigError naming every piece the model directory lacks: config.json,
    safetensors weights (every shard its index names) and a tokenizer."""
    named = f"{key}={spec!r} names {directory}" if spec else f"the base model {directory} (model.path unset)"
    fix = (f"Set {key} to a Hugging Face model directory (absolute, or relative to --data-path) or to a hub id in "
           "the local Hugging Face cache (download it first: hf download ORG/NAME)")
    if not directory.is_dir():
        raise ConfigError(f"{named}, which is not a directory. {fix}")
    missing = [what for what in (_lacks_config(directory), _lacks_weights(directory), _lacks_tokenizer(directory)) if what]
    if missing:
        raise ConfigError(f"{named}, which lacks {'; '.join(missing)}. {fix}")


def _lacks_config(directory: Path) -> str | None:
    return None if (directory / "config.json").is_file() else "config.json"


def _lacks_weights(directory: Path) -> str | None:
    if (directory / _INDEX).is_file():
        try:
            shards = sorted(set(json.loads((directory / _INDEX).read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            return f"a readable {_INDEX} (it is not JSON with a weight_map)"
        absent = [name for name in shards if not (directory / name).is_file()]
        return f"the weight shards {', '.join(absent)} that {_INDEX} names" if absent else None
    if (directory / "model.safetensors").is_file():
        return None
    pickles = sorted(p.name for pattern in _PICKLES for p in directory.glob(pattern))
    if pickles:
        return (f"safetensors weights: it has only PyTorch pickles ({', '.join(pickles)}), which the orchestrator never "
                f"loads (unpickling runs code); save the model as safetensors where you trust the file "
                f"(AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR)) and copy the tokenizer files next to it")
    return f"its weights (model.safetensors, or {_INDEX} and the shards it names)"


def _lacks_tokenizer(directory: Path) -> str | None:
    if (directory / "tokenizer.json").is_file():
        return None
    if (directory / "tokenizer_config.json").is_file() and any((directory / name).is_file() for name in _VOCABULARIES):
        return None
    return f"a tokenizer (tokenizer.json, or tokenizer_config.json with its vocabulary: {', '.join(_VOCABULARIES)})"


def identity(directory: Path) -> dict:
    """What ranks compare at join to know they start from the same files: the directory, the
    sha256 of its config.json and the name and size of each weight file. Sizes, not hashes:
    hashing gigabytes of weights at every join would take minutes."""
    config = directory / "config.json"
    return {
        "directory": str(directory),
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None,
        "weights": {p.name: p.stat().st_size for p in sorted(directory.glob("*.safetensors*")) if p.is_file()},
    }
