"""Shared helpers for the lab's tests: run run.py in-process, and derive expectations
from the stub's arithmetic without using any of run.py's own code."""

import contextlib
import io
import json
import os
import random
import socket
import struct
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIXTURES = os.path.join(HERE, "fixtures", "vllm-0.26.0")
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import run  # noqa: E402
import stub_server  # noqa: E402
from stub_server import StubConfig, StubServer  # noqa: E402,F401


def fixture(name, folder=None):
    """A real engine's captured answer: vLLM 0.26.0's unless another folder is named."""
    path = os.path.join(FIXTURES, name) if folder is None else os.path.join(HERE, "fixtures", folder, name)
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def free_port():
    """A loopback port that nothing listens on (just now)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def post(url, body):
    """POST JSON to a practice engine; (status, decoded answer), errors included."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def get(url, as_text=False):
    """GET from a practice engine: the decoded JSON answer, or the text (as_text)."""
    with urllib.request.urlopen(url, timeout=30) as resp:
        body = resp.read().decode()
    return body if as_text else json.loads(body)


def wait_for(condition, seconds, poll=0.02):
    """Poll condition() until it holds or the deadline passes; True if it held."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll)
    return bool(condition())


class Result:
    def __init__(self, code, stdout, stderr):
        self.code, self.stdout, self.stderr = code, stdout, stderr

    def json(self):
        return json.loads(self.stdout)

    def __repr__(self):
        return "Result(code=%r, stdout=%r..., stderr=%r)" % (self.code, self.stdout[:300], self.stderr[-500:])


def run_lab(*argv, env=None):
    """run.main(argv) in this process, with stdout and stderr captured."""
    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run.main([str(a) for a in argv])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return Result(code, out.getvalue(), err.getvalue())


class TempDirTest(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory()
        self.tmp = self._tmp.name

    def tearDown(self):
        self._tmp.cleanup()

    def path(self, name):
        return os.path.join(self.tmp, name)

    def load(self, name):
        with open(self.path(name), encoding="utf-8") as f:
            return json.load(f)

    def saved(self, name):
        """The --save file as it stands, or None while it is absent or half there."""
        try:
            return self.load(name)
        except (OSError, ValueError):
            return None

    def run_and_signal(self, args, progressed, signum):
        """Start run.py, wait until progressed() holds, then send it signum; (code, out, err)."""
        p = subprocess.Popen([sys.executable, os.path.join(ROOT, "run.py")] + [str(a) for a in args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            self.assertTrue(wait_for(lambda: p.poll() is not None or progressed(), 60), "no progress")
        finally:
            p.send_signal(signum)
            out, err = p.communicate(timeout=60)
        return p.returncode, out, err


# ----------------------------------------------------------------------------
# Independent expectations from the stub's arithmetic


def ulps32(a, b):
    """float32 ULPs between a and b, by the unsigned bit pattern (a second formulation)."""
    def key(x):
        u = struct.unpack("<I", struct.pack("<f", x))[0]
        return u if u < 0x80000000 else 0x80000000 - u
    return abs(key(a) - key(b))


def stub_completion(engine, prompt, batch_size, max_tokens, k, temperature=0.0, seed=None,
                    invariant=False, graph_sizes=None):
    """(token ids, chosen logprobs, top dict per step) as the stub computes them for a batch."""
    sizes = graph_sizes or (stub_server.VLLM_GRAPH_SIZES if engine == "vllm" else stub_server.SGLANG_GRAPH_SIZES)
    plan = stub_server.reduction_plan(batch_size, sizes, invariant)
    rng = random.Random(seed) if seed is not None else None
    out = stub_server.generate(prompt, max_tokens, plan, temperature, 1.0, rng)
    chosen = [step[v] for v, step in zip(out["ids"], out["logprobs"])]
    tops = []
    for v, step in zip(out["ids"], out["logprobs"]):
        ranked = sorted(range(len(step)), key=lambda t: (-step[t], t))[:k]
        keep = ([v] + ranked) if engine == "vllm" else ranked
        tops.append({t: step[t] for t in keep})
    text = "".join(stub_server.token_text(v) for v in out["ids"])
    return out["ids"], chosen, tops, text


def expected_row(base, other):
    """(first token divergence, max ULP) of `other` against `base`, by the lab's stated rule."""
    ids_a, lp_a, top_a, _ = base
    ids_b, lp_b, top_b, _ = other
    n = min(len(ids_a), len(ids_b))
    div = next((t for t in range(n) if ids_a[t] != ids_b[t]), None)
    if div is None and len(ids_a) != len(ids_b):
        div = n
    worst = 0
    for t in range(n):
        if div is not None and t > div:
            break
        if div is None or t < div:
            worst = max(worst, ulps32(lp_a[t], lp_b[t]))
        for tok in set(top_a[t]) & set(top_b[t]):
            worst = max(worst, ulps32(top_a[t][tok], top_b[t][tok]))
    return div, worst


def expected_sweep(engine, prompt, sizes, max_tokens, k, **kw):
    """Per size (divergence, max ULP), and the unique completion count, from the stub alone."""
    base = stub_completion(engine, prompt, 1, max_tokens, k, **kw)
    rows, texts = {}, {base[3]}
    for n in sizes:
        other = stub_completion(engine, prompt, n, max_tokens, k, **kw)
        rows[n] = expected_row(base, other)
        texts.add(other[3])
    return rows, len(texts)


# ----------------------------------------------------------------------------
# Shared by the feature files

RUN_PY = os.path.join(ROOT, "run.py")
# The prompt a sweep sends unless told otherwise, written out (not read from run.py)
PROMPT = ("Explain, step by step, why adding the same floating-point numbers in a different order "
          "can give a different answer:")


def short_sweep(stub, *extra):
    """A one-pass sweep of 24 tokens against stub, at what sizes extra asks for, of copies in
    one request (each size one batch of the stub's, so its arithmetic says what comes back)
    unless extra names a --traffic."""
    return run_lab("--mode", "sweep", "--engine", stub.config.engine, "--url", stub.url, "--repeat", 1,
                   "--max-tokens", 24, "--traffic", "copies", *extra)


def sizes_of(doc):
    """A saved sweep's first prompt, size by size."""
    return {s["batch_size"]: s for s in doc["prompts"][0]["sizes"]}


def error_lines(r):
    """stderr's lines besides progress and the save notice."""
    return [line for line in r.stderr.splitlines() if line.strip()
            and not line.startswith(("run.py: progress: ", "run.py: saved "))]


def one_error_line(test, r, code, message):
    """Exit code, and exactly one line on stderr besides progress, holding message."""
    test.assertEqual(r.code, code, r)
    lines = error_lines(r)
    test.assertEqual(len(lines), 1, r.stderr)
    test.assertIn(message, lines[0])
    test.assertNotIn("Traceback", r.stderr)


def start_lab(*argv, **kwargs):
    """run.py in a process of its own, its output piped."""
    streams = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return subprocess.Popen([sys.executable, RUN_PY] + [str(a) for a in argv], text=True,
                            **dict(streams, **kwargs))


def finish(p, timeout=30):
    """(stdout, stderr) of a lab process once it ends; one still running after timeout
    seconds (a liveness bound: the faults would hold it a minute or more) is killed."""
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise


def sent_batch(completions, cached_tokens=None, cached=(), seen=None, **fields):
    """A batch as the Sender makes it: its completions, its answers' counts and what the
    counters saw (seen), with each completion's cache state decided by run.cache_states."""
    block = fields.pop("block", None)
    batch = run.SentBatch(list(completions), 0.0, cached_tokens, list(cached), cache_seen=seen,
                          **fields)
    counts = batch.cached or [cached_tokens] * len(batch.completions)
    batch.states, batch.cold_copies = run.cache_states(
        counts, cached_tokens, seen, False, batch.fillers, batch.copies, batch.prompt_tokens,
        block)
    return batch
