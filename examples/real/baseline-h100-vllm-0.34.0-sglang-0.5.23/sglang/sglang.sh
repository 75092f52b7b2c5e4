#!/usr/bin/env bash
# On the GPU machine, from the project root, after the SGLang install: the flag-on SGLang arm
# alone, its sweep saved, and the same sweep held against vLLM 0.34.0's flag-on sweep of the
# same model (saved on an H100 earlier the same day) as --baseline.
set -u
R=.gpu/run
O=/tmp/sg; mkdir -p $O
log() { echo "[sglang $(date -u +%H:%M:%S)] $*" | tee -a $O/sglang.log; }
source /tmp/gpu/env-sglang23.sh
nvidia-smi > $O/nvidia-smi.txt 2>&1
cat /tmp/model8b/FINGERPRINT.txt > $O/fingerprint-model8b.txt 2>&1
log "arm starts"
setsid bash -c "GPUS=0 TP=1 MODEL=/tmp/model8b EXTRA_ARGS='--sampling-backend pytorch --context-length 4096' examples/sglang_serve.sh on > $O/arm-on.log 2>&1" < /dev/null > /dev/null 2>&1 &
for i in $(seq 1 150); do
  python3 -c "import urllib.request; urllib.request.urlopen('http://localhost:30001/health', timeout=3)" 2>/dev/null && break
  sleep 2
done
log "arm healthy after ${i} tries"
C="--url http://localhost:30001 --wait-ready 60 --prompt-file $R/prompt.txt --sizes 1,2,8 --repeat 2 --max-tokens 16 --traffic concurrent"
python3 run.py --mode sweep $C --save $O/sglang-on-concurrent.json > $O/sglang-on-concurrent.txt 2>&1; echo "rc=$?" >> $O/sglang-on-concurrent.txt
python3 run.py --mode sweep $C --baseline $R/vllm-h100-on-concurrent.json --save $O/sglang-vs-vllm.json > $O/sglang-vs-vllm.txt 2>&1; echo "rc=$?" >> $O/sglang-vs-vllm.txt
python3 $R/compare.py $R/vllm-h100-on-concurrent.json $O/sglang-on-concurrent.json > $O/compare.txt 2>&1
log "done"
tar czf $OUT/sg.tgz -C /tmp sg
