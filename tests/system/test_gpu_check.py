"""scripts/gpu-check.sh, the one command for a GPU machine, run where there is none: with
``--allow-cpu --quick`` every part runs on the CPU and the JSON holds each part's figures;
without ``--allow-cpu`` it says in one line that there is no CUDA and exits 2; a part that
fails is reported and the others still run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_check
from orchestrator.demo import model as demo_model

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu-check.sh"
PARTS = ["machine", "demo", "engine", "engine-cpu", "train", "offload", "publish"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _script(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "COLUMNS": "160"}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_allow_cpu_quick_runs_every_part_and_writes_each_part_s_figures(tmp_path):
    out = tmp_path / "x.json"
    done = _script("--allow-cpu", "--quick", "--out", str(out), timeout=290)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["device"] == DEVICE and result["passed"] is True
    assert list(result["parts"]) == PARTS
    failed = {name: p["error"] for name, p in result["parts"].items() if not p["ok"]}
    assert not failed
    parts = {name: p["result"] for name, p in result["parts"].items()}

    assert parts["machine"]["torch"] == torch.__version__
    assert parts["machine"]["cuda_available"] is torch.cuda.is_available()
    for part, device in (("engine", DEVICE), ("engine-cpu", "cpu")):
        for setting, max_tokens in (("arith", 4), ("chat", 8)):
            r = parts[part][setting]
            assert (r["device"], r["prompts"], r["n"], r["max_tokens"]) == (device, 12, 2, max_tokens)
            assert r["one_tokens_per_s"] > 0 and r["many_tokens_per_s"] > 0 and r["ratio"] > 0
            assert r["many_requests"] > 1  # the many-requests mode really sent several
    assert all(parts["engine-cpu"][s]["engine_over_cpu"] > 0 for s in ("arith", "chat"))
    for strategy in ("ddp", "ddp, padded", "fsdp", "ddp, LoRA r16"):
        r = parts["train"][strategy]
        assert (r["mixed_precision"], r["records"], r["samples"], r["packing"]) == ("bf16", 4, 8, strategy != "ddp, padded")
        assert r["step_s"] > 0 and r["first_step_s"] > 0 and r["state_bytes"] > 0
        assert (r["peak_gpu_allocated_bytes"] is not None) is torch.cuda.is_available()
    assert parts["train"]["ddp, LoRA r16"]["checkpoint_bytes"] < parts["train"]["ddp"]["checkpoint_bytes"] / 2
    assert parts["train"]["ddp"]["padding_share"] < parts["train"]["ddp, padded"]["padding_share"]
    offload = parts["offload"]
    assert offload["offload_s"] >= 0 and offload["reload_s"] > 0
    assert offload["moved"] is torch.cuda.is_available()
    assert offload["engine_beside_trainer"]["tokens_per_s"] > 0
    publish = parts["publish"]
    assert publish["summary"]["engine_read_bytes"] < 1 and publish["replay"]["exact"] is True, publish

    for title in ("machine", "demo data", "embedded engine on", "embedded engine on cpu (the comparison)", "one bf16 optimizer step",
                  "kept-alive trainer (ddp, bf16): offload and reload", "gpu-check: every part passed (7)"):
        assert title in done.stdout, title
    assert "FAILED" not in done.stdout + done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.timeout(60)
def test_without_cuda_and_without_allow_cpu_it_says_so_in_one_line_and_exits_2(tmp_path):
    done = _script("--out", str(tmp_path / "x.json"), timeout=50)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA" in lines[0] and "--allow-cpu" in lines[0], done.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.timeout(120)
def test_the_engine_asked_for_cuda_without_one_exits_2_with_one_error_line_and_no_traceback(tmp_path):
    demo_model.save(demo_model.create(0), tmp_path / "model")
    done = subprocess.run([sys.executable, "-m", "orchestrator.engine.server", "--model", str(tmp_path / "model"), "--port", "0",
                           "--device", "cuda"], cwd=REPO, capture_output=True, text=True, timeout=100)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "--device cuda" in errors[0] and "--device cpu" in errors[0], done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.timeout(60)
def test_a_failing_part_is_reported_the_next_still_runs_and_the_exit_status_is_1(tmp_path, monkeypatch, capsys):
    def broken(check):
        raise gpu_check.BenchError("the GPU caught fire")

    ran = []
    monkeypatch.setitem(gpu_check.PARTS, "machine", (broken, "a part that fails"))
    monkeypatch.setitem(gpu_check.PARTS, "demo", (lambda check: ran.append("demo") or {"made": True}, "a part that passes"))
    out = tmp_path / "x.json"

    assert gpu_check.main(["--allow-cpu", "--parts", "machine,demo", "--out", str(out)]) == 1

    assert ran == ["demo"]
    result = json.loads(out.read_text())
    assert result["passed"] is False
    assert result["parts"]["machine"]["ok"] is False and "the GPU caught fire" in result["parts"]["machine"]["error"]
    assert result["parts"]["demo"] == {"part": "demo", "ok": True, "seconds": result["parts"]["demo"]["seconds"], "error": None,
                                       "result": {"made": True}}
    captured = capsys.readouterr()
    assert "part machine FAILED: BenchError: the GPU caught fire" in captured.err
    assert "FAILED" in captured.out  # the summary
