# Two commands do everything on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU build of torch (installed from local disk here; CUDA users: see README)
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: serve test stress bench model install agents clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(BIN)/ricordo fetch-model
	$(BIN)/ricordo fetch-model gemma3-270m
	$(BIN)/ricordo fetch-model qwen2.5-coder-0.5b

serve: model
	PATH="$(CURDIR)/$(BIN):$$PATH" RICORDO_KV_DISK_DIR="$${RICORDO_KV_DISK_DIR:-$$HOME/.cache/ricordo/kv}" $(BIN)/honcho start

test: model
	@$(BIN)/python -c "from procs.inference.runtime import describe; print(describe())"
	$(BIN)/python -m pytest -x -q -rsx --durations=30 tests

# the whole stress campaign (`make test` runs its fast subset); numbers in bench/RESULTS-stress.md
stress: model
	RICORDO_STRESS=full $(BIN)/python -m pytest -q -rxs tests/stress

# Codex CLI and Claude Code in agents/node_modules (npm, not global); tests/e2e/test_real_agents.py runs them
agents:
	cd agents && npm install --no-audit --no-fund --loglevel=error

# the model bench and the agent-conversation bench against llama.cpp on the same GGUF in the
# same run (BENCH_MODEL=gemma3-270m for the other)
BENCH_MODEL ?= smollm2-135m
bench: model
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python bench/bench_model.py --model $(BENCH_MODEL)
	$(BIN)/python bench/bench_agent.py --model $(BENCH_MODEL)

clean:
	rm -rf $(VENV) build *.egg-info
