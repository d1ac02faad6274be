#!/usr/bin/env bash
# Wheels for running bench/gpu_check.py on a machine without a package registry (the lent GPU machine has torch,
# typer and rich, and nothing else of ours): msgspec, zstandard, safetensors and tokenizers for CPython
# 3.10-3.13 on x86-64 Linux, and transformers with its dependencies for one Python (GPU_PYTHON, default 3.12), into
# bench/wheels/ (ignored by git; carry it with the run: about 50 MB, under the 64 MiB a carried folder may take;
# numpy comes with torch there). There:
#   pip install --no-index --find-links bench/wheels msgspec zstandard safetensors tokenizers transformers
#   PYTHONPATH=. python -m bench.gpu_check
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p wheels
for py in 3.10 3.11 3.12 3.13; do
  pip download --quiet --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --python-version "$py" --implementation cp --no-deps -d wheels \
    "msgspec>=0.18" "zstandard>=0.22" "safetensors>=0.4" "tokenizers>=0.19"
done
# `replay trainer --device cuda` (gpu_check's trainer row): transformers, as installed here, and what it needs, for the
# lent machine's Python (3.12 when it was measured); numpy comes with torch there, and its wheel alone is 16 MB
py=${GPU_PYTHON:-3.12}
tf=$(cd .. && .venv/bin/python -c "import transformers; print(transformers.__version__)" 2>/dev/null || echo 5.19.0)
pip download --quiet --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --python-version "$py" --implementation cp -d wheels "transformers==$tf"
rm -f wheels/numpy-*.whl
du -sh wheels
