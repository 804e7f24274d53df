#!/usr/bin/env bash
# One round of CUDA checks on a device machine (bench/cuda_bundle.sh says how it gets there).
#   bash bench/cuda_round.sh setup    .venv/bin wrappers around the image's python3 (its torch),
#                                     the carried wheels and this repo on their path, the
#                                     model's first part kept in /tmp/m
#   BUDGET_S=540 bash bench/cuda_round.sh
#                                     the model joined, then the CUDA tests, bench_parallel (back
#                                     to back, then apart) and bench_graphs, each step given
#                                     what is left of BUDGET_S; logs under $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "${1:-}" = setup ]; then
    mkdir -p /tmp/m && cp .gpu1/part1 /tmp/m/part1
    # the image's python3 is itself a venv (its torch is in that venv's site-packages): a venv
    # made from it would not see torch. So .venv/bin holds wrappers around that interpreter,
    # with the carried wheels (installed into /tmp/site) and this repo on the path, where the
    # Makefile and the tests look for python, honcho, gunicorn and ricordo.
    PY=$(python3 -c 'import sys; print(sys.executable)')
    rm -rf /tmp/site .venv && mkdir -p /tmp/site .venv/bin
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu1/whl/*.whl
    path="/tmp/site:$PWD"
    printf '#!/bin/sh\nPYTHONPATH=%s${PYTHONPATH:+:$PYTHONPATH} exec %s "$@"\n' "$path" "$PY" > .venv/bin/python
    cp .venv/bin/python .venv/bin/python3
    for tool in "honcho honcho.command main" "gunicorn gunicorn.app.wsgiapp run" "ricordo procs.cli main"; do
        set -- $tool
        printf '#!%s\nimport sys\nsys.path[:0] = "%s".split(":")\nfrom %s import %s\nsys.exit(%s())\n' \
            "$PY" "$path" "$2" "$3" "$3" > ".venv/bin/$1"
    done
    chmod +x .venv/bin/*
    .venv/bin/python -c "import torch, zmq, msgspec, falcon, llguidance, openai, procs; print(torch.__version__, torch.cuda.get_device_name())"
    exit
fi
models=$(.venv/bin/python -c "from common.config import Settings; print(Settings().models_path())")
mkdir -p "$models" && cat /tmp/m/part1 .gpu2/part2 > "$models/$(cat .gpu2/name)"
end=$(( $(date +%s) + ${BUDGET_S:-540} ))
step() {    # step NAME MAX_S COMMAND...: at most MAX_S, and never past the budget
    local name=$1 max=$2; shift 2
    local left=$(( end - $(date +%s) ))
    [ "$left" -lt 20 ] && { echo "== $name: skipped (budget spent)"; return; }
    [ "$left" -lt "$max" ] && max=$left
    echo "== $name (at most $max s)"
    timeout "$max" "$@" 2>&1 | tee "$OUT/$name.log" | tail -40
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
step tests 200 .venv/bin/python -m pytest -q -rs tests/procs/inference/test_cuda.py \
    tests/procs/inference/test_sampling.py tests/procs/inference/test_runs.py \
    tests/e2e/test_batch.py tests/e2e/test_sessions.py
step parallel 150 .venv/bin/python bench/bench_parallel.py
step parallel-apart 150 .venv/bin/python bench/bench_parallel.py --tool-ms 300
step graphs 120 .venv/bin/python bench/bench_graphs.py
