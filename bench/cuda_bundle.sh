#!/usr/bin/env bash
# Packs what a device machine (the workplace's H200: python3 3.12 with the CUDA build of torch,
# no network) lacks to run `bench/cuda_round.sh`, in two folders under the 64 MiB a call
# carries: .gpu1/ (the wheels the image does not hold, at the venv's versions, and the default
# model's first part) and .gpu2/ (its second part). Both are git-ignored.
#   make cuda-bundle                      (here, once)
#   device run 1: carry [".gpu1"], command: bash bench/cuda_round.sh setup
#   device run 2 (within the warm window): carry [".gpu2"], command: BUDGET_S=540 bash bench/cuda_round.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=.venv/bin/pip
WHEELS="pyzmq falcon gunicorn msgspec gguf honcho llguidance openai anthropic jsonschema referencing rpds-py
jsonschema-specifications pydantic pydantic-core annotated-types typing-inspection jiter sniffio docstring-parser
httpx2 httpcore2 truststore opentelemetry-api typing-extensions anyio h11"
rm -rf .gpu1 .gpu2 && mkdir -p .gpu1/whl .gpu2
pins=$($PIP freeze 2>/dev/null | tr 'A-Z_' 'a-z-' | grep -E "^($(echo $WHEELS | tr ' ' '|'))==")
plats=""
for n in 1 2014 _2_17 _2_24 _2_26 _2_27 _2_28 _2_31 _2_34; do plats="$plats --platform manylinux${n}_x86_64"; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $plats -d .gpu1/whl $pins 2>&1 | grep -v "^WARNING: Location" || true
model=$(.venv/bin/python -c "from tests.conftest import default_model_path; print(default_model_path())")
head -c $((42 << 20)) "$model" > .gpu1/part1
tail -c +$(((42 << 20) + 1)) "$model" > .gpu2/part2
basename "$model" > .gpu2/name
du -sh .gpu1 .gpu2
