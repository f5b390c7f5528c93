#!/usr/bin/env bash
# The simulator's validation on this machine (issue #7, README "Is the simulator right?"):
# for each workload, measure with `bench serve --launch`, then at once recalibrate the
# step costs and simulate the same requests (`simulate --compare-with`), so the
# calibration and the benchmark see the same machine state.
set -euo pipefail
source "$(dirname "$0")/measure_common.sh"
common=(--max-num-seqs 8 --num-kv-blocks 1024 --num-prompts 24 --output-len 16:64 --seed 0 --disable-tqdm)
status=0
pair() {  # name, then bench serve flags
  local name=$1; shift
  run tokenloom bench serve --launch "$M" "${common[@]}" "$@" --output-json "$R/validate-serve-$name.json"
  # simulate exits 1 when a headline error is over 15%: record it, run the other pairs anyway
  run tokenloom simulate --compare-with "$R/validate-serve-$name.json" --recalibrate \
      --output-json "$R/validate-sim-$name.json" || status=1
}
pair random --max-model-len 2048 --max-num-batched-tokens 256 --workload random --input-len 32:256 --request-rate 0.4
pair mixed-long-chunked --max-model-len 1024 --max-num-batched-tokens 256 --workload mixed-long \
    --input-len 32:128 --long-fraction 0.125 --long-len 768 --request-rate 0.3
pair mixed-long-unchunked --max-model-len 1024 --max-num-batched-tokens 1024 --no-enable-chunked-prefill \
    --workload mixed-long --input-len 32:128 --long-fraction 0.125 --long-len 768 --request-rate 0.3
exit $status
