# SPDX-License-Identifier: Apache-2.0
"""Benchmark: the lab's own CPU for a batch, as a share of the GPU server's time for it.

The user pays for GPU time; the client's CPU matters only next to it. A server in another
process answers at once with prerecorded vLLM answers shaped like a real run's (64 tokens,
top-5 logprobs, the logprobs a few float32 ULPs apart between batch sizes, as with the flag
off), and the lab sweeps it in a fresh process: `--sizes 1,N --repeat 1`, its CPU counted
after its imports (a user's process has them too). That CPU is printed as a share of what
a real vLLM server took for the same batches (SERVER_S below), for each size, with copies
alike or every completion different, with and without --save. Goal: at most 5 % at every
size. Printed as figures (min / median / max of --repeat runs); nothing is asserted, and the
test suite does not collect this file (its name does not start with test_).

    python3 tests/bench_client.py                 # every size, every variant, 3 runs each
    python3 tests/bench_client.py --repeat 5
    python3 tests/bench_client.py --sizes 1,256
"""

import argparse
import json
import os
import random
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TOKENS = 64  # tokens per completion, as in the real runs SERVER_S comes from
TOP_K = 5  # top logprobs per step
MODEL = "bench/model"
GOAL_PCT = 5.0  # the client's CPU, at most this share of the server's time
# Seconds a real vLLM 0.26.0 server took to answer one batch of n copies of a prompt, 64
# tokens greedy with top-5 logprobs, on one H200 (TP 1, the 8-layer hidden-2048 random-weight
# Qwen3-shaped model: the fastest server the lab has measured, so the largest share). Sizes
# 1-128 from the flag-off copies sweep of 2026-12-01 (real-runs vllm-0.26.0-2xH200,
# sweep_tp1_flag_off.json); 256 from the concurrent sweep of the same day on one H200
# (real-runs 2026-12-01-h200, conc_8010.txt: 6.35 s over three passes).
SERVER_S = {1: 0.159, 64: 0.577, 128: 0.963, 256: 6.35 / 3}
INFO = {"/version": b'{"version": "0.26.0"}',
        "/v1/models": json.dumps({"data": [{"id": MODEL, "max_model_len": 4096}]}).encode()}
_F32 = struct.Struct("<f")
_U32 = struct.Struct("<I")


def nudge(x, ulps):
    """x moved by `ulps` float32 steps (x a negative float32)."""
    bits = _U32.unpack(_F32.pack(x))[0] + ulps
    return _F32.unpack(_U32.pack(bits))[0]


def choice_for(shift, index):
    rng = random.Random(7)
    steps = []
    for _ in range(TOKENS):
        ids = rng.sample(range(150000), TOP_K)
        lps = sorted((_F32.unpack(_F32.pack(-rng.uniform(0.01, 9.0)))[0] for _ in ids), reverse=True)
        steps.append([("token_id:%d" % i, nudge(lp, shift)) for i, lp in zip(ids, lps)])
    return {
        "index": index,
        "text": "".join(" w%s" % tok[0][0][9:] for tok in steps),
        "logprobs": {
            "text_offset": list(range(0, 13 * TOKENS, 13)),
            "token_logprobs": [s[0][1] for s in steps],
            "tokens": [s[0][0] for s in steps],
            "top_logprobs": [dict(s) for s in steps],
        },
        "finish_reason": "length", "stop_reason": None, "token_ids": None,
        "prompt_logprobs": None, "prompt_token_ids": None,
    }


def answer_for(batch_size, distinct):
    """A vLLM /v1/completions answer, logprobs shifted by size; with distinct, every choice is
    shifted again by its index modulo 4 (no two neighbours alike: the lab compares each in
    full)."""
    shift = 0 if batch_size == 1 else 1 + batch_size.bit_length()
    choices = [choice_for(shift + (i % 4 if distinct else 0), i) for i in range(batch_size)]
    return json.dumps({"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": MODEL,
                       "choices": choices, "usage": {"prompt_tokens": batch_size, "completion_tokens":
                                                     batch_size * TOKENS, "total_tokens": 0}}).encode()


def serve(port_file, distinct, sizes):
    """Every answer at once, chosen by the number of prompts asked for."""
    answers = {n: answer_for(n, distinct) for n in sizes}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, status, data):
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.reply(200, INFO[self.path]) if self.path in INFO else self.reply(404, b"{}")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.reply(200, answers[len(body["prompt"])])

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(port_file + ".tmp", port_file)
    server.serve_forever()


def start_server(distinct, sizes):
    """(process, base URL) of a server, once it listens."""
    port_file = os.path.join(tempfile.mkdtemp(prefix="bench-"), "port")
    argv = [sys.executable, __file__, "--serve", "distinct" if distinct else "copies", port_file,
            ",".join(map(str, sizes))]
    process = subprocess.Popen(argv)
    while not os.path.exists(port_file):
        time.sleep(0.02)
    with open(port_file) as f:
        return process, "http://127.0.0.1:%s" % f.read()


def client(url, sizes, save):
    """Run in a fresh process: the lab's sweep, its CPU after imports printed as JSON."""
    sys.path.insert(0, ROOT)
    import run  # imported before timing, as a user's process has it
    argv = ["--mode", "sweep", "--url", url, "--sizes", sizes, "--repeat", "1", "--max-tokens",
            str(TOKENS), "--logprobs", str(TOP_K), "--quiet"] + (["--save", save] if save else [])
    start = time.process_time()
    with open(os.devnull, "w") as devnull:
        saved, sys.stdout = sys.stdout, devnull
        try:
            code = run.main(argv)
        finally:
            sys.stdout = saved
    print(json.dumps({"code": code, "cpu_s": time.process_time() - start}))
    return 0


def client_cpu(url, sizes, save):
    argv = [sys.executable, __file__, "--client", url, sizes, save or ""]
    out = subprocess.run(argv, capture_output=True, text=True)
    figures = json.loads(out.stdout) if out.returncode == 0 else {"code": None}
    if figures["code"] != 0:
        raise SystemExit("bench_client: the lab failed on %s:\n%s" % (sizes, out.stderr[-2000:]))
    return figures["cpu_s"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3, help="runs per figure (at least 3)")
    p.add_argument("--sizes", default=",".join(map(str, SERVER_S)),
                   help="batch sizes, of %s" % ",".join(map(str, SERVER_S)))
    p.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--client", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        kind, port_file, sizes = args.serve
        return serve(port_file, kind == "distinct", [int(n) for n in sizes.split(",")])
    if args.client:
        return client(*args.client)
    sizes = [int(n) for n in args.sizes.split(",")]
    if args.repeat < 3 or not set(sizes) <= set(SERVER_S):
        p.error("--repeat at least 3; --sizes of %s" % ",".join(map(str, SERVER_S)))
    print("The lab's CPU for batch 1 and batch N, as a share of a real vLLM server's time for")
    print("them (goal: at most %g %%); min / median / max of %d runs" % (GOAL_PCT, args.repeat))
    print("%-9s %-6s %-5s %9s %22s" % ("answers", "save", "N", "server s", "client share %"))
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for distinct in (False, True):
            server, url = start_server(distinct, sorted(set(sizes) | {1}))
            try:
                for save in (False, True):
                    for n in sizes:
                        ladder = "1" if n == 1 else "1,%d" % n
                        server_s = SERVER_S[1] + (SERVER_S[n] if n != 1 else 0.0)
                        shares = []
                        for run_no in range(args.repeat):
                            path = os.path.join(tmp, "s%d-%d-%d.json" % (distinct, n, run_no))
                            cpu_s = client_cpu(url, ladder, path if save else None)
                            shares.append(100.0 * cpu_s / server_s)
                        worst = max(worst, statistics.median(shares))
                        print("%-9s %-6s %-5d %9.3f %8.2f %6.2f %6.2f" % (
                            "distinct" if distinct else "copies", "yes" if save else "no", n,
                            server_s, min(shares), statistics.median(shares), max(shares)))
                        sys.stdout.flush()
            finally:
                server.terminate()
                server.wait()
    print("largest median share: %.2f %% (%s the goal of %g %%)"
          % (worst, "within" if worst <= GOAL_PCT else "OVER", GOAL_PCT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
