#!/usr/bin/env bash
# Re-measure the README's figures on this machine (qwen2.5-0.5b shape, random weights, float32).
set -euo pipefail
source "$(dirname "$0")/measure_common.sh"
run tokenloom bench roofline --model "$M" --dtype float32 --batch-sizes 1,8,32 --context-lens 128,512 \
    --disable-tqdm --output-json "$R/roofline.json"
# bf16 vs fp32 at batch 1: three back-to-back pairs (the VM's bandwidth flips between runs;
# the README quotes the median ratio)
for i in 1 2 3; do
  run tokenloom bench roofline --model "$M" --dtype bfloat16 --batch-sizes 1 --context-lens 128 \
      --disable-tqdm --output-json "$R/roofline_bf16_$i.json"
  run tokenloom bench roofline --model "$M" --dtype float32 --batch-sizes 1 --context-lens 128 \
      --disable-tqdm --output-json "$R/roofline_fp32_b1_$i.json"
done
run tokenloom bench throughput --model "$M" --dtype float32 --workload random --num-prompts 32 \
    --input-len 32:256 --output-len 16:128 --baseline hf --disable-tqdm --output-json "$R/throughput_vs_hf.json"
for pc in enable no-enable; do
  run tokenloom bench serve --launch "$M" --dtype float32 --${pc}-prefix-caching --workload prefix \
      --num-prompts 24 --num-prefix-groups 3 --prefix-len 384 --input-len 16:64 --output-len 16:32 \
      --request-rate 2 --no-save-requests --disable-tqdm --output-json "$R/prefix_${pc}.json"
done
run tokenloom bench sweep --model "$M" --dtype float32 --workload mixed-long --num-prompts 24 \
    --input-len 32:128 --output-len 16:48 --long-fraction 0.125 --long-len 768 --request-rate 2 \
    --max-num-seqs-list 4,16 --max-num-batched-tokens-list 128,512,2048 --chunked-prefill on \
    --disable-tqdm --output-json "$R/sweep.json" --output-csv "$R/sweep.csv" --output-png "$R/sweep.png"
run tokenloom simulate --compare-with "$R/sweep.json" --recalibrate --output-json "$R/validate-sim-sweep.json"
