# Two commands do everything on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU build of torch (installed from local disk here; CUDA users: see README)
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: serve test stress bench bench-avx2 cuda-check cuda-bundle model install agents clean

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

# on a CUDA machine (the CUDA build of torch installed first: README, GPU): the CUDA tests, then
# graphs against eager ops in process and over HTTP (bench/RESULTS-cuda.md)
cuda-check: model
	$(BIN)/python -m pytest -q -rs tests/procs/inference/test_cuda.py tests/procs/inference/test_sampling.py \
		tests/procs/inference/test_runs.py tests/e2e/test_batch.py tests/e2e/test_sessions.py
	$(BIN)/python bench/bench_graphs.py
	$(BIN)/python bench/bench_parallel.py
	$(BIN)/python bench/bench_parallel.py --tool-ms 300
	RICORDO_CUDA_GRAPHS=0 $(BIN)/python bench/bench_parallel.py

# what the workplace's device machine lacks for bench/cuda_round.sh (wheels, the model in two
# parts), in the git-ignored .gpu1/ and .gpu2/; bench/cuda_bundle.sh says how to run it there
cuda-bundle: model
	bash bench/cuda_bundle.sh

# Codex CLI, Claude Code and opencode in agents/node_modules (npm, not global); tests/e2e/test_real_agents.py runs them
agents:
	cd agents && npm install --no-audit --no-fund --loglevel=error

# the model bench and the agent-conversation bench against llama.cpp on the same GGUF in the
# same run (BENCH_MODEL=gemma3-270m for the other)
BENCH_MODEL ?= smollm2-135m
bench: model
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python bench/bench_model.py --model $(BENCH_MODEL)
	$(BIN)/python bench/bench_agent.py --model $(BENCH_MODEL)

# the same on this machine emulating an AVX2-only one: ricordo's kernels built for haswell, torch
# held to AVX2, f32 compute, and llama.cpp built without AVX-512 (~5 minutes, once, into
# .bench-avx2/); on an AVX2-only machine `make bench` measures the real thing
AVX2_ENV := RICORDO_KERNEL_MARCH=haswell ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 RICORDO_DTYPE=f32 PYTHONPATH=$(CURDIR)/.bench-avx2
AVX2_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
	-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
# the pin is pyproject's bench extra; its requirements (the server's) go into the venv
PEER := $(shell sed -n 's/^bench = \["llama-cpp-python\[server\]\(==[0-9.]*\)"\]/llama-cpp-python\1/p' pyproject.toml)
PEER_REQS := import sys, importlib.metadata as m; sys.path.insert(0, ".bench-avx2"); \
	from packaging.requirements import Requirement as R; \
	print(" ".join(r.name + str(r.specifier) for r in map(R, m.requires("llama-cpp-python")) \
	                if not r.marker or r.marker.evaluate({"extra": "server"})))
.bench-avx2/llama_cpp: $(STAMP)
	CMAKE_ARGS="$(AVX2_CMAKE)" $(BIN)/pip install -q --no-deps --no-binary llama-cpp-python --no-cache-dir \
		--target .bench-avx2 "$(PEER)"
	$(BIN)/python -c '$(PEER_REQS)' | xargs $(BIN)/pip install -q

bench-avx2: model .bench-avx2/llama_cpp
	$(AVX2_ENV) $(BIN)/python bench/bench_model.py --model $(BENCH_MODEL) --dtype f32
	$(AVX2_ENV) $(BIN)/python bench/bench_agent.py --model $(BENCH_MODEL)

clean:
	rm -rf $(VENV) build *.egg-info .bench-avx2
