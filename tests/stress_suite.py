# SPDX-License-Identifier: Apache-2.0
"""Run the whole test suite again and again while busy loops hold every core, and count
how many runs pass: a test that depends on timing or on luck shows up here.

    python3 tests/stress_suite.py [--runs 10] [--busy N]

--busy defaults to the number of cores. Each run is `python3 -m unittest discover -s tests`
in a fresh process, as CI runs it. Prints one line per run and the tally; exit 0 only when
every run passed. Not collected by the suite (its name does not start with test_).
"""

import argparse
import multiprocessing
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def spin() -> None:
    while True:
        pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10, help="suite runs (default 10)")
    p.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="busy-loop processes (default: cores)")
    args = p.parse_args(argv)
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for s in spinners:
        s.start()
    passed = 0
    try:
        for i in range(1, args.runs + 1):
            start = time.monotonic()
            r = subprocess.run([sys.executable, "-m", "unittest", "discover", "-s", "tests"], cwd=ROOT,
                               capture_output=True, text=True)
            tail = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "(no output)"
            passed += r.returncode == 0
            print("run %d/%d: exit %d in %.0f s: %s" % (i, args.runs, r.returncode, time.monotonic() - start, tail),
                  flush=True)
            if r.returncode != 0:
                print("\n".join(line for line in r.stderr.splitlines() if line.startswith(("FAIL:", "ERROR:"))))
    finally:
        for s in spinners:
            s.terminate()
    print("%d of %d runs passed with %d busy loops on %d cores" % (passed, args.runs, args.busy, os.cpu_count() or 0))
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
