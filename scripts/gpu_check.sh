#!/usr/bin/env bash
# Everything #20 asks of a lent CUDA GPU, in one call (device time is scarce: one short,
# prepared script).  `--device cuda` runs the triton attention backend, the fused Triton
# ops and CUDA graphs for decode steps (what `auto` picks there).
#
#   bash scripts/gpu_check.sh            # on the GPU machine, in the repo root
#
# 1. correctness on the GPU: parity with transformers (every backend, captured graphs),
#    engine, sampler and server tests;
# 2. eager vs CUDA graphs: capture time and memory, launches and kernels per decode step
#    (scripts/gpu_decode_report.py);
# 2b. --async-scheduling off vs on: batch 1 step time, batch 256 tokens/s at context 512, bf16
#    (scripts/overlap_bench.py, wall clock: step events cannot time an overlapped step);
# 3. `bench roofline` bf16 at batch 1, 8, 32, 128, 256 (context 512);
# 4. `bench throughput --baseline hf` (bf16);
# 5. `bench roofline` fp32 at batch 1, 8, 32.
# Results (JSON, logs) go to $OUT (the device tool's folder) or /tmp/gpu_out.
#
# Wheels the GPU image lacks travel in .whl/ (git-ignored: name it in the device call's carry);
# fetch them here first, for the image's Python 3.12:
#   bash scripts/gpu_check.sh --fetch-wheels
# Measured with it: docs/gpu.md.
set -uo pipefail
if [ "${1:-}" = --fetch-wheels ]; then
  pkgs=$(python3 -m pip list --format=freeze 2>/dev/null | grep -iE \
    '^(fastapi|starlette|pydantic|pydantic_core|annotated-types|annotated-doc|typing-inspection|uvicorn|openai|jiter|distro|sniffio|httpx2|opentelemetry-api|importlib_metadata|importlib-metadata)==')
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
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__,
'triton', triton.__version__, torch.cuda.get_device_name(), 'cpus', __import__('os').cpu_count())"
tl make-model --preset qwen2.5-0.5b --out "$M" >/dev/null

step eager vs CUDA graphs, bf16
timeout "${REPORT_TIMEOUT:-150}" python3 scripts/gpu_decode_report.py --model "$M" --dtype bfloat16 \
  --batch-sizes 1,32,256 --context 512 --output-json "$O/decode_report_bf16.json" 2>&1 | tail -n 60

step async scheduling off vs on, bf16
timeout "${OVERLAP_TIMEOUT:-180}" python3 scripts/overlap_bench.py --model "$M" --device cuda --dtype bfloat16 \
  --batch-sizes 1,256 --context 512 --steps 64 --repeats 3 --kv-cache-memory 6GiB \
  --output-json "$O/overlap_bf16.json" 2>&1 | tail -n 8

step tests on cuda
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -o addopts= \
  tests/test_attention_backends.py tests/test_cuda_graphs.py tests/test_parity.py tests/test_engine.py \
  tests/test_sampler.py tests/test_async_scheduling.py tests/test_server.py 2>&1 | tee "$O/pytest.log" | tail -n 25

step roofline bf16
timeout "${ROOF_TIMEOUT:-150}" python3 -m tokenloom.entrypoints.cli bench roofline --model "$M" --device cuda \
  --dtype bfloat16 --batch-sizes 1,8,32,128,256 --context-lens 512 --max-model-len 1024 \
  --disable-tqdm --output-json "$O/roofline_bf16.json" 2>&1 | tail -n 22

step throughput vs transformers, bf16
timeout "${THR_TIMEOUT:-150}" python3 -m tokenloom.entrypoints.cli bench throughput --model "$M" --device cuda \
  --dtype bfloat16 --workload random --num-prompts 32 --input-len 32:256 --output-len 16:128 --baseline hf \
  --disable-tqdm --output-json "$O/throughput_vs_hf.json" 2>&1 | tail -n 30
step roofline fp32
timeout "${ROOF_TIMEOUT:-120}" python3 -m tokenloom.entrypoints.cli bench roofline --model "$M" --device cuda \
  --dtype float32 --batch-sizes 1,8,32 --context-lens 512 --max-model-len 1024 \
  --disable-tqdm --output-json "$O/roofline_fp32.json" 2>&1 | tail -n 12

step done
