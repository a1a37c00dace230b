#!/usr/bin/env bash
# Installs what tests/test_slurm.py runs against: Debian's SLURM (slurm-wlm: slurmctld, slurmd, sbatch, srun, ...) and
# munge, without recommended packages (9 packages, ~7 s from a warm mirror). Called by .ci/run before `make test` and by
# `make slurm`. Does nothing where they are installed; where there is no apt-get (or no root), it says so and exits 0:
# the SLURM tests then skip with that reason and the rest of `make test` runs as before.
set -euo pipefail
have() { command -v "$1" >/dev/null 2>&1 || [[ -x /usr/sbin/$1 ]]; }
if have slurmctld && have slurmd && have sbatch && have munged && have mungekey; then
    echo "install_slurm: slurm-wlm and munge are installed"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_slurm: no apt-get here: not installing slurm-wlm and munge (tests/test_slurm.py will skip)"
    exit 0
fi
sudo=()
if [[ $(id -u) != 0 ]]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        sudo=(sudo -n)
    else
        echo "install_slurm: not root and no passwordless sudo: not installing slurm-wlm and munge (tests/test_slurm.py will skip)"
        exit 0
    fi
fi
export DEBIAN_FRONTEND=noninteractive
install() { "${sudo[@]}" apt-get install -y -q --no-install-recommends slurm-wlm munge; }
start=$SECONDS
# the package lists may be missing or stale on a fresh machine: update once and retry
if ! { install || { "${sudo[@]}" apt-get update -q && install; }; }; then
    echo "install_slurm: apt-get could not install slurm-wlm and munge (tests/test_slurm.py will skip)" >&2
    exit 0
fi
echo "install_slurm: installed slurm-wlm and munge in $((SECONDS - start)) s"
