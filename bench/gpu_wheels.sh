#!/usr/bin/env bash
# Wheels for running bench/gpu_check.py on a machine without a package registry (the lent GPU machine has torch,
# typer and rich, and nothing else of ours): msgspec, zstandard, safetensors and tokenizers for CPython
# 3.10-3.13 on x86-64 Linux, into bench/wheels/ (ignored by git; carry it with the run: about 25 MB, under the
# 64 MiB a carried folder may take; numpy comes with torch there). There:
#   pip install --no-index --find-links bench/wheels msgspec zstandard safetensors tokenizers
#   PYTHONPATH=. python -m bench.gpu_check
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p wheels
for py in 3.10 3.11 3.12 3.13; do
  pip download --quiet --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --python-version "$py" --implementation cp --no-deps -d wheels \
    "msgspec>=0.18" "zstandard>=0.22" "safetensors>=0.4" "tokenizers>=0.19"
done
du -sh wheels
