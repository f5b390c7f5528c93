# Sourced by the measurement scripts: the model they measure, where results go, and `run`,
# which echoes a command and holds /tmp/tokenloom-measure.lock while it runs, so
# concurrent measurements never overlap.
M=${M:-/tmp/m/qwen2.5-0.5b}
R=${R:-docs/results}
mkdir -p "$R"
[ -d "$M" ] || tokenloom make-model --preset qwen2.5-0.5b --out "$M"
run() { echo "+ $*"; flock /tmp/tokenloom-measure.lock "$@"; }
