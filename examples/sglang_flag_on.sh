#!/usr/bin/env bash
# SGLang, arm 2 of the experiment: deterministic inference ON.
# Start this, then:  python3 run.py --mode sweep --engine sglang --url http://localhost:30001 --save on.json --expect invariant
# Edit the variables; keep them identical to sglang_flag_off.sh except PORT, or the arms
# differ in more than the flag (run.py --mode cost refuses such a pair).
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen3-8B}         # the weights under test (the upstream test class's default)
PORT=${PORT:-30001}                   # beside the flag-off arm on 30000
BACKEND=${BACKEND:-triton}            # fa3, flashinfer or triton (the deterministic choices)
TP=${TP:-1}                           # tensor-parallel degree; run the cost cells at 1 and at your real TP

# --attention-backend:          pinned, the same in both arms. Left out, the flag-on arm
#                               falls back to a backend of its own choosing (fa3, flashinfer
#                               or triton by GPU) and the arms no longer compare.
# --cuda-graph-max-bs-decode 32: the upstream test class's value; fixes the decode buckets
#                               1,2,4,8,12,16,24,32. Above 32 there is no graph to pad into.
#                               (0.5.18 and later; older releases spelled it --cuda-graph-max-bs.)
# --tp-size:                    TP degree; at TP > 1 the flag also pins NCCL's algorithm and channels.
# --enable-deterministic-inference: the flag. Batch-invariant matmul, log_softmax, RMSNorm;
#                               per-request sampling seeds; fixed attention split sizes.
exec python3 -m sglang.launch_server \
    --model-path "$MODEL" \
    --port "$PORT" \
    --attention-backend "$BACKEND" \
    --cuda-graph-max-bs-decode 32 \
    --tp-size "$TP" \
    --enable-deterministic-inference
