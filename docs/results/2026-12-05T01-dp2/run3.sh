#!/usr/bin/env bash
# #21: one replica vs two replicas (one thread each), two alternating rounds, then the simulator's replay.
set -x
export PYTHONPATH=/work/wt21
TL="python -m tokenloom.entrypoints.cli"
M=/work/models/qwen05
COMMON="--launch $M --dtype bfloat16 --num-threads 1 --workload prefix --prefix-len 128 --input-len 16:64 --num-prompts 64 --max-concurrency 8 --output-len 64:64 --max-num-seqs 8 --max-num-batched-tokens 256 --max-model-len 2048 --num-kv-blocks 512 --disable-tqdm"
for round in 1 2; do
  uptime
  $TL bench serve $COMMON --output-json dp1_r$round.json --server-log dp1_r$round.log
  uptime
  $TL bench serve $COMMON --data-parallel-size 2 --output-json dp2_r$round.json --server-log dp2_r$round.log
done
uptime
$TL simulate --compare-with dp1_r1.json --output-json sim_dp1_r1.json --recalibrate
$TL simulate --compare-with dp2_r1.json --output-json sim_dp2_r1.json --recalibrate
for f in dp1_r2 dp2_r2; do $TL simulate --compare-with $f.json --output-json sim_$f.json; done
uptime
