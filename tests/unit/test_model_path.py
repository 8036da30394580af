"""model.path: where the base model comes from (empty: <data-path>/model; a directory,
relative under --data-path; a hub id in the local Hugging Face cache, never downloaded),
what the preflight requires of it, and its identity in the fingerprint ranks compare at join."""

import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest

from orchestrator import config, preflight
from orchestrator.node import base_model
from orchestrator.errors import ConfigError
from orchestrator.phase_table import RLPhase

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _run(data: Path, path: str = "", **fields) -> config.RunConfig:
    return config.RunConfig(data_path=data, log_path=data.parent / "run", rl_phase=RLPhase.BOTH, eval_interval=1, rank=0,
                            model=config.ModelConfig(path=path), **fields)


def _model(directory: Path, *, weights=("model.safetensors",), tokenizer=("tokenizer.json",), config_json=True) -> Path:
    """A model directory holding just the files the preflight looks for."""
    directory.mkdir(parents=True)
    if config_json:
        (directory / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    for name in (*weights, *tokenizer):
        (directory / name).write_bytes(b"x" * 8)
    return directory


def _hub_cache(root: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """A Hugging Face hub cache as `hf download` leaves it: the files as blobs, the snapshot
    of the main revision as links to them, refs/main naming the commit. Returns the snapshot."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for i, (name, content) in enumerate(files.items()):
        (repo / "blobs" / f"blob{i}").write_bytes(content)
        (snapshot / name).symlink_to(Path("../..") / "blobs" / f"blob{i}")
    return snapshot


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """HF_HUB_CACHE pointed at an empty directory. huggingface_hub reads the variable when it
    is imported, so the value it already took in this process is replaced too."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


FULL = {"config.json": b'{"max_position_embeddings": 64}', "model.safetensors": b"w" * 16, "tokenizer.json": b"{}"}


# --- where it resolves ------------------------------------------------------------------------


def test_unset_is_the_model_directory_under_the_data_path(tmp_path):
    assert _run(tmp_path / "data").model_path == tmp_path / "data" / "model"


def test_a_relative_path_is_under_the_data_path_and_an_absolute_one_stays(tmp_path):
    data = tmp_path / "data"
    _model(data / "models" / "mine")
    assert _run(data, "models/mine").model_path == data / "models" / "mine"
    assert _run(data, str(tmp_path / "elsewhere")).model_path == tmp_path / "elsewhere"
    assert _run(data, "no/such/dir").model_path == data / "no/such/dir"  # not shaped like a hub id: the preflight names it


def test_the_override_key_sets_it(tmp_path):
    sections = config.build_sections(config.parse_overrides([f"model.path={tmp_path}/m"]))
    assert sections["model"] == config.ModelConfig(path=f"{tmp_path}/m")
    assert "model.path" in config.valid_override_keys()


def test_a_hub_id_is_the_snapshot_of_main_in_the_local_cache(tmp_path, hf_cache):
    snapshot = _hub_cache(hf_cache, "org/tiny-model", FULL)
    run = _run(tmp_path / "data", "org/tiny-model")
    assert run.model_path == snapshot
    base_model.check(run.model_path, "org/tiny-model")  # links into blobs count as the files


def test_a_directory_of_the_hub_ids_name_under_the_data_path_wins_over_the_cache(tmp_path, hf_cache):
    _hub_cache(hf_cache, "org/tiny-model", FULL)
    local = _model(tmp_path / "data" / "org" / "tiny-model")
    assert _run(tmp_path / "data", "org/tiny-model").model_path == local


def test_a_hub_id_not_in_the_cache_says_how_to_get_it_and_downloads_nothing(tmp_path, hf_cache):
    run = _run(tmp_path / "data", "org/absent-model")  # built: resolving is the preflight's
    with pytest.raises(ConfigError) as e:
        run.model_path
    message = str(e.value)
    assert f"model.path='org/absent-model': no directory {tmp_path / 'data' / 'org/absent-model'}" in message
    assert f"org/absent-model is not in the local Hugging Face cache {hf_cache}" in message
    assert "hf download org/absent-model" in message
    assert list(hf_cache.iterdir()) == []


def test_the_cache_is_where_HF_HUB_CACHE_or_HF_HOME_says_in_a_fresh_process(tmp_path):
    snapshot = _hub_cache(tmp_path / "home" / "hub", "org/tiny-model", FULL)
    code = "import sys; from pathlib import Path; from orchestrator.node import base_model; " \
           "print(base_model.resolve('org/tiny-model', Path('/nonexistent')))"
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    result = subprocess.run([sys.executable, "-c", code], env={**env, "HF_HOME": str(tmp_path / "home")},
                            capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == str(snapshot), result.stderr


# --- what the preflight requires ----------------------------------------------------------------


@pytest.mark.parametrize("make, words", [
    (lambda d: _model(d, config_json=False), ["which lacks config.json"]),
    (lambda d: _model(d, weights=()), ["its weights (model.safetensors, or model.safetensors.index.json and the shards it names)"]),
    (lambda d: _model(d, weights=("pytorch_model.bin",)),
     ["only PyTorch pickles (pytorch_model.bin), which the orchestrator never loads", "save_pretrained(NEW_DIR)"]),
    (lambda d: _model(d, tokenizer=()), ["a tokenizer (tokenizer.json, or tokenizer_config.json with its vocabulary"]),
    (lambda d: _model(d, tokenizer=("tokenizer_config.json",)), ["a tokenizer (tokenizer.json"]),
    (lambda d: _model(d, config_json=False, weights=(), tokenizer=()), ["lacks config.json; its weights", "; a tokenizer"]),
    (lambda d: d, ["which is not a directory"]),
])
def test_a_model_directory_that_lacks_a_piece_is_refused_naming_it_and_the_fix(tmp_path, make, words):
    directory = tmp_path / "m"
    make(directory)
    with pytest.raises(ConfigError) as e:
        base_model.check(directory, str(directory))
    message = str(e.value)
    assert message.startswith(f"model.path={str(directory)!r} names {directory}, which "), message
    assert all(w in message for w in words), message
    assert "Set model.path to a Hugging Face model directory" in message and "hf download ORG/NAME" in message


def test_sharded_safetensors_need_every_shard_their_index_names(tmp_path):
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    directory = _model(tmp_path / "m", weights=("model-00001-of-00002.safetensors",))
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"lacks the weight shards model-00002-of-00002.safetensors that model.safetensors.index.json"):
        base_model.check(directory, "m")
    (directory / "model-00002-of-00002.safetensors").write_bytes(b"x")
    base_model.check(directory, "m")


def test_a_sentencepiece_tokenizer_without_tokenizer_json_is_enough(tmp_path):
    base_model.check(_model(tmp_path / "m", tokenizer=("tokenizer_config.json", "tokenizer.model")), "m")


def _tasks(data: Path) -> None:
    (data / "tasks").mkdir(parents=True)
    for name in ("train.jsonl", "test.jsonl"):
        (data / "tasks" / name).write_text(json.dumps({"id": "t1", "prompt": "1+1=", "answer": "2"}) + "\n")


def test_the_preflight_accepts_a_model_outside_the_data_path(tmp_path):
    from orchestrator.demo import tokenizer as demo_tokenizer

    model = _model(tmp_path / "models" / "mine", tokenizer=())
    demo_tokenizer.save(model)
    _tasks(tmp_path / "data")
    preflight.check(_run(tmp_path / "data", str(model)))


def test_the_preflight_names_a_missing_model_directory_and_writes_nothing(tmp_path):
    _tasks(tmp_path / "data")
    with pytest.raises(ConfigError, match=r"model.path='models/v2/mine' names .*data/models/v2/mine, which is not a directory. Set"):
        preflight.check(_run(tmp_path / "data", "models/v2/mine"))
    assert not (tmp_path / "run").exists()


def test_the_preflight_keeps_the_demo_hint_when_a_demo_folder_lacks_its_model(tmp_path):
    _tasks(tmp_path / "data")
    (tmp_path / "data" / "demo.json").write_text("{}")  # what demo-data writes: a demo's folder
    with pytest.raises(ConfigError, match=r"lacks .*data/model/config.json: make the demo data with `orchestrator demo-data"):
        preflight.check(_run(tmp_path / "data"))


def test_the_users_own_tasks_without_a_model_are_told_model_path_not_the_demo(tmp_path):
    _tasks(tmp_path / "data")
    with pytest.raises(ConfigError, match=r"model/config.json \(from model.path \(unset: <data-path>/model\)\)") as caught:
        preflight.check(_run(tmp_path / "data"))
    assert "demo-data" not in str(caught.value)


def test_the_preflight_names_what_the_default_model_directory_lacks_past_its_config(tmp_path):
    _model(tmp_path / "data" / "model", weights=())
    _tasks(tmp_path / "data")
    with pytest.raises(ConfigError, match=r"the base model .*data/model \(model.path unset\), which lacks its weights"):
        preflight.check(_run(tmp_path / "data"))


# --- the fingerprint ------------------------------------------------------------------------------


def test_the_fingerprint_names_the_resolved_directory_and_its_files(tmp_path, hf_cache):
    snapshot = _hub_cache(hf_cache, "org/tiny-model", FULL)
    fp = _run(tmp_path / "data", "org/tiny-model").fingerprint()["model"]
    assert fp["directory"] == str(snapshot)
    assert fp["weights"] == {"model.safetensors": 16}
    import hashlib

    assert fp["config_sha256"] == hashlib.sha256(FULL["config.json"]).hexdigest()


def test_ranks_whose_model_differs_have_different_fingerprints(tmp_path):
    a, b = _model(tmp_path / "a"), _model(tmp_path / "b")
    run_a, run_b = _run(tmp_path / "data", str(a)), _run(tmp_path / "data", str(a))
    assert run_a.fingerprint() == run_b.fingerprint()
    (a / "model.safetensors").write_bytes(b"x" * 9)  # the same names, another size
    assert run_a.fingerprint()["model"] != _run(tmp_path / "data", str(b)).fingerprint()["model"]
    (b / "config.json").write_text("{}")
    assert base_model.identity(b)["config_sha256"] != base_model.identity(a)["config_sha256"]


def test_a_rehearsal_has_no_model_in_its_fingerprint(tmp_path):
    assert _run(tmp_path / "data", "org/absent", workload=config.WorkloadKind.REHEARSAL).fingerprint()["model"] is None


def test_a_rank_whose_model_differs_is_named_at_join(tmp_path):
    from orchestrator.protocol.join import config_mismatch

    a, b = _model(tmp_path / "a"), _model(tmp_path / "b")
    master = _run(tmp_path / "data", str(a)).fingerprint()
    assert config_mismatch(master, {1: {"fingerprint": _run(tmp_path / "data", str(a)).fingerprint()}}) is None
    rank, detail = config_mismatch(master, {1: {"fingerprint": _run(tmp_path / "data", str(b)).fingerprint()}})
    assert rank == 1 and detail.startswith("model: master {'directory': " + repr(str(a))) and repr(str(b)) in detail


def _tokenizer(directory: Path, words: list[str]) -> Path:
    """A model directory with a real (word-level) tokenizer of ``words``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    _model(directory, tokenizer=())
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", *words])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(directory)
    return directory


def test_a_model_beside_the_policy_is_checked_as_the_base_is_and_a_teacher_shares_its_tokenizer(tmp_path, hf_cache):
    """models.<name>.path is resolved and checked as model.path is, named by its own key; a
    teacher (rl.teacher) with another vocabulary than the policy's is refused."""
    data = tmp_path / "data"
    _tokenizer(data / "model", ["a", "b"])
    distill = {"rl": config.RLConfig(teacher="teacher", distill_coef=1.0)}
    run = _run(data, models={"teacher": config.AuxModelConfig(path="teacher")}, **distill)
    with pytest.raises(ConfigError, match="models.teacher.path='teacher': no directory .*/data/teacher, .* or set models.teacher.path"):
        preflight.check_models(run)
    _tokenizer(data / "teacher", ["a", "c"])
    with pytest.raises(ConfigError, match="rl.teacher=teacher: the model .*/data/teacher has another tokenizer than the policy's"):
        preflight.check_models(run)
    _tokenizer(tmp_path / "same", ["a", "b"])
    preflight.check_models(_run(data, models={"teacher": config.AuxModelConfig(path=str(tmp_path / "same"))}, **distill))
