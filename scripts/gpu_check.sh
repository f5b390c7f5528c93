#!/usr/bin/env bash
# Everything #9 asks of a lent CUDA GPU, in one call (device time is scarce: one short,
# prepared script).  The same code as on CPUs, only `--device cuda`: our CPU kernels stay
# out (they are chosen per device), attention is SDPA over the gathered blocks.
#
#   bash scripts/gpu_check.sh            # on the GPU machine, in the repo root
#
# 1. correctness: the parity, engine, sampler and server tests, where `LLM(...)` and the
#    servers default to --device auto = cuda and transformers' reference runs on the CPU;
# 2. the #9 benchmarks with --device cuda (roofline fp32/bf16, throughput vs transformers);
# 3. where a step's time goes (scripts/profile_step.py, self-CPU time per op group) and how
#    many ops (at least one launch each) it dispatches (scripts/count_step_ops.py);
# 4. --compile, last, under its own time limit.
# Results (JSON, logs) go to $OUT (the device tool's folder) or /tmp/gpu_out.
#
# Wheels the GPU image lacks travel in .whl/ (git-ignored: name it in the device call's carry);
# fetch them here first, for the image's Python 3.12:
#   bash scripts/gpu_check.sh --fetch-wheels
# Measured with it: docs/results/2026-12-04T07-h200/ (README, "On a GPU").
set -uo pipefail
if [ "${1:-}" = --fetch-wheels ]; then
  pkgs=$(python3 -m pip list --format=freeze 2>/dev/null | grep -iE \
    '^(fastapi|starlette|pydantic|pydantic_core|annotated-types|typing-inspection|uvicorn|openai|jiter|distro|sniffio|httpx2)==')
  # shellcheck disable=SC2086
  exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $pkgs
fi
O=${OUT:-/tmp/gpu_out}
mkdir -p "$O"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/tl_ext
M=/tmp/m/qwen2.5-0.5b
tl() { python3 -m tokenloom.entrypoints.cli "$@"; }
step() { echo; echo "== $* ($(date +%T))"; }

step machine
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
torch.cuda.get_device_name(), 'cpus', __import__('os').cpu_count())"

step tests on cuda
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -o addopts= \
  tests/test_parity.py tests/test_engine.py tests/test_sampler.py tests/test_trace.py tests/test_server.py 2>&1 \
  | tee "$O/pytest.log" | tail -n 15

step make-model
tl make-model --preset qwen2.5-0.5b --out "$M" >/dev/null

step roofline fp32
tl bench roofline --model "$M" --device cuda --dtype float32 --batch-sizes 1,8,32 --context-lens 128,512 \
  --disable-tqdm --output-json "$O/roofline_fp32.json" 2>&1 | tee "$O/roofline_fp32.log" | tail -n 25

step throughput vs transformers, fp32
tl bench throughput --model "$M" --device cuda --dtype float32 --workload random --num-prompts 32 \
  --input-len 32:256 --output-len 16:128 --baseline hf --disable-tqdm --output-json "$O/throughput_vs_hf.json" 2>&1 \
  | tail -n 25

step roofline bf16
tl bench roofline --model "$M" --device cuda --dtype bfloat16 --batch-sizes 1,8,32 --context-lens 128,512 \
  --disable-tqdm --output-json "$O/roofline_bf16.json" 2>&1 | tail -n 25

step profile, batch 1 and 32, and the ops a decode step dispatches
for b in 1 32; do python3 scripts/profile_step.py --model "$M" --batch-size $b --steps 3 2>&1 | tail -n 14; done
for dt in float32 bfloat16; do python3 scripts/count_step_ops.py --model "$M" --dtype $dt 2>&1 | tail -n 13; done

step roofline fp32 with --compile
timeout "${COMPILE_TIMEOUT:-150}" python3 -m tokenloom.entrypoints.cli bench roofline --model "$M" --device cuda \
  --dtype float32 --compile --batch-sizes 1,32 --context-lens 128 --disable-tqdm \
  --output-json "$O/roofline_fp32_compile.json" 2>&1 | tail -n 15
step done
