#!/usr/bin/env bash
# The whole experiment for one engine, with one command (experiment.py says what it does):
#
#   GPUS=0 TP=1 examples/experiment.sh vllm results/
#   GPUS=0,1,2,3 TP=1,2 examples/experiment.sh sglang results/
#   examples/experiment.sh --help                  # every variable, with its default
exec python3 "$(dirname "$0")/experiment.py" "$@"
