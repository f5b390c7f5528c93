#!/usr/bin/env bash
# A/B of the decode step before (88c4bb5, /tmp/old) and after (HEAD, /work/main) issue 38's refactor:
# bench roofline, batch 1 and 32, context 128, per dtype/quantization, old and new alternating.
set -u
OUT=${OUT:-/tmp/ab_out}; mkdir -p $OUT
M=/tmp/q05
run() {  # tree label args...
  local tree=$1 label=$2; shift 2
  if [ "$tree" = old ]; then pp=/tmp/old; else pp=/work/main; fi
  (cd /tmp && PYTHONPATH=$pp /tmp/fresh/bin/python -m tokenloom.entrypoints.cli bench roofline --model $M \
     --batch-sizes 1,32 --context-lens 128 --decode-steps ${STEPS:-12} --disable-tqdm --num-threads 2 \
     --output-json $OUT/$label-$tree-r$ROUND.json "$@" > $OUT/$label-$tree-r$ROUND.txt 2>&1) || echo "FAILED $label $tree"
}
for ROUND in ${ROUNDS:-1}; do
  for cfg in "fp32:--dtype float32" "bf16:--dtype bfloat16" "int8:--dtype bfloat16 --quantization int8" "int4:--dtype bfloat16 --quantization int4"; do
    label=${cfg%%:*}; args=${cfg#*:}
    if [ $((ROUND % 2)) = 1 ]; then order="old new"; else order="new old"; fi
    for t in $order; do run $t $label $args; echo "$(date +%T) $label $t r$ROUND done"; done
  done
done
/tmp/fresh/bin/python - <<'PY'
import json, glob, os, collections
out = os.environ.get("OUT", "/tmp/ab_out")
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for f in sorted(glob.glob(f"{out}/*.json")):
    label, tree, r = os.path.basename(f)[:-5].split("-")
    for p in json.load(open(f))["results"]["points"]:
        rows[(label, p["batch"])][tree].append(p["step_ms"])
import statistics as st
print(f"{'config':6} {'batch':>5} {'old ms':>9} {'new ms':>9} {'new/old':>8}")
for (label, b), d in sorted(rows.items()):
    o, n = st.median(d["old"]), st.median(d["new"])
    print(f"{label:6} {b:5} {o:9.2f} {n:9.2f} {n/o:8.3f}")
PY
