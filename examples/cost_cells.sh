#!/usr/bin/env bash
# The four cost cells: TP=1 and TP=k, each on a cold and a shared-prefix workload.
# One cell alone is not a result; this fills the 2x2 table in cost.json.
#
#   1. Start both arms at TP=1 (e.g. TP=1 examples/vllm_serve.sh off and
#      TP=1 examples/vllm_serve.sh on), then:     examples/cost_cells.sh 1
#   2. Restart both arms at your real TP degree k, then: examples/cost_cells.sh k
#   3. python3 examples/plot_cost.py cost.json -o cost.png
#
# More run.py options after TP go to every cell (e.g. examples/cost_cells.sh 1 --max-tokens 64).
# For SGLang: ENGINE=sglang OFF=http://localhost:30000 ON=http://localhost:30001 examples/cost_cells.sh 1
set -euo pipefail
TP=${1:?usage: examples/cost_cells.sh TP [more run.py options]   (TP: the degree both arms were started with)}
shift
ENGINE=${ENGINE:-vllm}                     # vllm or sglang
OFF=${OFF:-http://localhost:8000}          # the flag-off arm
ON=${ON:-http://localhost:8001}            # the flag-on arm
SAVE=${SAVE:-cost.json}                    # the cells accumulate here, one per TP x workload
HERE=$(cd "$(dirname "$0")" && pwd)

CONCURRENCY=${CONCURRENCY:-}              # set it (e.g. 32) to time the arms under load instead
# --batch 32: the seed's cell, one request of 32 prompts a trial. With CONCURRENCY the cell is
# a load cell instead (streamed requests, that many at once: throughput, latency, TTFT and
# TPOT of both arms); run.py takes one of the two, never both.
TRIAL=(--batch 32)
[[ -n $CONCURRENCY ]] && TRIAL=(--concurrency "$CONCURRENCY")

for WORKLOAD in cold shared-prefix; do
    # --trials 20: trial pairs; --tp labels the cell if the server does not report it.
    python3 "$HERE/../run.py" --mode cost --engine "$ENGINE" --url "$OFF" --invariant "$ON" \
        "${TRIAL[@]}" --trials 20 --workload "$WORKLOAD" --tp "$TP" --save "$SAVE" "$@"
done
