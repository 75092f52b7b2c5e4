#!/usr/bin/env bash
# SGLang, one arm of the experiment:  examples/sglang_serve.sh off   (port 30000)
#                                     examples/sglang_serve.sh on    (port 30001)
# Then:  python3 run.py --mode sweep --engine sglang --url http://localhost:30000 --save off.json
#        python3 run.py --mode sweep --engine sglang --url http://localhost:30001 --save on.json --expect invariant
# Both arms run this same command, so they differ in the flag only (run.py --mode cost
# refuses a pair that differs in more). Edit the variables, not the command. On one GPU,
# start the second arm only once the first answers /health (experiment.sh does): see placement.sh.
set -euo pipefail
ARM=${1:?usage: examples/sglang_serve.sh off|on}
MODEL=${MODEL:-Qwen/Qwen3-8B}         # the weights under test (the upstream test class's default)
BACKEND=${BACKEND:-triton}            # fa3, flashinfer or triton (the deterministic choices)
TP=${TP:-1}                           # tensor-parallel degree; run the cost cells at 1 and at your real TP
GPUS=${GPUS:-0}                       # devices for both arms (see placement.sh); MEM sets the share
RADIX_CACHE=${RADIX_CACHE:-off}       # off (default) or keep: see --disable-radix-cache below
EXTRA_ARGS=${EXTRA_ARGS:-}            # more flags, the same for both arms (e.g. "--sampling-backend pytorch")

case "$ARM" in
    # --enable-deterministic-inference: the flag. Batch-invariant matmul, log_softmax and
    # RMSNorm, per-request sampling seeds, fixed attention split sizes; at TP > 1 a fixed
    # NCCL algorithm and channel count, and no custom all-reduce.
    off) FLAG=();                                   PORT=${PORT:-30000} ;;
    on)  FLAG=(--enable-deterministic-inference);   PORT=${PORT:-30001} ;;
    *)   echo "usage: examples/sglang_serve.sh off|on" >&2; exit 2 ;;
esac
source "$(dirname "$0")/placement.sh"
place_arm "$ARM"
# --mem-fraction-static: only when the arms share GPUs (or MEM is set): SGLang's default,
#                        near 0.9, leaves no room for the second arm.
MEM_FLAG=()
[[ -n $MEM_SHARE ]] && MEM_FLAG=(--mem-fraction-static "$MEM_SHARE")
# --disable-radix-cache: unless RADIX_CACHE=keep. With the radix cache on, a request can be
#                        served from another's cached prefix, a path the flag does not make
#                        invariant (sgl-project/sglang#34683; the lab's known-hazards table,
#                        run.py --mode help); the lab's sweeps then report a hazard on both arms.
CACHE_FLAG=()
case "$RADIX_CACHE" in
    off)  CACHE_FLAG=(--disable-radix-cache) ;;
    keep) ;;
    *)    echo "RADIX_CACHE=$RADIX_CACHE: off or keep" >&2; exit 2 ;;
esac

# --attention-backend:           pinned, the same in both arms. Left out, the flag-on arm
#                                falls back to a backend of its own choosing (fa3, flashinfer
#                                or triton by GPU) and the arms no longer compare.
# --cuda-graph-max-bs-decode 32: the upstream test class's value; fixes the decode buckets
#                                1,2,4,8,12,16,24,32. Above 32 there is no graph to pad into.
#                                (as in 0.5.18-0.5.23; older test classes used --cuda-graph-max-bs.)
# --tp-size:                     TP degree.
command=(python3 -m sglang.launch_server
    --model-path "$MODEL"
    --port "$PORT"
    --attention-backend "$BACKEND"
    --cuda-graph-max-bs-decode 32
    --tp-size "$TP"
    ${CACHE_FLAG[@]+"${CACHE_FLAG[@]}"}
    ${MEM_FLAG[@]+"${MEM_FLAG[@]}"}
    $EXTRA_ARGS
    ${FLAG[@]+"${FLAG[@]}"}
)
# The command as it runs, first in the log: the experiment's report quotes it
printf 'launch: CUDA_VISIBLE_DEVICES=%s' "${CUDA_VISIBLE_DEVICES:-}" >&2
printf ' %q' "${command[@]}" >&2
echo >&2
exec "${command[@]}"
