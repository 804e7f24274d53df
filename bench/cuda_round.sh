#!/usr/bin/env bash
# One round of CUDA checks on a device machine (bench/cuda_bundle.sh says how it gets there).
#   bash bench/cuda_round.sh setup    a venv over the image's torch, the carried wheels, this
#                                     repo on its path, the model's first part kept in /tmp/m
#   BUDGET_S=540 bash bench/cuda_round.sh
#                                     the model joined, then the CUDA tests, bench_graphs and
#                                     bench_parallel (back to back, then apart), each step given
#                                     what is left of BUDGET_S; logs under $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "${1:-}" = setup ]; then
    mkdir -p /tmp/m && cp .gpu1/part1 /tmp/m/part1
    python3 -m venv --system-site-packages .venv
    .venv/bin/pip install -q --no-index --no-deps --no-compile .gpu1/whl/*.whl
    # this repo on the venv's path and its console script, as `pip install -e .` would make
    # them (that needs setuptools' wheel builder, which a bare venv may lack offline)
    echo "$PWD" > "$(.venv/bin/python -c 'import site; print(site.getsitepackages()[0])')/ricordo-repo.pth"
    printf '#!%s\nimport sys\nfrom procs.cli import main\nsys.exit(main())\n' "$PWD/.venv/bin/python" > .venv/bin/ricordo
    chmod +x .venv/bin/ricordo
    .venv/bin/python -c "import torch, zmq, msgspec, falcon, llguidance, openai; print(torch.__version__, torch.cuda.get_device_name())"
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
step graphs 120 .venv/bin/python bench/bench_graphs.py
step parallel 150 .venv/bin/python bench/bench_parallel.py
step parallel-apart 150 .venv/bin/python bench/bench_parallel.py --tool-ms 300
