#!/usr/bin/env bash
# vLLM, one arm of the experiment:  examples/vllm_serve.sh off   (port 8000)
#                                   examples/vllm_serve.sh on    (port 8001)
# Then:  python3 run.py --mode sweep --engine vllm --url http://localhost:8000 --save off.json
#        python3 run.py --mode sweep --engine vllm --url http://localhost:8001 --save on.json --expect invariant
# Both arms run this same command, so they differ in the flag only (run.py --mode cost
# refuses a pair that differs in more). Edit the variables, not the command. On one GPU,
# start the second arm only once the first answers /health (experiment.sh does): see placement.sh.
set -euo pipefail
ARM=${1:?usage: examples/vllm_serve.sh off|on}
MODEL=${MODEL:-Qwen/Qwen3-1.7B}       # the weights under test (the upstream suite's default)
BACKEND=${BACKEND:-FLASH_ATTN}        # one of FLASH_ATTN, FLEX_ATTENTION, TRITON_ATTN (supported with the flag on)
TP=${TP:-1}                           # tensor-parallel degree; run the cost cells at 1 and at your real TP
GPUS=${GPUS:-0}                       # devices for both arms (see placement.sh); MEM sets the share
MAX_MODEL_LEN=${MAX_MODEL_LEN:-}      # the context length; empty: the model's own
EXTRA_ARGS=${EXTRA_ARGS:-}            # more flags, the same for both arms (e.g. "--dtype bfloat16")

case "$ARM" in
    # The flag is an environment variable read at start-up: set it explicitly, never inherit it.
    off) export VLLM_BATCH_INVARIANT=0; PORT=${PORT:-8000} ;;
    on)  export VLLM_BATCH_INVARIANT=1; PORT=${PORT:-8001} ;;
    *)   echo "usage: examples/vllm_serve.sh off|on" >&2; exit 2 ;;
esac
# Exposes GET /server_info, so the lab can read the flag, the backend and the graph sizes.
export VLLM_SERVER_DEV_MODE=1
source "$(dirname "$0")/placement.sh"
place_arm "$ARM"
# --gpu-memory-utilization: only when the arms share GPUs (or MEM is set): vLLM's default,
#                       0.9, leaves no room for the second arm.
MEM_FLAG=()
[[ -n $MEM_SHARE ]] && MEM_FLAG=(--gpu-memory-utilization "$MEM_SHARE")
# --max-model-len:      only when MAX_MODEL_LEN is set: a fixed value fails on a model whose
#                       context is shorter; a shorter one keeps the KV cache small.
LEN_FLAG=()
[[ -n $MAX_MODEL_LEN ]] && LEN_FLAG=(--max-model-len "$MAX_MODEL_LEN")

# --attention-backend:  pinned, the same in both arms; otherwise each arm may pick its own.
# --max-num-seqs 32:    what the server batches together at most (the upstream online test's
#                       value); it also sets the CUDA-graph capture sizes 1,2,4,8,16,24,...,64.
# --enable-prompt-tokens-details: usage reports cached prompt tokens, so the lab can check
#                       that its prefix-cache bypass held (and see cache hits when kept).
# --tensor-parallel-size: TP degree; at TP > 1 the flag also pins NCCL to one channel and
#                       tree all-reduce, and turns custom all-reduce off.
command=(vllm serve "$MODEL"
    --port "$PORT"
    --attention-backend "$BACKEND"
    --max-num-seqs 32
    --enable-prompt-tokens-details
    --tensor-parallel-size "$TP"
    ${LEN_FLAG[@]+"${LEN_FLAG[@]}"}
    ${MEM_FLAG[@]+"${MEM_FLAG[@]}"}
    $EXTRA_ARGS
)
# The command as it runs, first in the log: the experiment's report quotes it
# (every variable it sets, so that a copy of the line starts the same server)
printf 'launch: CUDA_VISIBLE_DEVICES=%s VLLM_BATCH_INVARIANT=%s VLLM_SERVER_DEV_MODE=%s' \
    "${CUDA_VISIBLE_DEVICES:-}" "$VLLM_BATCH_INVARIANT" "$VLLM_SERVER_DEV_MODE" >&2
printf ' %q' "${command[@]}" >&2
echo >&2
exec "${command[@]}"
