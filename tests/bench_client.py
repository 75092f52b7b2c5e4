# SPDX-License-Identifier: Apache-2.0
"""Benchmark: what run.py's sweep costs on the client, next to the least a client must do.

A server in another process answers instantly with large prerecorded vLLM answers: batch
sizes 1, 64, 128 and 256, 128 tokens each, top-5 logprobs, the logprobs a few float32 ULPs
apart between sizes (as with the flag off). Two clients fetch exactly the same bytes:

  lab   python3 run.py --mode sweep ... (parse, compare every completion, print the table)
  bare  urllib + json.loads, nothing else

Each runs in a fresh process; the figures are its CPU time for the work (best of --repeat)
and its peak resident memory. Targets: lab/bare CPU ratio at most 1.5, peak under 300 MB.

With --traffic concurrent it measures the concurrent sweep instead, at n = 256 and 1000
one-prompt requests in flight at once: the spread between the first and the last request's
send time (target under 0.5 s at 1000), the client's CPU per request against a bare client
that sends the same requests from threads released by one barrier (target at most 2x), and
peak memory (under 300 MB).

With --streams C it measures cost mode under load: C streamed requests in flight at once on
each of two arms (two streaming servers), against a bare client that holds the same C
streams from threads; it prints the CPU per streamed token of each.

With --many-prompts N it measures what saving costs: a sweep of N prompts at sizes 1 and 2,
once with --save and once without (target: at most 1.5x the time without).

    python3 tests/bench_client.py [--repeat 3] [--distinct] [--traffic concurrent] [--many-prompts 1000]

Not collected by the test suite (its name does not start with test_); it prints figures
and asserts nothing about time.
"""

import argparse
import io
import json
import os
import random
import resource
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SIZES = [1, 64, 128, 256]
TOKENS = 128
TOP_K = 5
MODEL = "bench/model"
_F32 = struct.Struct("<f")
_U32 = struct.Struct("<I")


def nudge(x, ulps):
    """x moved by `ulps` float32 steps (x a negative float32)."""
    bits = _U32.unpack(_F32.pack(x))[0] + ulps
    return _F32.unpack(_U32.pack(bits))[0]


def answer_for(batch_size, distinct=False):
    """A vLLM /v1/completions answer, logprobs shifted by size; with distinct, every choice
    of the batch is shifted again by its index (the worst case: no two copies alike)."""
    shift = {1: 0, 2: 1, 64: 2, 128: 3, 256: 5}[batch_size]
    choices = [choice_for(shift + (i % 4 if distinct else 0), i) for i in range(batch_size)]
    return json.dumps({"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": MODEL,
                       "choices": choices, "usage": {"prompt_tokens": batch_size, "completion_tokens":
                                                     batch_size * TOKENS, "total_tokens": 0}}).encode()


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
        "prompt_logprobs": None, "prompt_token_ids": None, "routed_experts": None,
    }


STREAM_TOKENS = 32     # tokens per streamed answer
STREAM_GAP = 0.02      # seconds between a stream's tokens, so that every stream is in flight at once


def serve_streams(port_file):
    """vLLM's streamed /v1/completions, usage on every event, a token every STREAM_GAP."""
    info = {"/version": b'{"version": "0.26.0"}',
            "/v1/models": json.dumps({"data": [{"id": MODEL, "max_model_len": 4096}]}).encode()}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            data = info.get(self.path, b"{}")
            self.send_response(200 if self.path in info else 404)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for k in range(STREAM_TOKENS):
                time.sleep(STREAM_GAP)
                self.wfile.write(b"data: " + json.dumps({"choices": [{"index": 0, "text": " w"}], "usage": {
                    "prompt_tokens": 9, "completion_tokens": k + 1, "total_tokens": 10 + k}}).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

    ThreadingHTTPServer.request_queue_size = 2048
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    with open(port_file, "w") as f:
        f.write(str(httpd.server_address[1]))
    httpd.serve_forever()


def streams_worker(kind, urls, streams):
    """C streams in flight: the lab's cost mode over two arms, or bare threads on one server."""
    import run  # noqa: E402
    off, on = urls.split(",")
    if kind == "lab":
        with open(os.devnull, "w") as devnull:
            saved, sys.stdout = sys.stdout, devnull
            try:
                code = run.main(["--mode", "cost", "--engine", "vllm", "--url", off, "--invariant", on,
                                 "--concurrency", str(streams), "--requests", str(streams), "--trials", "1",
                                 "--warmup", "0", "--max-tokens", str(STREAM_TOKENS), "--quiet"])
            finally:
                sys.stdout = saved
        assert code == 0, code
        return 2 * streams * STREAM_TOKENS

    def one(url):
        import http.client
        parts = url.split("//")[1].split(":")
        conn = http.client.HTTPConnection(parts[0], int(parts[1]))
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "p", "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        for line in resp:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                json.loads(line[6:])
        conn.close()

    threads = [threading.Thread(target=one, args=(url,)) for url in (off, on) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 2 * streams * STREAM_TOKENS


def serve(port_file, distinct):
    answers = {n: answer_for(n, distinct) for n in sorted(set(SIZES) | {2})}
    info = {"/version": b'{"version": "0.26.0"}',
            "/v1/models": json.dumps({"data": [{"id": MODEL, "max_model_len": 4096}]}).encode()}

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
            self.reply(200, info[self.path]) if self.path in info else self.reply(404, b"{}")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.reply(200, answers[len(body["prompt"])])

    ThreadingHTTPServer.request_queue_size = 2048  # a real server's backlog: a thousand connect at once
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    with open(port_file, "w") as f:
        f.write(str(httpd.server_address[1]))
    httpd.serve_forever()


def concurrent_worker(kind, url, n):
    """n one-prompt requests at once, by the lab or by bare threads; returns the send spread."""
    import run  # noqa: E402
    if kind == "lab":
        out = io.StringIO()
        saved, sys.stdout = sys.stdout, out
        try:
            code = run.main(["--mode", "sweep", "--url", url, "--sizes", "1,%d" % n, "--repeat", "1",
                             "--traffic", "concurrent", "--max-tokens", str(TOKENS), "--logprobs", str(TOP_K),
                             "--json"])
        finally:
            sys.stdout = saved
        assert code == 0, code
        return json.loads(out.getvalue())["prompts"][0]["sizes"][1]["runs"][0]["send_spread_s"]
    body = json.dumps({"model": MODEL, "prompt": [run.DEFAULT_PROMPT], "max_tokens": TOKENS, "temperature": 0.0,
                       "top_p": 1.0, "logprobs": TOP_K, "return_tokens_as_token_ids": True}).encode()
    barrier, sent = threading.Barrier(n), [0.0] * n

    def one(i):
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        barrier.wait()
        sent[i] = time.perf_counter()
        with urllib.request.urlopen(req) as resp:
            json.loads(resp.read())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(sent) - min(sent)


def many_prompts_worker(url, prompt_file, save):
    """One sweep of every prompt in prompt_file at sizes 1 and 2, saving to `save` (or not)."""
    import run  # noqa: E402
    args = ["--mode", "sweep", "--url", url, "--sizes", "1,2", "--repeat", "1", "--max-tokens", str(TOKENS),
            "--logprobs", str(TOP_K), "--prompt-file", prompt_file, "--quiet"] + (["--save", save] if save else [])
    with open(os.devnull, "w") as devnull:
        saved, sys.stdout = sys.stdout, devnull
        try:
            code = run.main(args)
        finally:
            sys.stdout = saved
    assert code == 0, code


def worker(kind, url, n=None, save=None):
    """Do the work once in this process; print CPU seconds and peak memory as JSON."""
    sys.path.insert(0, ROOT)
    import run  # noqa: E402  (imported before timing, as a user's process would have it)
    start = time.process_time()
    if kind in ("lab-streams", "bare-streams"):
        tokens = streams_worker(kind.split("-")[0], url, int(n))
        print(json.dumps({"cpu_s": time.process_time() - start, "tokens": tokens,
                          "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}))
        return 0
    if kind == "many":
        wall = time.monotonic()
        many_prompts_worker(url, n, save if save != "-" else None)
        print(json.dumps({"cpu_s": time.process_time() - start, "wall_s": time.monotonic() - wall,
                          "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}))
        return 0
    if n is not None:
        spread = concurrent_worker(kind, url, int(n))
        cpu = time.process_time() - start
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        print(json.dumps({"cpu_s": cpu, "peak_mb": peak_mb, "spread_s": spread}))
        return 0
    if kind == "lab":
        with open(os.devnull, "w") as devnull:
            saved, sys.stdout = sys.stdout, devnull
            try:
                code = run.main(["--mode", "sweep", "--url", url, "--sizes", ",".join(map(str, SIZES)), "--repeat", "1",
                                 "--max-tokens", str(TOKENS), "--logprobs", str(TOP_K)])
            finally:
                sys.stdout = saved
        assert code == 0, code
    else:
        for n in SIZES:
            body = json.dumps({"model": MODEL, "prompt": [run.DEFAULT_PROMPT] * n, "max_tokens": TOKENS,
                               "temperature": 0.0, "top_p": 1.0, "logprobs": TOP_K,
                               "return_tokens_as_token_ids": True}).encode()
            req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req) as resp:
                json.loads(resp.read())
    cpu = time.process_time() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(json.dumps({"cpu_s": cpu, "peak_mb": peak_mb}))


def measure(kind, url, repeat, n=None):
    runs = []
    for _ in range(repeat):
        out = subprocess.run([sys.executable, __file__, "--worker", kind, url] + ([str(n)] if n else []),
                             capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout))
    if n:
        return (min(r["cpu_s"] for r in runs), max(r["peak_mb"] for r in runs),
                statistics.median(r["spread_s"] for r in runs))
    return min(r["cpu_s"] for r in runs), max(r["peak_mb"] for r in runs)


def bench_many_prompts(url, repeat, count):
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = os.path.join(tmp, "prompts.txt")
        with open(prompt_file, "w") as f:
            f.write("\n".join("Prompt number %d: why does the order of a sum matter?" % i for i in range(count)))
        figures = {}
        for label, save in (("without --save", "-"), ("with --save", os.path.join(tmp, "s.json"))):
            runs = []
            for _ in range(repeat):
                out = subprocess.run([sys.executable, __file__, "--worker", "many", url, prompt_file, save],
                                     capture_output=True, text=True, check=True)
                runs.append(json.loads(out.stdout))
            figures[label] = min(r["wall_s"] for r in runs), min(r["cpu_s"] for r in runs)
            print("%d prompts x sizes 1,2 %-15s wall %.2f s, CPU %.2f s" % ((count, label) + figures[label]))
        print("with/without --save: %.2fx wall (target <= 1.5)" % (figures["with --save"][0] / figures["without --save"][0]))


def bench_streams(streams, repeat):
    files = [os.path.join(os.environ.get("TMPDIR", "/tmp"), "bench-streams-%d-%d.port" % (os.getpid(), i))
             for i in range(2)]
    servers = [subprocess.Popen([sys.executable, __file__, "--serve-streams", f]) for f in files]
    try:
        for f in files:
            while not os.path.exists(f) or not open(f).read():
                time.sleep(0.05)
        urls = ",".join("http://127.0.0.1:%s" % open(f).read() for f in files)
        print("%d streams on each of two servers, %d tokens each, one every %g s" % (streams, STREAM_TOKENS, STREAM_GAP))
        for kind in ("bare-streams", "lab-streams"):
            runs = []
            for _ in range(repeat):
                out = subprocess.run([sys.executable, __file__, "--worker", kind, urls, str(streams)],
                                     capture_output=True, text=True, check=True)
                runs.append(json.loads(out.stdout))
            best = min(runs, key=lambda r: r["cpu_s"])
            print("%-13s CPU %.2f s for %d streamed tokens: %.1f us a token, peak %.0f MB" % (
                kind.split("-")[0], best["cpu_s"], best["tokens"], 1e6 * best["cpu_s"] / best["tokens"], best["peak_mb"]))
    finally:
        for s in servers:
            s.terminate()
            s.wait()
        for f in files:
            if os.path.exists(f):
                os.unlink(f)


def bench_concurrent(url, repeat):
    for n in (256, 1000):
        lab_cpu, lab_peak, lab_spread = measure("lab", url, repeat, n)
        bare_cpu, bare_peak, bare_spread = measure("bare", url, repeat, n)
        requests = n + 1  # the lab also sends batch 1 alone
        print("n=%d: lab send spread %.3f s (bare %.3f s; target < 0.5 s at 1000)" % (n, lab_spread, bare_spread))
        print("       CPU per request: lab %.2f ms, bare %.2f ms, ratio %.2f (target <= 2); peak lab %.0f MB, "
              "bare %.0f MB" % (1000 * lab_cpu / requests, 1000 * bare_cpu / n,
                                (lab_cpu / requests) / (bare_cpu / n), lab_peak, bare_peak))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--distinct", action="store_true", help="no two completions of a batch alike")
    p.add_argument("--traffic", choices=("copies", "concurrent"), default="copies")
    p.add_argument("--many-prompts", type=int, metavar="N", help="measure --save's cost on a sweep of N prompts")
    p.add_argument("--streams", type=int, metavar="C", help="measure cost mode with C streams in flight per arm")
    p.add_argument("--serve-streams", help=argparse.SUPPRESS)
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--serve", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return serve(args.serve, args.distinct)
    if args.serve_streams:
        return serve_streams(args.serve_streams)
    if args.streams:
        return bench_streams(args.streams, args.repeat)
    if args.worker:
        return worker(*args.worker)
    port_file = os.path.join(os.environ.get("TMPDIR", "/tmp"), "bench-client-%d.port" % os.getpid())
    server = subprocess.Popen([sys.executable, __file__, "--serve", port_file] +
                              (["--distinct"] if args.distinct else []))
    try:
        while not os.path.exists(port_file) or not open(port_file).read():
            time.sleep(0.05)
        url = "http://127.0.0.1:%s" % open(port_file).read()
        if args.many_prompts:
            bench_many_prompts(url, args.repeat, args.many_prompts)
            return 0
        if args.traffic == "concurrent":
            print("one-prompt answers of %d tokens, top-%d, answered at once" % (TOKENS, TOP_K))
            bench_concurrent(url, args.repeat)
            return 0
        sizes = {n: len(answer_for(n, args.distinct)) for n in SIZES}
        print("answers: %s bytes for batch sizes %s (%d tokens, top-%d, %s)" % (
            "/".join("%.1fM" % (b / 1e6) for b in sizes.values()), ",".join(map(str, SIZES)), TOKENS, TOP_K,
            "every completion different" if args.distinct else "copies in a batch alike"))
        lab_cpu, lab_peak = measure("lab", url, args.repeat)
        bare_cpu, bare_peak = measure("bare", url, args.repeat)
        print("bare urllib + json.loads: CPU %.3f s, peak %.0f MB" % (bare_cpu, bare_peak))
        print("run.py --mode sweep:      CPU %.3f s, peak %.0f MB" % (lab_cpu, lab_peak))
        print("ratio lab/bare: %.2f (target <= 1.5); peak %s 300 MB" % (
            lab_cpu / bare_cpu, "under" if lab_peak < 300 else "OVER"))
    finally:
        server.terminate()
        server.wait()
        if os.path.exists(port_file):
            os.unlink(port_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
