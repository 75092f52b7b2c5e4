#!/usr/bin/env bash
# vLLM, arm 2 of the experiment: batch-invariant kernels ON.
# Start this, then:  python3 run.py --mode sweep --engine vllm --url http://localhost:8001 --save on.json --expect invariant
# Edit the variables; keep them identical to vllm_flag_off.sh except PORT, or the arms
# differ in more than the flag (run.py --mode cost refuses such a pair).
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen3-1.7B}       # the weights under test (the upstream suite's default)
PORT=${PORT:-8001}                    # beside the flag-off arm on 8000
BACKEND=${BACKEND:-FLASH_ATTN}        # one of FLASH_ATTN, FLEX_ATTENTION, TRITON_ATTN (supported with the flag on)
TP=${TP:-1}                           # tensor-parallel degree; run the cost cells at 1 and at your real TP

# The flag is an environment variable read at start-up: set it explicitly, never inherit it.
export VLLM_BATCH_INVARIANT=1
# Exposes GET /server_info, so the lab can read the flag, the backend and the graph sizes.
export VLLM_SERVER_DEV_MODE=1

# --attention-backend: pinned, the same in both arms; otherwise each arm may pick its own.
# --max-num-seqs 32:   what the server batches together at most (the upstream online test's value);
#                      it also sets the CUDA-graph capture sizes 1,2,4,8,16,24,...,64.
# --max-model-len:     the upstream online test's value; keeps the KV cache small enough.
# --tensor-parallel-size: TP degree; at TP > 1 the flag also pins NCCL to one channel.
exec vllm serve "$MODEL" \
    --port "$PORT" \
    --attention-backend "$BACKEND" \
    --max-num-seqs 32 \
    --max-model-len 8192 \
    --tensor-parallel-size "$TP"
