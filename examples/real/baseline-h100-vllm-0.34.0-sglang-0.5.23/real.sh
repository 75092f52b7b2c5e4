#!/usr/bin/env bash
# On the GPU machine, from the project root, after the install: the flag-on arm alone, then
# sweeps saved here and held against the H100 files of 2026-12-06 as --baseline.
set -u
R=.gpu/run
log() { echo "[real $(date -u +%H:%M:%S)] $*" | tee -a $OUT/real.log; }
source /tmp/gpu/env-vllm34.sh
nvidia-smi > $OUT/nvidia-smi.txt 2>&1
cat /tmp/model8b/FINGERPRINT.txt > $OUT/fingerprint-model8b.txt 2>&1
python3 run.py --version >> $OUT/real.log 2>&1
log "arm starts"
setsid bash -c "GPUS=0 TP=1 MODEL=/tmp/model8b MAX_MODEL_LEN=4096 examples/vllm_serve.sh on > /tmp/arm-on.log 2>&1" < /dev/null > /dev/null 2>&1 &
for i in $(seq 1 300); do
  python3 -c "import urllib.request; urllib.request.urlopen('http://localhost:8001/health', timeout=3)" 2>/dev/null && break
  sleep 2
done
log "arm healthy after ${i} tries"
COMMON="--url http://localhost:8001 --wait-ready 60 --prompt-file $R/prompt.txt --sizes 1,2,8 --repeat 2 --max-tokens 16"
for shape in concurrent copies; do
  log "sweep $shape"
  python3 run.py --mode sweep $COMMON --traffic $shape --save $OUT/here-on-$shape.json > $OUT/here-on-$shape.txt 2>&1
  echo "rc=$?" >> $OUT/here-on-$shape.txt
  log "sweep $shape against the H100 file"
  python3 run.py --mode sweep $COMMON --traffic $shape --baseline $R/h100-on-$shape.json --save $OUT/vs-h100-on-$shape.json > $OUT/vs-h100-on-$shape.txt 2>&1
  echo "rc=$?" >> $OUT/vs-h100-on-$shape.txt
done
log "a flag-off file as the baseline of the flag-on sweep"
python3 run.py --mode sweep $COMMON --traffic concurrent --baseline $R/h100-off-concurrent.json --save $OUT/vs-h100-off.json > $OUT/vs-h100-off.txt 2>&1
echo "rc=$?" >> $OUT/vs-h100-off.txt
log "independent comparison"
python3 $R/compare.py $R/h100-on-concurrent.json $OUT/here-on-concurrent.json $R/h100-on-copies.json $OUT/here-on-copies.json > $OUT/compare.txt 2>&1
cp /tmp/arm-on.log $OUT/arm-on.log
tar czf $OUT/results.tgz -C $OUT --exclude results.tgz . 2>/dev/null
log "done"
