#!/usr/bin/env bash
# Rebuild the sample files and pictures in examples/ from the practice engine (no GPU).
# The cost samples come from stubs slowed by chosen factors (SLOWDOWN below), so the
# chart has something to show: they illustrate the format, they measure no engine.
set -euo pipefail
cd "$(dirname "$0")/.."
STUB="python3 tests/stub_server.py"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
start() { $STUB "$@" >/dev/null & pids+=($!); }
wait_for() { python3 -c "import sys, time, urllib.request as u
for _ in range(50):
    try: u.urlopen(sys.argv[1] + '/version', timeout=1); break
    except OSError: time.sleep(0.1)" "$1"; }

# Sweeps: the default ladder and traffic (concurrent requests), flag off and flag on.
start --port 18100
start --port 18101 --invariant
wait_for http://127.0.0.1:18100; wait_for http://127.0.0.1:18101
rm -f examples/sample_sweep_off.json examples/sample_sweep_on.json
python3 run.py --mode sweep --url http://127.0.0.1:18100 --save examples/sample_sweep_off.json > examples/sample_sweep_off.txt || true
python3 run.py --mode sweep --url http://127.0.0.1:18101 --save examples/sample_sweep_on.json --expect invariant > examples/sample_sweep_on.txt

# Cost: four cells, each from a pair of stubs whose flag-on arm is slowed by SLOWDOWN. The
# emulated GPU time (32 steps of 0.006 s a trial) covers the stubs' own arithmetic for 4
# prompts of 16 tokens, so each trial measures the known factor, not that arithmetic; with
# this design the 95 % interval contained the known factor in 20 of 20 runs at +3, +22 and
# +35 % (tests/bench_coverage.py).
rm -f examples/sample_cost.json
port=18110
for cell in "1 cold 1.03" "1 shared-prefix 1.22" "2 cold 1.18" "2 shared-prefix 1.35"; do
    set -- $cell
    start --port $port --tp-size "$1" --step-delay 0.006 --jitter 0.05 --seed 1 --scheduler-window 0
    start --port $((port + 1)) --tp-size "$1" --step-delay 0.006 --jitter 0.05 --seed 2 --scheduler-window 0 --invariant --slowdown "$3"
    wait_for http://127.0.0.1:$port; wait_for http://127.0.0.1:$((port + 1))
    python3 run.py --mode cost --url http://127.0.0.1:$port --invariant http://127.0.0.1:$((port + 1)) \
        --batch 4 --trials 10 --warmup 1 --max-tokens 16 --workload "$2" --prefix-tokens 200 \
        --save examples/sample_cost.json > examples/sample_cost.txt
    port=$((port + 2))
done

python3 examples/plot_sweep.py examples/sample_sweep_off.json examples/sample_sweep_on.json -o examples/sample_sweep.png
python3 examples/plot_cost.py examples/sample_cost.json -o examples/sample_cost.png
