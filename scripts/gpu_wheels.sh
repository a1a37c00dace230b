#!/usr/bin/env bash
# Wheels the GPU machine cannot download (it has no network): run here, on the CPU host, before the device call, and
# name the folder in the call's `carry`; scripts/gpu_check.sh installs them (--no-index, --no-deps) when present.
#   megatron-core, the version constraints.txt pins, as the cp312 manylinux wheel (the GPU machine runs Python 3.12;
#   its dependencies numpy, packaging and torch are there already): part (d) of scripts/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-.gpu-wheels}"
PY="${PYTHON:-.venv/bin/python}"
mkdir -p "$DEST"
ver=$(sed -n 's/^megatron[-_]core==\([^ ;]*\).*/\1/p' constraints.txt | head -n 1)
[ -n "$ver" ] || { echo "gpu_wheels: no megatron-core pin in constraints.txt" >&2; exit 1; }
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$DEST" "megatron-core==$ver"
ls -l "$DEST"
