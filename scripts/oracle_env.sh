#!/usr/bin/env bash
# The second oracle environment (issue 41): megatron-core 0.19.2 + Megatron-Bridge 0.6.2 on Python 3.12 (0.19 needs
# >= 3.12; the project's own .venv is 3.11 with megatron-core 0.16.1), built on demand from PyPI into an ignored
# folder, for tests/test_megatron_write_newest.py (tests/megatron_oracle_newest.py runs in it).
#
#   scripts/oracle_env.sh [DIR]     build DIR (default .venv-oracle312) unless it is complete; prints its python
#
# torch: PyPI's torch 2.13.0 wheel for cp312 is the CUDA build (with its nvidia-* libraries; ~4.5 GB installed; it
# runs on the CPU as it is); no CPU-only cp312 wheel is reachable here. Megatron-Bridge goes in with --no-deps (its
# declared dependencies include GPU-only builds such as fast-hadamard-transform and flashinfer); the packages its
# import paths for export_ckpt / load_megatron_model need are in scripts/oracle312-constraints.txt with every pin.
# Measured on a 2-core machine (shared) with an empty pip cache: 4 min 19 s, 5.4 GB; a second call: instant. A concurrent second call waits for the
# first (flock). Exit 0 and the python's path on stdout, or non-zero and one line on stderr saying why.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$here/.venv-oracle312}"
pins="$here/scripts/oracle312-constraints.txt"
stamp="$dir/.oracle-complete"
want="megatron-core==0.19.2 megatron-bridge==0.6.2 $(sha256sum "$pins" | cut -c1-16)"

find_py312() {
    for c in "${PYTHON312:-}" python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 \
             /usr/bin/python3.12 /usr/local/bin/python3.12; do
        [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' \
            2>/dev/null && { command -v "$c"; return 0; }
    done
    return 1
}

mkdir -p "$(dirname "$dir")"
exec 9>"$dir.lock"
flock 9
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$dir/bin/python" ]; then
    echo "$dir/bin/python"
    exit 0
fi
py="$(find_py312)" || { echo "oracle_env: no Python 3.12 found (pyenv install 3.12, or set PYTHON312)" >&2; exit 3; }
rm -rf "$dir"
log="$dir.log"
{
    "$py" -m venv "$dir"
    "$dir/bin/python" -m pip install -q --upgrade pip
    "$dir/bin/python" -m pip install -q -c "$pins" torch
    "$dir/bin/python" -m pip install -q --no-deps megatron-core==0.19.2 megatron-bridge==0.6.2
    "$dir/bin/python" -m pip install -q -c "$pins" transformers numpy packaging omegaconf hydra-core pyyaml einops \
        rich tqdm regex six psutil safetensors datasets pillow tensorboard nvidia-modelopt requests
} >"$log" 2>&1 || { echo "oracle_env: building $dir failed; see $log (last line: $(tail -n 1 "$log"))" >&2; exit 4; }
echo "$want" >"$stamp"
echo "$dir/bin/python"
