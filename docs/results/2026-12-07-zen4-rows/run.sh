#!/usr/bin/env bash
# README rows that named no machine, re-measured on the AMD EPYC Zen 4 VM (2026-12-07), one after
# another, nothing else running: the simulator's validation (with the chunked-prefill stall),
# prefix caching on / off, one replica against two and the simulator's replay.
# Run from the repository root with the venv's tokenloom on PATH.
set -x
R=${R:-docs/results/2026-12-07-zen4-rows}
M=${M:-/tmp/m/qwen2.5-0.5b}
[ -d "$M" ] || tokenloom make-model --preset qwen2.5-0.5b --out "$M"
lscpu | grep -E "Model name|Model:|Family" > "$R/cpu.txt"
uptime
M=$M R=$R bash scripts/validate_simulator.sh
uptime
P="--launch $M --dtype float32 --workload prefix --num-prompts 24 --num-prefix-groups 3 --prefix-len 384 --input-len 16:64 --output-len 16:32 --request-rate 2 --disable-tqdm"
tokenloom bench serve $P --enable-prefix-caching --output-json "$R/prefix_on.json"
tokenloom bench serve $P --no-enable-prefix-caching --output-json "$R/prefix_off.json"
uptime
D="--launch $M --dtype bfloat16 --num-threads 1 --workload prefix --prefix-len 128 --input-len 16:64 --num-prompts 64 --max-concurrency 8 --output-len 64:64 --max-num-seqs 8 --max-num-batched-tokens 256 --max-model-len 2048 --num-kv-blocks 512 --disable-tqdm"
tokenloom bench serve $D --output-json "$R/dp1.json"
tokenloom bench serve $D --data-parallel-size 2 --output-json "$R/dp2.json"
tokenloom simulate --compare-with "$R/dp1.json" --output-json "$R/sim_dp1.json" --recalibrate
tokenloom simulate --compare-with "$R/dp2.json" --output-json "$R/sim_dp2.json" --recalibrate
uptime
# the roofline rows (README: batch-1 read roof, batch-32 compute roof, bf16 against fp32)
tokenloom bench roofline --model "$M" --dtype float32 --batch-sizes 1,8,32 --context-lens 128 --output-json "$R/roofline_fp32.json"
tokenloom bench roofline --model "$M" --dtype bfloat16 --batch-sizes 1,32 --context-lens 128 --output-json "$R/roofline_bf16.json"
uptime
