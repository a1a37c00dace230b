# Two entry points, each self-installing on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.shardkit-installed

.PHONY: demo test install bench bench-train clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU-only hosts: take the pinned CPU build of torch first, so nothing pulls a multi-GB CUDA build
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/shardkit demo

test: $(STAMP)
	$(PY) -m pytest tests

bench: $(STAMP)
	$(PY) scripts/bench_convert.py

bench-train: $(STAMP)
	$(PY) scripts/bench_train.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
