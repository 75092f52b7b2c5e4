#!/usr/bin/env bash
# The whole experiment for one engine, with one command: start both arms, wait until they
# are ready, sweep the flag-off arm (expecting a difference) and the flag-on arm (expecting
# none), time the flag on both workloads at this TP degree, draw the pictures, and stop both
# servers on the way out, whatever happens.
#
#   GPUS=0,1 TP=1 examples/experiment.sh vllm results/
#   GPUS=0,1 TP=1 examples/experiment.sh sglang results/
#
# Every file lands in the output folder: server_off.log, server_on.log, sweep_off.json/.txt,
# sweep_on.json/.txt, cost.json/.txt and, with matplotlib, sweep.png and cost.png. The exit
# code is the first failing step's (0 when every step, and every --expect, held).
#
# Variables (all optional):
#   GPUS, TP, MEM, MODEL, BACKEND  passed to the launch scripts (see vllm_serve.sh, placement.sh)
#   SERVE_OFF, SERVE_ON  the commands that start each arm (default: this folder's launch script
#                        for ENGINE); the practice engine, for a dry run without a GPU:
#                        SERVE_OFF="python3 tests/stub_server.py --port 8000"
#                        SERVE_ON="python3 tests/stub_server.py --port 8001 --invariant"
#   OFF_URL, ON_URL      where the arms answer (default the launch scripts' ports)
#   WAIT                 seconds to wait for both arms to be ready (default 900: loading takes minutes)
#   SWEEP_ARGS, COST_ARGS  extra options for the sweeps and for each cost cell
set -uo pipefail
ENGINE=${1:?usage: examples/experiment.sh vllm|sglang OUTPUT_FOLDER}
OUT=${2:?usage: examples/experiment.sh vllm|sglang OUTPUT_FOLDER}
HERE=$(cd "$(dirname "$0")" && pwd)
case "$ENGINE" in
    vllm)   PORTS=(8000 8001) ;;
    sglang) PORTS=(30000 30001) ;;
    *)      echo "usage: examples/experiment.sh vllm|sglang OUTPUT_FOLDER" >&2; exit 2 ;;
esac
SERVE_OFF=${SERVE_OFF:-"env PORT=${PORTS[0]} bash $HERE/${ENGINE}_serve.sh off"}
SERVE_ON=${SERVE_ON:-"env PORT=${PORTS[1]} bash $HERE/${ENGINE}_serve.sh on"}
OFF_URL=${OFF_URL:-http://localhost:${PORTS[0]}}
ON_URL=${ON_URL:-http://localhost:${PORTS[1]}}
WAIT=${WAIT:-900}
TP=${TP:-1}
LAB=(python3 "$HERE/../run.py")
mkdir -p "$OUT" || exit 2

servers=()
stop_servers() {
    # Each arm runs in a process group of its own: stop the whole group (a launch script,
    # the engine it started, the engine's workers), give it 10 s to go, then make it go.
    local pid
    for pid in "${servers[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null; done
    for pid in "${servers[@]}"; do
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
    done
    servers=()
}
trap stop_servers EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

set -m  # background jobs get process groups of their own
$SERVE_OFF > "$OUT/server_off.log" 2>&1 & servers+=($!)
$SERVE_ON > "$OUT/server_on.log" 2>&1 & servers+=($!)
set +m

status=0
step() {  # step NAME COMMAND...: run it, keep the first failure's exit code
    local name=$1; shift
    "$@"
    local rc=$?
    echo "experiment: $name: exit $rc" >&2
    if (( rc != 0 && status == 0 )); then status=$rc; fi
    return 0
}
step "flag-off sweep" "${LAB[@]}" --mode sweep --engine "$ENGINE" --url "$OFF_URL" --wait-ready "$WAIT" \
    --expect variant --save "$OUT/sweep_off.json" ${SWEEP_ARGS:-} > "$OUT/sweep_off.txt"
step "flag-on sweep" "${LAB[@]}" --mode sweep --engine "$ENGINE" --url "$ON_URL" --wait-ready "$WAIT" \
    --expect invariant --save "$OUT/sweep_on.json" ${SWEEP_ARGS:-} > "$OUT/sweep_on.txt"
for WORKLOAD in cold shared-prefix; do
    step "cost, $WORKLOAD" "${LAB[@]}" --mode cost --engine "$ENGINE" --url "$OFF_URL" --invariant "$ON_URL" \
        --wait-ready "$WAIT" --workload "$WORKLOAD" --tp "$TP" --save "$OUT/cost.json" ${COST_ARGS:-} \
        >> "$OUT/cost.txt"
done
if python3 -c "import matplotlib" 2>/dev/null; then
    step "sweep picture" python3 "$HERE/plot_sweep.py" "$OUT/sweep_off.json" "$OUT/sweep_on.json" -o "$OUT/sweep.png"
    step "cost picture" python3 "$HERE/plot_cost.py" "$OUT/cost.json" -o "$OUT/cost.png"
else
    echo "experiment: no matplotlib, no pictures (pip install matplotlib)" >&2
fi
exit $status
