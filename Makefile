# Two entry points, each self-installing on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.shardkit-installed
# The versions the suite is known green with (`make lock` writes it). torch is not in it: a `torch==X` constraint also
# matches X+cpu, which could put a CPU-only build on a GPU host; CPU hosts get the pinned build from TORCH instead.
LOCK := constraints.txt
TORCH := torch==2.13.0
TRITON := triton==3.9.0  # not in $(LOCK) either: torch's CUDA builds pin their own

.PHONY: demo test test-all install slurm lock bench bench-train clean

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU-only hosts: take the pinned CPU build of torch first, so nothing pulls a multi-GB CUDA build
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q -c $(LOCK) $(TORCH); fi
	$(PY) -m pip install -q -c $(LOCK) -e '.[test]'
	# torchtitan (tests/test_torchtitan.py's oracle) without its training stack's deps (datasets, wandb, tensorboard,
	# torchdata: not used by its model classes and checkpointer; torchdata could replace torch). torchtitan 0.3 imports
	# triton (GPU kernels): CUDA builds of torch bring their own, CPU hosts get it here (286 MB wheel, ~1 GB on disk)
	$(PY) -m pip install -q --no-deps -c $(LOCK) torchtitan spmd_types torch_checkpointing
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q --no-deps $(TRITON); fi
	touch $(STAMP)

install: $(STAMP)

# slurm-wlm and munge for tests/test_slurm.py (a one-node SLURM the tests start themselves); without them those
# tests skip, saying why. .ci/run calls it before `make test`.
slurm:
	scripts/install_slurm.sh

demo: $(STAMP)
	$(VENV)/bin/shardkit demo

test: $(STAMP)
	$(PY) -m pytest tests

# the slow cases too (pyproject.toml's `slow` marker), about twice the time of `make test`
test-all: $(STAMP)
	$(PY) -m pytest tests -m 'slow or not slow'

bench: $(STAMP)
	$(PY) scripts/bench_convert.py

bench-train: $(STAMP)
	$(PY) scripts/bench_train.py

# Refresh the pins: a throw-away venv gets the newest versions pyproject.toml allows (torch as in $(STAMP)), and
# its `pip freeze --all` (without shardkit, pip and torch) replaces $(LOCK). Then `make test` reinstalls .venv from
# it; commit it when green.
lock:
	set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	python3 -m venv "$$tmp/venv"; py="$$tmp/venv/bin/python"; \
	$$py -m pip install -q --upgrade pip; \
	if ! command -v nvidia-smi >/dev/null 2>&1; then $$py -m pip install -q $(TORCH); fi; \
	$$py -m pip install -q -e '.[test]'; \
	$$py -m pip install -q --no-deps torchtitan spmd_types torch_checkpointing; \
	{ echo "# Versions \`make test\` / \`make install\` install (pip install -c $(LOCK)): written by \`make lock\` on"; \
	  echo "# $$(date -u +%F), $$($$py -c 'import platform; print("Python", platform.python_version(), platform.machine())'),"; \
	  echo "# $$(command -v nvidia-smi >/dev/null 2>&1 && echo 'a GPU host' || echo 'a CPU host'), from the newest versions pyproject.toml allows."; \
	  echo "# torch is left out on purpose (the Makefile pins it); shardkit's own ranges in pyproject.toml stay open."; \
	  $$py -m pip freeze --all --exclude-editable --exclude pip --exclude torch --exclude triton; } > "$$tmp/lock.txt"; \
	mv "$$tmp/lock.txt" $(LOCK)
	@echo "wrote $(LOCK); now: make test (reinstalls $(VENV) from it), and commit $(LOCK) when green"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
