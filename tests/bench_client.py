# SPDX-License-Identifier: Apache-2.0
"""Benchmark: what run.py costs on the client, next to the least a client must do.

A server in another process answers at once with large prerecorded vLLM answers (128
tokens, top-5 logprobs, the logprobs a few float32 ULPs apart between batch sizes, as with
the flag off); a bare standard-library client fetches exactly what the lab fetches and
decodes it, nothing else. Each figure is measured --repeat times (at least 3), the lab's
run and the bare client's in alternation, each in a fresh process, and printed as min /
median / max with its target beside it:

  ladder      sweep of sizes 1,64,128,256, copies alike: CPU, lab / bare             <= 1.25
  distinct    the same, no two neighbours in a batch alike (four variants in turn, so
              that every completion is compared in full): CPU, lab / bare             <= 1.5
  prompts     1000 prompts at sizes 1,2, with --save: CPU, lab / bare                <= 1.5
  memory      1000 prompts: peak memory with --save / without                        <= 1.5
  arrivals    --traffic concurrent, 1000 requests: the last request's arrival at the
              server after the first connect, in seconds (the server records both)    <= 0.5
  concurrent  the same run: CPU per request, lab / a bare client of 1000 threads     <= 1.5
  streams     load trials, 256 streams an arm: CPU per streamed token, lab / bare    <= 1.2
  startup     CPU of `run.py --version` (compiling and importing the file); no target

    python3 tests/bench_client.py                     # every figure
    python3 tests/bench_client.py ladder streams      # some of them
    python3 tests/bench_client.py --repeat 5

CPU is the process's own time for the work, after its imports (a user's process has them
too; startup measures them); peak memory is the maximum resident set. Each run of the lab
saves to a path of its own. Not collected by the test suite (its name does not start with
test_): it prints figures and asserts nothing.
"""

import argparse
import json
import os
import random
import resource
import selectors
import socket
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
RUN_PY = os.path.join(ROOT, "run.py")
LADDER = [1, 64, 128, 256]  # the sweep figures' batch sizes
TOKENS = 128  # tokens per completion
TOP_K = 5  # top logprobs per step
MODEL = "bench/model"
PROMPTS = 1000  # prompts of the prompts and memory figures
CONCURRENT = 1000  # requests in flight at once in the arrivals and concurrent figures
STREAMS = 256  # streams in flight on each arm in the streams figure
STREAM_TOKENS = 32  # tokens per streamed answer
STREAM_GAP = 0.02  # seconds between a stream's tokens, so that every stream is in flight at once
INFO = {"/version": b'{"version": "0.26.0"}',
        "/v1/models": json.dumps({"data": [{"id": MODEL, "max_model_len": 4096}]}).encode()}
_F32 = struct.Struct("<f")
_U32 = struct.Struct("<I")


# ----------------------------------------------------------------------------
# The answers

def nudge(x, ulps):
    """x moved by `ulps` float32 steps (x a negative float32)."""
    bits = _U32.unpack(_F32.pack(x))[0] + ulps
    return _F32.unpack(_U32.pack(bits))[0]


def answer_for(batch_size, distinct=False):
    """A vLLM /v1/completions answer, logprobs shifted by size; with distinct, every choice
    of the batch is shifted again by its index modulo 4 (no two neighbours alike: the lab,
    which compares a completion once with the one before it, compares every one in full)."""
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


def request_body(prompts):
    """What the lab sends for these prompts (the server answers by their count)."""
    return json.dumps({"model": MODEL, "prompt": prompts, "max_tokens": TOKENS, "temperature": 0.0,
                       "top_p": 1.0, "logprobs": TOP_K, "return_tokens_as_token_ids": True}).encode()


# ----------------------------------------------------------------------------
# The servers, each in a process of its own

def serve_instant(port_file, distinct):
    """Every answer at once, chosen by the number of prompts asked for."""
    answers = {n: answer_for(n, distinct) for n in sorted(set(LADDER) | {2})}

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

    listen(ThreadingHTTPServer, Handler, port_file)


def serve_streams(port_file):
    """vLLM's streamed /v1/completions, usage on every event, a token every STREAM_GAP."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            data = INFO.get(self.path, b"{}")
            self.send_response(200 if self.path in INFO else 404)
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

    listen(ThreadingHTTPServer, Handler, port_file)


def listen(server_class, handler, port_file):
    server_class.request_queue_size = 2048  # a real server's backlog: a thousand connect at once
    httpd = server_class(("127.0.0.1", 0), handler)
    with open(port_file, "w") as f:
        f.write(str(httpd.server_address[1]))
    httpd.serve_forever()


def serve_recording(port_file):
    """One thread and a selector, so that nothing on the server's side delays an arrival:
    notes when each connection was accepted and when its request was in whole, answers a
    one-prompt request at once, and tells GET /bench/arrivals, of the POSTs since it was last
    asked (then it forgets them), the first one's connect and the last one's arrival."""
    answer = answer_for(1)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" \
           b"Connection: close\r\n\r\n" % len(answer)
    sel = selectors.DefaultSelector()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen(2048)
    server.setblocking(False)
    sel.register(server, selectors.EVENT_READ, None)
    with open(port_file, "w") as f:
        f.write(str(server.getsockname()[1]))
    posts = []  # (accepted, arrived) of each POST

    def reply_to(request, accepted):
        line = request.split(b"\r\n", 1)[0].split()
        path = line[1].decode() if len(line) > 1 else "/"
        if line[0] == b"POST":
            posts.append((accepted, time.monotonic()))
            return head + answer
        if path == "/bench/arrivals":
            data = json.dumps({"first_connect": min((a for a, _ in posts), default=None),
                               "last_arrival": max((b for _, b in posts), default=None),
                               "requests": len(posts)}).encode()
            posts.clear()
        else:
            data = INFO.get(path, b"{}")
        status = b"200 OK" if data != b"{}" or path == "/bench/arrivals" else b"404 Not Found"
        return b"HTTP/1.1 %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (status, len(data), data)

    while True:
        for key, _ in sel.select():
            if key.data is None:
                while True:
                    try:
                        conn, _ = server.accept()
                    except BlockingIOError:
                        break
                    conn.setblocking(False)
                    sel.register(conn, selectors.EVENT_READ, {"in": b"", "out": None,
                                                              "accepted": time.monotonic()})
                continue
            conn, state = key.fileobj, key.data
            if state["out"] is None:
                chunk = conn.recv(1 << 16)
                state["in"] += chunk
                headers, sep, body = state["in"].partition(b"\r\n\r\n")
                length = next((int(h.split(b":")[1]) for h in headers.split(b"\r\n")
                               if h.lower().startswith(b"content-length:")), 0)
                if not chunk or (sep and len(body) >= length):
                    state["out"] = memoryview(reply_to(state["in"], state["accepted"]))
                    sel.modify(conn, selectors.EVENT_WRITE, state)
                continue
            try:
                sent = conn.send(state["out"])
            except BlockingIOError:
                continue
            state["out"] = state["out"][sent:]
            if not state["out"]:
                sel.unregister(conn)
                conn.close()


def start_server(kind):
    """(process, base URL) of a server of this kind, once it listens."""
    port_file = tempfile.mktemp(prefix="bench-port-")
    process = subprocess.Popen([sys.executable, __file__, "--serve", kind, port_file])
    while not os.path.exists(port_file) or not open(port_file).read():
        time.sleep(0.02)
    with open(port_file) as f:
        url = "http://127.0.0.1:%s" % f.read()
    os.unlink(port_file)
    return process, url


# ----------------------------------------------------------------------------
# The clients, each run in a fresh process: they print what they measured as JSON

def lab(argv):
    """run.main(argv) with stdout to /dev/null; the exit code must be 0."""
    import run
    with open(os.devnull, "w") as devnull:
        saved, sys.stdout = sys.stdout, devnull
        try:
            code = run.main(argv)
        finally:
            sys.stdout = saved
    assert code == 0, code


def post(url, prompts):
    req = urllib.request.Request(url + "/v1/completions", request_body(prompts), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as resp:
        return json.loads(resp.read())


def sweep_client(kind, url, sizes):
    if kind == "lab":
        lab(["--mode", "sweep", "--url", url, "--sizes", sizes, "--repeat", "1", "--max-tokens", str(TOKENS),
             "--logprobs", str(TOP_K), "--quiet"])
    else:
        import run
        for n in map(int, sizes.split(",")):
            post(url, [run.DEFAULT_PROMPT] * n)
    return {}


def prompts_client(kind, url, prompt_file, save):
    if kind == "lab":
        lab(["--mode", "sweep", "--url", url, "--sizes", "1,2", "--repeat", "1", "--max-tokens", str(TOKENS),
             "--logprobs", str(TOP_K), "--prompt-file", prompt_file, "--quiet"] + (["--save", save] if save else []))
    else:
        with open(prompt_file) as f:
            for prompt in f.read().splitlines():
                for n in (1, 2):
                    post(url, [prompt] * n)
    return {}


def concurrent_client(kind, url, n):
    n = int(n)
    """n one-prompt requests at once: the lab's concurrent traffic, or n bare threads each
    sending one urllib request once a barrier releases them all."""
    if kind == "lab":  # one batch size alone: every POST the server sees is one of the n
        lab(["--mode", "sweep", "--url", url, "--sizes", str(n), "--repeat", "1", "--traffic", "concurrent",
             "--max-tokens", str(TOKENS), "--logprobs", str(TOP_K), "--quiet"])
        return {"requests": n}
    import run
    barrier = threading.Barrier(n)

    def one():
        barrier.wait()
        post(url, [run.DEFAULT_PROMPT])

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"requests": n}


def streams_client(kind, urls, streams):
    streams = int(streams)
    """streams streamed requests in flight at once on each of two servers: the lab's load
    trials (one per arm), or bare threads holding the same streams and decoding every event."""
    off, on = urls.split(",")
    if kind == "lab":
        lab(["--mode", "cost", "--engine", "vllm", "--url", off, "--invariant", on, "--concurrency", str(streams),
             "--requests", str(streams), "--trials", "1", "--warmup", "0", "--max-tokens", str(STREAM_TOKENS),
             "--quiet"])
        return {"tokens": 2 * streams * STREAM_TOKENS}
    import http.client

    def one(url):
        host, port = url.split("//")[1].split(":")
        conn = http.client.HTTPConnection(host, int(port))
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "p", "stream": True}),
                     {"Content-Type": "application/json"})
        for line in conn.getresponse():
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                json.loads(line[6:])
        conn.close()

    threads = [threading.Thread(target=one, args=(url,)) for url in (off, on) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"tokens": 2 * streams * STREAM_TOKENS}


CLIENTS = {"sweep": sweep_client, "prompts": prompts_client, "concurrent": concurrent_client,
           "streams": streams_client}


def client_main(name, kind, *args):
    sys.path.insert(0, ROOT)
    import run  # noqa: F401  (imported before timing, as a user's process would have it)
    start = time.process_time()
    figures = CLIENTS[name](kind, *args)
    figures.update(cpu_s=time.process_time() - start,
                   peak_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)
    print(json.dumps(figures))
    return 0


def measure(name, kind, *args):
    out = subprocess.run([sys.executable, __file__, "--client", name, kind] + [str(a) for a in args],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit("bench_client: the %s %s client failed:\n%s" % (kind, name, out.stderr[-2000:]))
    return json.loads(out.stdout)


# ----------------------------------------------------------------------------
# The figures: each returns, per run, the figure's value

def sweep_ratio(distinct):
    def runs(repeat):
        server, url = start_server("distinct" if distinct else "instant")
        try:
            sizes = ",".join(map(str, LADDER))
            pairs = [(measure("sweep", "lab", url, sizes), measure("sweep", "bare", url, sizes))
                     for _ in range(repeat)]
        finally:
            stop(server)
        return [lab_run["cpu_s"] / bare_run["cpu_s"] for lab_run, bare_run in pairs]
    return runs


def many_prompts(repeat):
    """(CPU ratios with --save, memory ratios with/without --save), run by run."""
    server, url = start_server("instant")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            prompt_file = os.path.join(tmp, "prompts.txt")
            with open(prompt_file, "w") as f:
                f.write("\n".join("Prompt number %d: why does the order of a sum matter?" % i
                                  for i in range(PROMPTS)))
            cpu, memory = [], []
            for i in range(repeat):
                saved = measure("prompts", "lab", url, prompt_file, os.path.join(tmp, "s%d.json" % i))
                unsaved = measure("prompts", "lab", url, prompt_file, "")
                bare = measure("prompts", "bare", url, prompt_file, "")
                cpu.append(saved["cpu_s"] / bare["cpu_s"])
                memory.append(saved["peak_mb"] / unsaved["peak_mb"])
    finally:
        stop(server)
    return cpu, memory


def concurrent(repeat):
    """(arrival spreads of the lab's concurrent batch, CPU-per-request ratios), run by run."""
    server, url = start_server("recording")
    try:
        spreads, ratios = [], []
        for _ in range(repeat):
            arrivals(url)  # forget the start-up requests
            lab_run = measure("concurrent", "lab", url, CONCURRENT)
            seen = arrivals(url)
            spreads.append(seen["last_arrival"] - seen["first_connect"])
            bare = measure("concurrent", "bare", url, CONCURRENT)
            ratios.append((lab_run["cpu_s"] / lab_run["requests"]) / (bare["cpu_s"] / bare["requests"]))
    finally:
        stop(server)
    return spreads, ratios


def arrivals(url):
    """What the recording server saw of the POSTs since it was last asked."""
    with urllib.request.urlopen(url + "/bench/arrivals") as resp:
        return json.loads(resp.read())


def streams(repeat):
    servers = [start_server("streams") for _ in range(2)]
    try:
        urls = ",".join(url for _, url in servers)
        ratios = []
        for _ in range(repeat):
            lab_run, bare = measure("streams", "lab", urls, STREAMS), measure("streams", "bare", urls, STREAMS)
            ratios.append((lab_run["cpu_s"] / lab_run["tokens"]) / (bare["cpu_s"] / bare["tokens"]))
    finally:
        for server, _ in servers:
            stop(server)
    return ratios


def startup(repeat):
    runs = []
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, RUN_PY, "--version"], capture_output=True, check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        runs.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return runs


def stop(server):
    server.terminate()
    server.wait()


# ----------------------------------------------------------------------------
# main

FIGURES = ["ladder", "distinct", "prompts", "memory", "arrivals", "concurrent", "streams", "startup"]
TARGETS = {"ladder": 1.25, "distinct": 1.5, "prompts": 1.5, "memory": 1.5, "arrivals": 0.5,
           "concurrent": 1.5, "streams": 1.2, "startup": None}
LABELS = {
    "ladder": "sweep 1,64,128,256, CPU lab/bare",
    "distinct": "the same, all distinct, CPU lab/bare",
    "prompts": "%d prompts with --save, CPU lab/bare" % PROMPTS,
    "memory": "%d prompts, peak with/without --save" % PROMPTS,
    "arrivals": "concurrent %d: last arrival after first connect (s)" % CONCURRENT,
    "concurrent": "concurrent %d: CPU per request lab/bare" % CONCURRENT,
    "streams": "%d streams an arm: CPU per token lab/bare" % STREAMS,
    "startup": "run.py --version, CPU (s)",
}


def report(name, values):
    target = TARGETS[name]
    verdict = "" if target is None else ("met" if statistics.median(values) <= target else "MISSED")
    print("%-55s %7.3f %7.3f %7.3f   %-6s %s" % (LABELS[name], min(values), statistics.median(values),
                                               max(values), "-" if target is None else "<= %g" % target, verdict))
    sys.stdout.flush()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("figures", nargs="*", choices=FIGURES + [[]], metavar="FIGURE",
                   help="which figures (default: all): " + ", ".join(FIGURES))
    p.add_argument("--repeat", type=int, default=3, help="runs per figure (at least 3)")
    p.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--client", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        kind, port_file = args.serve
        if kind == "recording":
            return serve_recording(port_file)
        if kind == "streams":
            return serve_streams(port_file)
        return serve_instant(port_file, kind == "distinct")
    if args.client:
        return client_main(*args.client)
    if args.repeat < 3:
        p.error("--repeat: at least 3 (a median of fewer says little)")
    wanted = args.figures or FIGURES
    print("%-55s %7s %7s %7s   %s" % ("figure (%d runs each)" % args.repeat, "min", "median", "max", "target"))
    if "ladder" in wanted:
        report("ladder", sweep_ratio(False)(args.repeat))
    if "distinct" in wanted:
        report("distinct", sweep_ratio(True)(args.repeat))
    if "prompts" in wanted or "memory" in wanted:
        cpu, memory = many_prompts(args.repeat)
        for name, values in (("prompts", cpu), ("memory", memory)):
            if name in wanted:
                report(name, values)
    if "arrivals" in wanted or "concurrent" in wanted:
        spreads, ratios = concurrent(args.repeat)
        for name, values in (("arrivals", spreads), ("concurrent", ratios)):
            if name in wanted:
                report(name, values)
    if "streams" in wanted:
        report("streams", streams(args.repeat))
    if "startup" in wanted:
        report("startup", startup(args.repeat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
