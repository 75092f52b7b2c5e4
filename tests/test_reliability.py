"""Reliability: no input, answer, server, signal or disk crashes the lab, holds it past its
deadline, loses a measurement or leaks a secret, and no message blames the wrong thing. One
class per kind of fault (servers that fail, values that are not what they claim, deadlines,
stop signals, inputs, secrets, the lab's own faults); each test asserts the exit code, the
one stderr line (no traceback), what was saved and, where it applies, that no request was
sent. Every row of the README's reliability tables is backed by a test here (or in the file
the row names). Hostile servers are loopback servers of this file; the waits in their tests
are liveness bounds far above what the lab needs (the faults would hold it a minute or
more), never timings."""

import inspect
import io
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import unittest
from unittest import mock

from stub_server import (BadRequest, EngineState, models_list, sglang_generate,
                         sglang_server_info, vllm_completions, vllm_server_info)
from support import (ROOT, RUN_PY, Result, StubConfig, StubServer, TempDirTest, error_lines,
                     finish, free_port, one_error_line, run, run_lab, start_lab, wait_for)


SIZES = "1,2,4,8"   # the fault is injected at the 3rd generation request: batch size 4
KEY = "zq7-secretvalue-991"  # distinctive: no other text the lab prints holds its pieces
FUZZ_RUNS = 300  # sweeps against randomly damaged answers (about 5 s)


class NumbersThatAreNotNumbers(TempDirTest):
    def test_every_numeric_option_takes_only_a_finite_value_in_range(self):
        with StubServer() as stub:
            cases = [("--timeout", "nan"), ("--timeout", "inf"), ("--timeout", "-1"), ("--temperature", "nan"),
                     ("--temperature", "１"), ("--max-tokens", "٣"), ("--max-tokens", "1e3"), ("--logprobs", "²"),
                     ("--repeat", "3.0"), ("--sizes", "1,²"), ("--sizes", "1,٣"), ("--max-batch", "0x10"),
                     ("--seed", "-1"), ("--max-response-mb", "0"), ("--wait-ready", "nan")]
            for option, value in cases:
                with self.subTest(option=option, value=value):
                    r = run_lab("--mode", "sweep", "--url", stub.url, option, value)
                    one_error_line(self, r, 2, option)
            for option, value in (("--trials", "NaN"), ("--batch", "+inf"), ("--warmup", "-1"), ("--tp", "0"),
                                  ("--prefix-tokens", "1.5")):
                with self.subTest(option=option, value=value):
                    r = run_lab("--mode", "cost", "--url", stub.url, "--invariant", "http://127.0.0.1:9", option, value)
                    one_error_line(self, r, 2, option)
            self.assertEqual(stub.requests, [])


class FilesThatAreNotFiles(TempDirTest):
    def test_devices_fifos_and_folders_are_refused_before_any_request(self):
        fifo = self.path("fifo")
        os.mkfifo(fifo)
        with StubServer() as stub:
            for option, path in (("--prompt-file", "/dev/zero"), ("--prompt-file", fifo), ("--prompt-file", self.tmp),
                                 ("--baseline", "/dev/zero"), ("--baseline", fifo), ("--save", "/dev/null")):
                with self.subTest(option=option, path=path):
                    r = run_lab("--mode", "sweep", "--url", stub.url, option, path)
                    one_error_line(self, r, 2, "is not a regular file")
            self.assertEqual(stub.requests, [])

    def test_a_file_over_the_limit_is_refused_unread(self):
        big = self.path("big.txt")
        with open(big, "wb") as f:
            f.truncate(3 << 20)  # sparse: nothing to read
        with mock.patch.object(run, "MAX_INPUT_FILE_MB", 2), mock.patch("builtins.open", side_effect=AssertionError):
            with self.assertRaises(run.UsageError) as caught:
                run.read_input_file(big, "--prompt-file")
        self.assertIn("larger than 2 MB", str(caught.exception))


def random_json(rng, depth=0):
    """Any JSON value: every type, odd numbers, odd strings, some nesting."""
    kinds = ["null", "bool", "int", "big", "float", "nan", "str", "numstr"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([0, 1, -1, 7, 64, 2 ** 31])
    if kind == "big":
        return 10 ** rng.choice([20, 300, 400])
    if kind == "float":
        return rng.choice([0.5, -3.25, 1e308, -1e-320])
    if kind == "nan":
        return rng.choice([math.nan, math.inf, -math.inf])
    if kind == "str":
        return rng.choice(["", "x", "token_id:1", "\u00e9\u2603", "a" * 300])
    if kind == "numstr":
        return rng.choice(["1", "1.5", "NaN", "-9999.0"])
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["index", "text", "data", "id", "version", "bs", "x"]): random_json(rng, depth + 1)
            for _ in range(rng.randrange(4))}


def damage(value, rng, depth=0):
    """value with one random change somewhere: a key dropped, a value replaced by any JSON."""
    if depth > 8 or rng.random() < 0.2:
        return random_json(rng)
    if isinstance(value, dict) and value:
        value = dict(value)
        key = rng.choice(sorted(value, key=str))
        if rng.random() < 0.25:
            del value[key]
        else:
            value[key] = damage(value[key], rng, depth + 1)
        return value
    if isinstance(value, list) and value:
        value = list(value)
        i = rng.randrange(len(value))
        value[i] = damage(value[i], rng, depth + 1)
        if rng.random() < 0.15:
            value.append(value[i])  # a duplicate
        return value
    return random_json(rng)


class ServerValuesAreUntrusted(unittest.TestCase):
    """Fuzz: randomly typed and damaged answers for every endpoint of both engines end in
    exit 3 or a correct result, never a traceback (in under 10 s)."""

    def answers(self, engine):
        """The engine's answers as the practice engine gives them: info by path, generations
        computed from each request's own body."""
        config = StubConfig(engine=engine)
        if engine == "vllm":
            return {"/version": {"version": "0.26.0"}, "/v1/models": models_list(config),
                    "/server_info?config_format=json": vllm_server_info(config),
                    "/v1/completions": lambda body: vllm_completions(config, body, EngineState(config))}
        return {"/server_info": sglang_server_info(config, 30000), "/v1/models": models_list(config),
                "/generate": lambda body: sglang_generate(config, body, EngineState(config)),
                "/flush_cache": "Cache flushed."}

    def test_fuzz_every_endpoint_of_both_engines(self):
        rng = random.Random(2026)
        outcomes = {"vllm": set(), "sglang": set()}
        for _ in range(FUZZ_RUNS):
            engine = rng.choice(["vllm", "sglang"])
            good = self.answers(engine)
            damaged = rng.choice(sorted(good) + [None])  # None: every answer as sent
            seed = rng.random()

            def request(client, path, body=None, as_text=False, _good=good, _damaged=damaged, _seed=seed):
                if path not in _good:
                    raise run.ServerError("HTTP 404 from %s: Not Found" % path, 404)
                try:
                    answer = _good[path](body) if callable(_good[path]) else _good[path]
                except BadRequest as err:  # what the engine would refuse, it answers with an error
                    raise run.ServerError("HTTP %d from %s: %s" % (err.status, path, err.message), err.status)
                if path == _damaged:
                    answer = damage(answer, random.Random(_seed))
                if as_text:
                    return answer if isinstance(answer, str) else json.dumps(answer)
                return json.loads(json.dumps(answer))  # decoded as the lab decodes the wire

            with mock.patch.object(run.HttpClient, "request", request):
                r = run_lab("--mode", "sweep", "--engine", engine, "--url", "http://127.0.0.1:9", "--sizes", "1,2",
                            "--max-tokens", 3, "--logprobs", 2, "--repeat", 1, "--quiet", "--json")
            self.assertNotIn("Traceback", r.stderr, (engine, damaged))
            self.assertIn(r.code, (0, 1, 2, 3), r)
            if r.code == 0:
                json.loads(r.stdout)  # a correct result, in standard JSON
            else:
                errors = [x for x in r.stderr.splitlines() if x.startswith("run.py: ") and "warning" not in x]
                self.assertEqual(len(errors), 1, r.stderr)
            outcomes[engine].add(r.code)
        for engine in outcomes:
            self.assertTrue({0, 3} <= outcomes[engine], outcomes)

    def test_a_damaged_answer_mid_run_says_how_far_the_run_got(self):
        with StubServer(StubConfig(faults={3: "nochoices"})) as stub:
            path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "lab-rel-%d.json" % os.getpid())
            try:
                r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2,4", "--max-tokens", 4, "--repeat", 1,
                            "--save", path)
                with open(path) as f:
                    doc = json.load(f)
            finally:
                if os.path.exists(path):
                    os.unlink(path)
        self.assertEqual(r.code, 3)
        self.assertEqual(doc["summary"]["state"], "stopped: server error")
        self.assertEqual([s["batch_size"] for s in doc["prompts"][0]["sizes"]], [1, 2])

    def test_nan_logprobs_never_count_as_equal_and_the_file_stays_standard_json(self):
        base = run.Completion("a", ["a"], [math.nan], [{}])
        other = run.Completion("a", ["a"], [math.nan], [{}])
        d = run.compare_completions(base, other)
        self.assertEqual((d.first_ulp_step, d.ulp_notes), (0, ("non-finite",)))
        self.assertEqual(json.loads(run.json_text({"x": [math.nan, math.inf]})), {"x": ["NaN", "Infinity"]})

    def test_choice_indexes_must_be_whole_and_distinct(self):
        adapter = run.ADAPTERS["vllm"]
        for indexes in ([0, 0], [None, 1], ["0", 1], [0, 2], [True, 1]):
            with self.subTest(indexes=indexes):
                answer = {"choices": [{"index": i, "text": "x", "logprobs": None} for i in indexes]}
                with self.assertRaises(run.ServerError):
                    adapter.completions(answer, 2, False)


class Signals(TempDirTest):
    def stop_with(self, signum, args, progressed):
        return self.run_and_signal(args, progressed, signum)

    def test_sigterm_and_sighup_stop_like_ctrl_c_with_their_own_codes(self):
        for signum, code, state in ((signal.SIGTERM, 143, "terminated"), (signal.SIGHUP, 129, "hung up")):
            with self.subTest(signal=signum.name), StubServer(StubConfig(step_delay=0.02)) as stub:
                name = "%s.json" % signum.name
                code_got, out, err = self.stop_with(signum, [
                    "--mode", "sweep", "--url", stub.url, "--sizes", ",".join(map(str, range(1, 40))),
                    "--max-tokens", "8", "--repeat", "1", "--save", self.path(name)],
                    lambda: len(((self.saved(name) or {}).get("prompts") or [{"sizes": []}])[0]["sizes"]) >= 1)
                self.assertEqual(code_got, code, err)
                self.assertIn("stopping after the current request", err)
                self.assertNotIn("Traceback", err)
                self.assertIn("summary:", out)
                self.assertEqual(self.load(name)["summary"]["state"], state)
                self.assertEqual([f for f in os.listdir(self.tmp) if f.startswith(".run-")], [])

    def test_ctrl_c_during_warm_up_stops_after_the_current_warm_up_request(self):
        with StubServer(StubConfig(step_delay=0.05)) as off, StubServer(StubConfig(invariant=True, step_delay=0.05)) as on:
            code, out, err = self.stop_with(signal.SIGINT, [
                "--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", "1", "--trials", "3",
                "--warmup", "50", "--max-tokens", "4"], lambda: len(off.generation_bodies()) >= 1)
            sent = len(off.generation_bodies()) + len(on.generation_bodies())
        self.assertEqual(code, 130, err)
        self.assertIn("no complete trial pair", err)
        self.assertLess(sent, 10)


class Networks(TempDirTest):
    def test_a_server_trickling_bytes_meets_a_total_deadline(self):
        with StubServer(StubConfig(faults={2: "trickle"})) as stub:
            p = subprocess.Popen([sys.executable, os.path.join(ROOT, "run.py"), "--mode", "sweep", "--url",
                                  stub.url, "--sizes", "1,2", "--timeout", "1", "--repeat", "1", "--max-tokens",
                                  "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:  # a liveness bound: the trickled body alone takes 20 s
                out, err = p.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                raise
        one_error_line(self, Result(p.returncode, out, err), 3, "within 1s (--timeout)")

    def test_a_connection_closed_mid_body_is_dropped_not_invalid_json(self):
        with StubServer(StubConfig(faults={2: "truncate"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--repeat", 1, "--max-tokens", 2)
        one_error_line(self, r, 3, "dropped")


class ProxiesForThisMachine(TempDirTest):
    def test_the_machines_own_name_bypasses_a_dead_proxy(self):
        dead = "http://127.0.0.1:%d" % free_port()
        with StubServer() as stub, mock.patch.object(run.socket, "gethostname", lambda: "gpu-box-7"), \
                mock.patch.object(run.socket, "getaddrinfo", self.resolve_to_loopback(run.socket.getaddrinfo)):
            port = stub.url.rsplit(":", 1)[1]
            env = dict(os.environ, http_proxy=dead, HTTP_PROXY=dead, no_proxy="", NO_PROXY="")
            r = run_lab("--mode", "sweep", "--url", "http://gpu-box-7:%s" % port, "--sizes", "1,2", "--repeat", 1,
                        "--max-tokens", 2, env=env)
        self.assertEqual(r.code, 0, r)

    @staticmethod
    def resolve_to_loopback(real):
        def resolve(host, *args, **kwargs):
            return real("127.0.0.1" if host == "gpu-box-7" else host, *args, **kwargs)
        return resolve


class Secrets(TempDirTest):
    def test_credentials_in_a_url_are_refused_and_never_printed(self):
        for url in ("http://alice:s3cret-pw@127.0.0.1:8000", "http://alice:s3cret-pw@127.0.0.1:80x/v1"):
            with self.subTest(url=url):
                r = run_lab("--mode", "sweep", "--url", url)
                one_error_line(self, r, 2, "password in the URL is not accepted")
                self.assertNotIn("s3cret", r.stderr + r.stdout)

    def test_a_key_the_server_echoes_is_redacted(self):
        with StubServer(StubConfig(faults={2: "echokey"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--repeat", 1, "--max-tokens", 2,
                        "--api-key", "sk-very-secret-77", "--save", self.path("s.json"))
            with open(self.path("s.json")) as f:
                saved = f.read()
        one_error_line(self, r, 3, "HTTP 401")
        self.assertIn("[api key]", r.stderr)
        self.assertNotIn("sk-very-secret-77", r.stderr + r.stdout + saved)


class WholeAnswerDeadline(TempDirTest):
    """One deadline covers an answer from connecting to its last byte, and a stop signal
    abandons a stuck request."""

    def test_a_status_line_trickled_a_byte_at_a_time_is_cut_at_the_timeout(self):
        with StubServer(StubConfig(faults={2: "slowstatus"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                        "--repeat", 1, "--timeout", 1)
        self.assertEqual(r.code, 3, r)
        self.assertIn("no complete answer from %s within 1s (--timeout)" % stub.url, r.stderr)

    def test_sigterm_during_a_stuck_request_saves_and_ends(self):
        # The second request's status line would take 60 s to trickle in, under the default
        # --timeout of 600 s: only abandoning it ends the run (the wait below is a liveness bound).
        with StubServer(StubConfig(faults={2: "slowstatus"})) as stub:
            save = self.path("s.json")
            p = subprocess.Popen([sys.executable, os.path.join(ROOT, "run.py"), "--mode", "sweep", "--url",
                                  stub.url, "--sizes", "1,2", "--max-tokens", "4", "--repeat", "1",
                                  "--save", save], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self.assertTrue(wait_for(lambda: len(stub.generation_bodies()) >= 2, 30), "never sent batch 2")
            p.send_signal(signal.SIGTERM)
            out, err = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 143, err)
        self.assertEqual(self.load("s.json")["summary"]["state"], "terminated")
        self.assertIn("summary:", out)


class ServerFaultsInASweep(TempDirTest):
    def sweep_with_fault(self, fault, engine="vllm", *extra):
        with StubServer(StubConfig(engine=engine, faults={3: fault})) as stub:
            r = run_lab("--mode", "sweep", "--engine", engine, "--url", stub.url, "--sizes", SIZES,
                        "--max-tokens", 8, "--save", self.path("s.json"), *extra)
        return r, self.load("s.json")

    def assert_stopped_at_size_4(self, r, doc, cause):
        self.assertEqual(r.code, 3, r)
        errors = [line for line in r.stderr.splitlines() if "stopped" in line]
        self.assertEqual(len(errors), 1, r.stderr)
        self.assertIn("batch size 4", errors[0])
        self.assertIn(cause, errors[0])
        self.assertNotIn("Traceback", r.stderr)
        self.assertEqual([s["batch_size"] for s in doc["prompts"][0]["sizes"]], [1, 2])
        self.assertEqual(doc["summary"]["state"], "stopped: server error")
        self.assertIn("summary:", r.stdout)  # the partial summary is still shown

    def test_http_500_shows_the_servers_message(self):
        for engine in ("vllm", "sglang"):
            with self.subTest(engine=engine):
                r, doc = self.sweep_with_fault("http500", engine)
                self.assert_stopped_at_size_4(r, doc, "HTTP 500")
                self.assertIn("EngineCore encountered an issue.", r.stderr)

    def test_http_4xx_shows_the_servers_message(self):
        with StubServer(StubConfig(max_logprobs=3)) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                        "--save", self.path("s.json"))
        self.assertEqual(r.code, 3)
        self.assertIn("batch size 1", r.stderr)
        self.assertIn("HTTP 400", r.stderr)
        self.assertIn("Requested sample logprobs of 5, which is greater than max allowed: 3", r.stderr)
        self.assertEqual(self.load("s.json")["prompts"][0]["sizes"], [])

    def test_dropped_connection(self):
        r, doc = self.sweep_with_fault("drop")
        self.assert_stopped_at_size_4(r, doc, "dropped")

    def test_invalid_json(self):
        r, doc = self.sweep_with_fault("badjson")
        self.assert_stopped_at_size_4(r, doc, "invalid JSON")

    def test_wrong_shapes(self):
        causes = {"nochoices": "no choices", "fewer": "3 completions for 4 prompts",
                  "nulllogprobs": "completion 3 has no logprobs",
                  "ragged": "completion 3 has 8 tokens but 7 logprobs"}
        for fault, cause in causes.items():
            with self.subTest(engine="vllm", fault=fault):
                r, doc = self.sweep_with_fault(fault)
                self.assert_stopped_at_size_4(r, doc, "wrong shape: " + cause)
        sglang = {"nochoices": "expected a list", "fewer": "3 completions for 4 prompts",
                  "nulllogprobs": "completion 3 has no logprobs", "ragged": "7 tokens but 8 logprobs"}
        for fault, cause in sglang.items():
            with self.subTest(engine="sglang", fault=fault):
                r, doc = self.sweep_with_fault(fault, "sglang")
                self.assert_stopped_at_size_4(r, doc, cause)

    def test_timeout(self):
        r, doc = self.sweep_with_fault("stall", "vllm", "--timeout", "0.5")
        self.assert_stopped_at_size_4(r, doc, "within 0.5s")

    def test_oversized_answer_is_refused(self):
        r, doc = self.sweep_with_fault("huge", "vllm", "--max-response-mb", "1")
        self.assert_stopped_at_size_4(r, doc, "larger than 1 MB")

    def test_post_redirect_is_not_followed(self):
        r, doc = self.sweep_with_fault("redirect")
        self.assert_stopped_at_size_4(r, doc, "HTTP 307")

    def test_connection_refused(self):
        r = run_lab("--mode", "sweep", "--url", "http://127.0.0.1:%d" % free_port(), "--sizes", "1",
                    "--save", self.path("s.json"))
        self.assertEqual(r.code, 3)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1)
        self.assertIn("connection refused", r.stderr)
        self.assertFalse(os.path.exists(self.path("s.json")))

    def test_name_that_does_not_resolve(self):
        def no_such_host(*args, **kwargs):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        with mock.patch.object(socket, "getaddrinfo", no_such_host):
            r = run_lab("--mode", "sweep", "--url", "http://gpu-box.invalid:8000", "--sizes", "1")
        self.assertEqual(r.code, 3)
        self.assertIn("cannot resolve the host of http://gpu-box.invalid:8000", r.stderr)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1)

class MangledAnswers(unittest.TestCase):
    """Any mangling of a real answer is either parsed or refused as a wrong shape: no crash."""

    JUNK = (None, "x", 7, -1.5, [], {}, [None], [[1]], True)

    def mangle(self, value, rng, depth=0):
        if depth > 6 or rng.random() < 0.25:
            return rng.choice(self.JUNK)
        if isinstance(value, dict):
            value = dict(value)
            if value and rng.random() < 0.3:
                value.pop(rng.choice(sorted(value, key=str)))
            elif value:
                key = rng.choice(sorted(value, key=str))
                value[key] = self.mangle(value[key], rng, depth + 1)
            return value
        if isinstance(value, list):
            value = list(value)
            if value and rng.random() < 0.3:
                value.pop(rng.randrange(len(value)))
            elif value:
                i = rng.randrange(len(value))
                value[i] = self.mangle(value[i], rng, depth + 1)
            return value
        return rng.choice(self.JUNK)

    BODIES = {
        "vllm": {"model": "stub/tiny-f32", "prompt": ["p", "p"], "max_tokens": 4, "temperature": 0,
                 "logprobs": 3, "return_tokens_as_token_ids": True},
        "sglang": {"text": ["p", "p"], "sampling_params": {"temperature": 0, "max_new_tokens": 4},
                   "return_logprob": True, "top_logprobs_num": 3},
    }

    def test_parse_or_refuse(self):
        rng = random.Random(11)
        for engine, make in (("vllm", vllm_completions), ("sglang", sglang_generate)):
            with self.subTest(engine=engine):
                config = StubConfig(engine=engine)
                good = make(config, self.BODIES[engine], EngineState(config))
                adapter = run.ADAPTERS[engine]
                base = adapter.completions(good, 2, True)[0]
                for _ in range(400):
                    bad = self.mangle(good, rng)
                    try:
                        comps = adapter.completions(bad, 2, True)
                    except run.ServerError:
                        continue
                    run.compare_batch(comps, base, adapter.logprob_clamps)

class Interruption(TempDirTest):
    def run_and_interrupt(self, args, progressed):
        """Start run.py, wait until its --save file shows measured progress, then press Ctrl-C."""
        return self.run_and_signal(args, progressed, signal.SIGINT)

    def test_ctrl_c_stops_after_the_current_request_saves_and_summarises(self):
        with StubServer(StubConfig(step_delay=0.02)) as stub:  # 8 tokens: 0.16 s a request
            code, out, err = self.run_and_interrupt(
                ["--mode", "sweep", "--url", stub.url, "--sizes", ",".join(str(n) for n in range(1, 40)),
                 "--max-tokens", "8", "--save", self.path("s.json")],
                lambda: len((self.saved("s.json") or {"prompts": [{"sizes": []}]})["prompts"][0]["sizes"]) >= 2)
        self.assertEqual(code, 130, err)
        self.assertIn("stopping after the current request", err)
        self.assertNotIn("Traceback", err)
        self.assertIn("summary:", out)
        self.assertIn("(interrupted)", out)
        doc = self.load("s.json")
        self.assertEqual(doc["summary"]["state"], "interrupted")
        done = [s["batch_size"] for s in doc["prompts"][0]["sizes"]]
        self.assertTrue(1 <= len(done) < 39, done)
        self.assertEqual(done, list(range(1, len(done) + 1)))

    def test_ctrl_c_in_cost_keeps_the_pairs(self):
        with StubServer(StubConfig(step_delay=0.02)) as off, \
                StubServer(StubConfig(invariant=True, step_delay=0.02)) as on:
            code, out, err = self.run_and_interrupt(
                ["--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", "2",
                 "--trials", "50", "--warmup", "0", "--max-tokens", "8", "--save", self.path("c.json")],
                lambda: (self.saved("c.json") or {"cells": [{"trials": 0}]})["cells"][0]["trials"] >= 2)
        self.assertEqual(code, 130, err)
        cell = self.load("c.json")["cells"][0]
        self.assertEqual(cell["state"], "interrupted")
        self.assertGreaterEqual(cell["trials"], 1)
        self.assertLess(cell["trials"], 50)

    def test_broken_pipe_exits_quietly(self):
        p = subprocess.Popen([sys.executable, os.path.join(ROOT, "run.py"), "--mode", "harness"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        p.stdout.close()  # the reader is gone before the first byte, as with `| head -0`
        err = p.stderr.read().decode()
        p.wait(timeout=60)
        p.stderr.close()
        self.assertEqual(p.returncode, 141)
        self.assertEqual(err, "")

class BadArguments(TempDirTest):
    """Every one: exit 2, one line on stderr, no request sent."""

    def setUp(self):
        super().setUp()
        self.stub = StubServer().start()
        with open(self.path("sweep.json"), "w") as f:
            json.dump({"schema": run.SWEEP_SCHEMA, "prompts": []}, f)
        with open(self.path("cost.json"), "w") as f:
            json.dump({"schema": run.COST_SCHEMA, "cells": []}, f)
        with open(self.path("broken.json"), "w") as f:
            f.write('{"schema": ')
        with open(self.path("latin1.txt"), "wb") as f:
            f.write(b"caf\xe9\n")
        open(self.path("empty.txt"), "w").close()

    def tearDown(self):
        self.stub.stop()
        super().tearDown()

    def refused(self, *args, message):
        r = run_lab(*args)
        self.assertEqual(r.code, 2, (args, r))
        self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
        self.assertIn(message, r.stderr)
        self.assertNotIn("Traceback", r.stderr)
        self.assertEqual(self.stub.requests, [], args)

    def test_sweep_arguments(self):
        url = ("--url", self.stub.url)
        cases = [
            (("--sizes", ""), "--sizes"), (("--sizes", "0,1"), "start at 1"), (("--sizes", "-3"), "start at 1"),
            (("--sizes", "1,x"), "not a whole number"), (("--sizes", "1,2,2"), "listed twice"),
            (("--logprobs", "21"), "--logprobs: give 0 to 20"), (("--logprobs", "-1"), "--logprobs"),
            (("--temperature", "-0.5"), "--temperature"), (("--max-tokens", "0"), "--max-tokens"),
            (("--max-batch", "0"), "--max-batch"), (("--timeout", "0"), "--timeout"),
            (("--prompt-file", self.path("missing.txt")), "cannot read"),
            (("--prompt-file", self.path("empty.txt")), "holds no prompt"),
            (("--prompt-file", self.path("latin1.txt")), "not UTF-8"),
            (("--baseline", self.path("missing.json")), "cannot read"),
            (("--baseline", self.path("broken.json")), "not valid JSON"),
            (("--baseline", self.path("cost.json")), "not a sweep result"),
            (("--save", self.path("no/such/dir/s.json")), "does not exist"),
            (("--save", self.path("cost.json")), "refusing to overwrite"),
            (("--save", self.path("broken.json")), "not valid JSON"),
        ]
        for extra, message in cases:
            with self.subTest(args=extra):
                self.refused("--mode", "sweep", *url, *extra, message=message)

    def test_engine_and_url(self):
        self.refused("--mode", "sweep", "--engine", "tgi", message="--engine")
        for url in ("file:///etc/passwd", "ftp://host/x", "localhost:8000", "http://"):
            with self.subTest(url=url):
                self.refused("--mode", "sweep", "--url", url, message="not an http:// or https:// URL")
        self.refused("--mode", "cost", "--url", self.stub.url, "--invariant", "file:///x",
                     message="--invariant")

    def test_cost_arguments(self):
        base = ("--mode", "cost", "--url", self.stub.url)
        self.refused(*base, message="needs --invariant")
        self.refused(*base, "--invariant", self.stub.url + "/", message="the same server")
        port = self.stub.url.rsplit(":", 1)[1]
        self.refused("--mode", "cost", "--url", "http://localhost:" + port, "--invariant",
                     "http://127.0.0.1:" + port, message="the same server")
        self.refused(*base, "--invariant", "http://127.0.0.1:80x", message="port that is not a number")
        self.refused(*base, "--invariant", "http://127.0.0.1:1", "--trials", "0", message="--trials")
        self.refused(*base, "--invariant", "http://127.0.0.1:1", "--batch", "0", message="--batch")
        self.refused(*base, "--invariant", "http://127.0.0.1:1", "--save", self.path("sweep.json"),
                     message="refusing to overwrite")

class FilesAndSecurity(TempDirTest):
    def test_atomic_write_leaves_the_old_file_whole_on_failure(self):
        target = self.path("s.json")
        run.write_json_atomic(target, {"schema": run.SWEEP_SCHEMA, "n": 1})
        with mock.patch.object(run.os, "replace", side_effect=OSError(28, "No space left on device")):
            with self.assertRaises(run.SaveError):
                run.write_json_atomic(target, {"schema": run.SWEEP_SCHEMA, "n": 2})
        self.assertEqual(self.load("s.json")["n"], 1)
        self.assertEqual(os.listdir(self.tmp), ["s.json"])

    def test_a_redirect_to_another_server_is_refused_and_names_it(self):
        with StubServer() as target, StubServer(StubConfig(redirect_get_to=None)) as front:
            front.config.redirect_get_to = target.url
            r = run_lab("--mode", "sweep", "--url", front.url, "--sizes", "1", "--max-tokens", 4,
                        "--api-key", "key-abc")
            self.assertEqual(r.code, 3, r)
            self.assertIn("redirecting to %s" % target.url, r.stderr)
            self.assertIn("follows no redirect away from the server it was given", r.stderr)
            self.assertEqual(target.requests, [])  # the key never went there, nor anything else
            self.assertTrue(all(h.get("Authorization") == "Bearer key-abc" for _, _, h in front.requests))

    def test_key_never_printed_or_saved_in_cost(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 1,
                        "--trials", 1, "--warmup", 0, "--max-tokens", 2, "--save", self.path("c.json"),
                        env=dict(os.environ, OPENAI_API_KEY="sekret-cost-key"))
        self.assertEqual(r.code, 0, r)
        with open(self.path("c.json")) as f:
            self.assertNotIn("sekret", f.read())
        self.assertNotIn("sekret", r.stdout + r.stderr)

    def test_loopback_bypasses_the_proxy_and_other_hosts_use_it(self):
        dead_proxy = "http://127.0.0.1:%d" % free_port()
        with StubServer() as stub:
            env = dict(os.environ, http_proxy=dead_proxy, HTTP_PROXY=dead_proxy, no_proxy="", NO_PROXY="")
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1", "--max-tokens", 2, env=env)
            self.assertEqual(r.code, 0, r)
            # the stub as the proxy: a far host's requests arrive there with absolute URLs
            env = dict(os.environ, http_proxy=stub.url, HTTP_PROXY=stub.url, no_proxy="", NO_PROXY="")
            r = run_lab("--mode", "sweep", "--url", "http://gpu-box.example:8000", "--sizes", "1",
                        "--max-tokens", 2, env=env)
            self.assertEqual(r.code, 0, r)
            self.assertTrue(any(p.startswith("http://gpu-box.example:8000/") for _, p, _ in stub.requests))

class Deadlines(TempDirTest):
    """One deadline covers a whole answer in every traffic shape: the status line, the
    headers and every line of a stream."""

    def test_a_concurrent_request_trickling_its_status_line_is_cut_at_the_timeout(self):
        # Requests 2 and 3 are batch 2's two concurrent requests; one trickles for 68 s.
        with StubServer(StubConfig(faults={2: "slowstatus"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                        "--repeat", 1, "--traffic", "concurrent", "--timeout", 1)
        self.assertEqual(r.code, 3, r)
        self.assertIn("no complete answer from %s within 1s (--timeout)" % stub.url, r.stderr)
        self.assertIn("(1 of 2 concurrent requests failed)", r.stderr)

    def cost_under_load(self, fault, *extra):
        with StubServer(StubConfig(faults={1: fault})) as off, \
                StubServer(StubConfig(invariant=True)) as on:
            return run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url,
                           "--concurrency", 1, "--requests", 1, "--trials", 1, "--warmup", 0,
                           "--max-tokens", 4, *extra)

    def test_a_stream_line_that_never_ends_is_cut_at_the_timeout(self):
        with StubServer(StubConfig(faults={1: "endlessline"})) as off, \
                StubServer(StubConfig(invariant=True)) as on:
            p = start_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--concurrency", 1,
                          "--requests", 1, "--trials", 1, "--warmup", 0, "--max-tokens", 4, "--timeout", 1)
            _, err = finish(p, 30)  # the line ends after 60 s, when the stub hangs up
        self.assertEqual(p.returncode, 3, err)
        self.assertIn("within 1s (--timeout)", err)
        self.assertNotIn("Traceback", err)

    def test_a_stream_line_longer_than_any_event_is_named_as_such(self):
        r = self.cost_under_load("longline")
        self.assertEqual(r.code, 3, r)
        self.assertIn("a stream line from /v1/completions is longer than 1 MiB", r.stderr)

    def test_sigterm_abandons_a_stuck_concurrent_request_and_saves(self):
        save = self.path("s.json")
        with StubServer(StubConfig(faults={2: "slowstatus"})) as stub:
            p = start_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                          "--repeat", 1, "--traffic", "concurrent", "--save", save)
            self.assertTrue(wait_for(lambda: len(stub.generation_bodies()) >= 3, 30), "no batch 2")
            p.send_signal(signal.SIGTERM)
            out, err = finish(p, 30)  # the stuck request alone would take 68 s
        self.assertEqual(p.returncode, 143, err)
        self.assertEqual(self.load("s.json")["summary"]["state"], "terminated")
        self.assertNotIn("Traceback", err)

    def test_sigterm_abandons_a_stuck_stream(self):
        with StubServer(StubConfig(faults={1: "endlessline"})) as off, \
                StubServer(StubConfig(invariant=True)) as on:
            p = start_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--concurrency", 1,
                          "--requests", 1, "--trials", 1, "--warmup", 0, "--max-tokens", 4)
            self.assertTrue(wait_for(lambda: len(off.generation_bodies()) >= 1, 30), "no request")
            p.send_signal(signal.SIGTERM)
            out, err = finish(p, 30)  # the endless line alone would take 60 s
        self.assertEqual(p.returncode, 143, err)
        self.assertIn("terminated", err)
        self.assertNotIn("Traceback", err)

class TricklingServer:
    """A loopback server that answers every connection with a status line a byte every
    0.2 s, for a minute: no single read ever times out."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = "http://127.0.0.1:%d" % self.sock.getsockname()[1]
        self.stopping = threading.Event()
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.trickle, args=(conn,), daemon=True).start()

    def trickle(self, conn):
        with conn:
            for byte in b"HTTP/1.1 200 OK\r\n" * 18:
                if self.stopping.wait(0.2):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.sock.close()

class CuttingServer(TricklingServer):
    """Answers every connection with a JSON answer cut off half way, then hangs up."""

    def trickle(self, conn):
        with conn:
            try:
                conn.recv(65536)  # the request, read so that the hang-up is no reset
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 200\r\n\r\n{\"version\": \"0.2")
            except OSError:
                pass

class UntrustedTlsServer:
    """An HTTPS server on loopback whose certificate is self-signed (made with openssl when
    the test runs): what a gateway in front of an engine often is."""

    def __init__(self, folder):
        cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-subj", "/CN=127.0.0.1", "-keyout", key, "-out", cert],
                       check=True, capture_output=True)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = "https://127.0.0.1:%d" % self.sock.getsockname()[1]
        self.context = context
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            try:
                with self.context.wrap_socket(conn, server_side=True):
                    pass  # the client refuses the certificate in the handshake
            except (OSError, ssl.SSLError):
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.sock.close()

class WaitingForServers(TempDirTest):
    @unittest.skipUnless(shutil.which("openssl"), "openssl is not installed")
    def test_an_untrusted_certificate_is_named_not_a_dropped_connection(self):
        with UntrustedTlsServer(self.tmp) as server:
            r = run_lab("--mode", "sweep", "--url", server.url, "--engine", "vllm", "--sizes", 1)
        self.assertEqual(r.code, 3, r)
        self.assertIn("the TLS certificate of %s is not trusted here" % server.url, r.stderr)
        self.assertNotIn("dropped", r.stderr)

    def test_an_answer_cut_off_is_a_dropped_connection_not_a_wrong_shape(self):
        with CuttingServer() as server:
            r = run_lab("--mode", "sweep", "--url", server.url, "--engine", "vllm", "--sizes", 1)
        self.assertEqual(r.code, 3, r)
        self.assertIn("dropped in the middle of an answer", r.stderr)
        self.assertNotIn("wrong shape", r.stderr)
        self.assertNotIn("invalid JSON", r.stderr)

    def test_wait_ready_is_bounded_by_its_own_limit_against_a_trickling_server(self):
        with TricklingServer() as server:
            p = start_lab("--mode", "sweep", "--url", server.url, "--engine", "vllm", "--wait-ready", 2)
            out, err = finish(p, 30)  # a trickled answer alone would take 60 s
        self.assertEqual(p.returncode, 3, err)
        self.assertIn("was not ready within 2s (--wait-ready)", err)

class ValuesFromServers(TempDirTest):
    """Every value a server sends is checked for range as well as type before arithmetic."""

    def test_a_token_count_no_float_holds_is_refused(self):
        with StubServer(StubConfig(faults={1: "hugeusage"})) as off, \
                StubServer(StubConfig(invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 1,
                        "--trials", 1, "--warmup", 0, "--max-tokens", 4)
        self.assertEqual(r.code, 3, r)
        self.assertIn("usage.completion_tokens is 1%s, out of range" % ("0" * 29), r.stderr)
        self.assertLess(len(r.stderr), 1000)  # the number is cut, not printed whole

    def test_a_streamed_token_count_no_float_holds_is_refused(self):
        with StubServer(StubConfig(engine="sglang", faults={1: "hugeusage"})) as off, \
                StubServer(StubConfig(engine="sglang", invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--concurrency", 1,
                        "--requests", 1, "--trials", 1, "--warmup", 0, "--max-tokens", 4)
        self.assertEqual(r.code, 3, r)
        self.assertIn("completion_tokens is 1000000", r.stderr)
        self.assertIn("out of range", r.stderr)

    def test_token_ids_in_digits_that_are_not_ascii_are_not_ids(self):
        with StubServer(StubConfig(faults={1: "unicodeids"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", 1, "--max-tokens", 4,
                        "--repeat", 1, "--prefill-check")
        self.assertEqual(r.code, 3, r)
        self.assertIn("the prefill check needs token ids, and the server's tokens are not ids", r.stderr)
        self.assertNotIn("Traceback", r.stderr)

class FaultsOfTheLabsOwn(TempDirTest):
    """Whatever still escapes ends the run with one line, exit 70 (never 1, the code of a
    failed --expect), and what was measured saved."""

    def test_an_exception_in_a_load_worker_thread_ends_the_run_as_in_the_main_thread(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on, \
                mock.patch.object(run.VllmAdapter, "streamed_tokens", side_effect=RuntimeError("boom")):
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--concurrency", 2,
                        "--requests", 2, "--trials", 1, "--warmup", 0, "--max-tokens", 4)
        self.assertEqual(r.code, 70, r)
        self.assertIn("internal error (RuntimeError at run.py line", r.stderr)
        self.assertIn("boom); please report it", r.stderr)
        self.assertNotIn("Traceback", r.stderr)

    def test_an_internal_error_mid_sweep_saves_what_was_measured(self):
        real = run.compare_batch
        calls = []

        def fails_second_time(*args):
            calls.append(1)
            if len(calls) == 2:
                raise ZeroDivisionError("a bug")
            return real(*args)

        with StubServer() as stub, mock.patch.object(run, "compare_batch", fails_second_time):
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2,3", "--max-tokens", 4,
                        "--repeat", 1, "--save", self.path("s.json"))
        self.assertEqual(r.code, 70, r)
        doc = self.load("s.json")
        self.assertEqual(doc["summary"]["state"], "stopped: internal error")
        self.assertEqual([s["batch_size"] for s in doc["prompts"][0]["sizes"]], [1])
        self.assertIn("sweep stopped: internal error (ZeroDivisionError", r.stderr)


    def test_the_line_named_is_the_labs_own_when_a_library_raised(self):
        """The error rose inside the standard library (statistics.median of nothing): the line
        to report is where run.py called it, not the library's line under run.py's name."""
        try:
            run.statistics.median([])  # no frame of run.py at all: no line to name
        except run.statistics.StatisticsError as err:
            message = run.internal_error(err)
        self.assertEqual(message, "internal error (StatisticsError: no median for empty data); "
                                  "please report it")
        timing = run.RequestTiming(None, 1.0, 4, None, 1)
        with mock.patch.object(run, "percentile", lambda values, share: run.statistics.median([])):
            try:
                run.LoadStats.of([[timing]], [1.0], [4])
            except run.statistics.StatisticsError as err:
                message = run.internal_error(err)
        source, first = inspect.getsourcelines(run.LoadStats.of)
        named = int(re.search(r"run\.py line (\d+)", message).group(1))
        self.assertIn("percentile(", source[named - first])

    def test_trials_shorter_than_the_clock_resolution_leave_no_rate_and_no_crash(self):
        timing = run.RequestTiming(0.0, 0.0, 4, 0.0, 4)
        stats = run.LoadStats.of([[timing], [timing]], [0.0, 0.0], [4, 4])
        record = run.as_record(stats)
        self.assertIsNone(record["median_tokens_per_s"])
        self.assertIsNone(record["median_requests_per_s"])
        out = io.StringIO()
        unmeasured = {name: run.Overhead(None, None, False) for name in run.LOAD_FIGURES}
        cell = mock.Mock(load={"off": stats, "on": stats}, overheads=unmeasured,
                         compared_on="time per trial")
        run.LoadTrials.report(cell, run.Out(out, out))
        self.assertIn("flag off ? tokens/s, ? requests/s", out.getvalue())

class InputBoundedBeforeAnyRequest(TempDirTest):
    """Every input is bounded and every URL parsed under guard, with one line and exit 2,
    before any request."""

    def refused(self, *argv, message):
        with StubServer() as stub:
            r = run_lab("--mode", argv[0], "--url", stub.url, *argv[1:])
            self.assertEqual(stub.requests, [], "a request was sent")
        self.assertEqual(r.code, 2, r)
        self.assertEqual(len(error_lines(r)), 1, r.stderr)
        self.assertIn(message, r.stderr)
        return r

    def test_sizes_and_counts_have_upper_bounds(self):
        self.refused("sweep", "--sizes", "1,50000000", message="batch sizes go up to 4096")
        self.refused("sweep", "--max-batch", 10 ** 9, message="give 1 to 4096")
        cost = ("cost", "--invariant", "http://127.0.0.1:1")
        self.refused(*cost, "--prefix-tokens", 10 ** 9, message="give 1 to 1000000")
        self.refused(*cost, "--batch", 5000, message="give 1 to 4096")
        self.refused(*cost, "--concurrency", 5000, message="give 1 to 4096")
        self.refused(*cost, "--concurrency", 8, "--requests", 10 ** 7, message="give 1 to 1000000")

    def test_prompt_files_are_bounded_in_count_and_length(self):
        many = self.path("many.txt")
        with open(many, "w") as f:
            f.write("p%d\n" * 100001 % tuple(range(100001)))
        self.refused("sweep", "--prompt-file", many, message="at most 100000 prompts (got 100001)")
        long = self.path("long.txt")
        with open(long, "w") as f:
            f.write("short\n" + "x" * ((1 << 22) + 1) + "\n")
        self.refused("sweep", "--prompt-file", long, message="prompt 2 has 4194305 characters")

    def test_the_limits_are_in_help(self):
        text = subprocess.run([sys.executable, RUN_PY, "--help"], capture_output=True, text=True).stdout
        self.assertIn("limits (larger is refused):", text)
        self.assertRegex(text, r"batch sizes, --max-batch, --batch, --concurrency +at most 4096")

    def test_malformed_urls_get_a_usage_error_and_a_hint(self):
        for url, message in [
            ("http://[::1", "not a URL the lab can use (Invalid IPv6 URL)"),
            ("http://127.0.0.1:8000/v1/completions",
             "give the server's base URL, not an endpoint: http://127.0.0.1:8000 (the lab adds "
             "/v1/completions itself)"),
            ("http://127.0.0.1:30000/generate", "not an endpoint: http://127.0.0.1:30000"),
            ("http://127.0.0.1:8000 /v1", "the URL has a space in it"),
        ]:
            with self.subTest(url=url):
                r = run_lab("--mode", "sweep", "--url", url)
                self.assertEqual(r.code, 2, r)
                self.assertEqual(len(error_lines(r)), 1, r.stderr)
                self.assertIn(message, r.stderr)

    def test_a_cost_file_of_load_cells_takes_another(self):
        # Load cells have no batch (null): the check of an existing file must know them, or
        # the second cell of an experiment is refused (as it was on a real vLLM).
        save = self.path("cost.json")
        for workload in ("cold", "shared-prefix"):
            with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
                r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--concurrency", 2,
                            "--requests", 2, "--trials", 1, "--warmup", 0, "--max-tokens", 2, "--workload",
                            workload, "--save", save)
            self.assertEqual(r.code, 0, r)
        with open(save) as f:
            self.assertEqual([c["workload"] for c in json.load(f)["cells"]], ["cold", "shared-prefix"])

    def test_a_cost_file_with_malformed_cells_is_refused_before_any_request(self):
        save = self.path("cost.json")
        with open(save, "w") as f:
            json.dump({"schema": run.COST_SCHEMA, "cells": [{"tp": 1, "workload": "cold"}]}, f)
        r = self.refused("cost", "--invariant", "http://127.0.0.1:1", "--save", save,
                         message="holds cost results the lab cannot add to (cell 1: its model is "
                                 "missing or malformed)")
        self.assertNotIn("Traceback", r.stderr)

class KeysHiddenInWhatServersSay(TempDirTest):
    """The key is never printed or saved: in any case, whole or cut, wherever it turns up."""

    def assert_no_key(self, *texts):
        for text in texts:
            self.assertNotIn(KEY[:5].lower(), text.lower())

    def test_a_key_a_plain_text_error_echoes_is_hidden_before_the_body_is_cut(self):
        with StubServer(StubConfig(faults={2: "keyinbody"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                        "--repeat", 1, "--api-key", KEY)
        self.assertEqual(r.code, 3, r)
        self.assertIn("HTTP 401", r.stderr)
        self.assert_no_key(r.stdout, r.stderr)

    def test_a_key_in_the_facts_the_server_reports_is_neither_printed_nor_saved(self):
        model = "org/%s-instruct" % KEY.upper()
        with StubServer(StubConfig(model=model)) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                        "--repeat", 1, "--api-key", KEY, "--save", self.path("s.json"))
            sent = stub.generation_bodies()
        self.assertEqual(r.code, 0, r)
        self.assertEqual(json.loads(sent[0])["model"], model)  # the server still gets its own id
        with open(self.path("s.json")) as f:
            self.assert_no_key(r.stdout, r.stderr, f.read())
        self.assertIn("[api key]", r.stdout)

    def test_a_url_with_a_query_string_is_refused_without_echoing_it(self):
        r = run_lab("--mode", "sweep", "--url", "http://127.0.0.1:8000/v1?api-key=" + KEY)
        self.assertEqual(r.code, 2, r)
        self.assertIn("without a query string or fragment", r.stderr)
        self.assert_no_key(r.stdout, r.stderr)

class MessagesSayWhatHappened(TempDirTest):
    def test_the_clients_own_open_file_limit_is_not_blamed_on_the_server(self):
        def few_files():
            resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))

        with StubServer() as stub:
            p = start_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,64", "--max-tokens", 2,
                          "--repeat", 1, "--traffic", "concurrent", preexec_fn=few_files)
            out, err = finish(p, 60)
        self.assertEqual(p.returncode, 3, err)
        self.assertIn("this machine ran out of open files", err)
        self.assertNotIn("dropped", err)

    def test_a_server_that_answers_like_both_engines_must_be_named(self):
        with StubServer(StubConfig(info_overrides={("model_path",): "m"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", 1)
        self.assertEqual(r.code, 2, r)
        self.assertIn("answers like vLLM and like SGLang at once", r.stderr)

    def test_a_save_through_a_symbolic_link_writes_its_target(self):
        target, link = self.path("target.json"), self.path("link.json")
        os.symlink(target, link)
        with StubServer() as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", 1, "--max-tokens", 2,
                        "--repeat", 1, "--save", link)
        self.assertEqual(r.code, 0, r)
        self.assertTrue(os.path.islink(link))
        self.assertEqual(self.load("target.json")["summary"]["state"], "complete")

    def test_nan_on_both_sides_is_no_run_to_run_control_not_a_failed_one(self):
        with StubServer(StubConfig(faults={1: "nanlogprobs", 3: "nanlogprobs"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                        "--repeat", 2, "--save", self.path("s.json"))
        self.assertIn("no run-to-run control (batch 1's logprobs hold NaN", r.stdout)
        self.assertNotEqual(self.load("s.json")["summary"]["verdict"], run.NOT_REPEATABLE)

    def test_a_run_stopped_in_its_first_pass_says_so(self):
        with StubServer(StubConfig(faults={2: "http500"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                        "--repeat", 3)
        self.assertEqual(r.code, 3, r)
        self.assertIn("no run-to-run control (stopped before a second pass)", r.stdout)

    def test_tpot_of_one_token_requests_says_why_it_is_unmeasured(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--concurrency", 1,
                        "--requests", 1, "--trials", 2, "--warmup", 0, "--max-tokens", 1)
        self.assertEqual(r.code, 0, r)
        self.assertIn("TPOT     unmeasured: time per output token needs at least two tokens", r.stdout)

    def test_a_prefill_nan_is_shown_with_its_note(self):
        with StubServer(StubConfig(faults={2: "nanlogprobs"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", 1, "--max-tokens", 4,
                        "--repeat", 1, "--prefill-check")
        self.assertRegex(r.stdout, r"prefill check: max ULP [0-9]+\*")
        self.assertIn("* %s" % run.ULP_NOTE_TEXT["non-finite"], r.stdout)

    def test_a_cell_without_a_known_tp_is_shown_where_it_was_measured(self):
        with StubServer(StubConfig(dev_mode=False)) as off, \
                StubServer(StubConfig(invariant=True, dev_mode=False)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 1,
                        "--trials", 2, "--warmup", 0, "--max-tokens", 2, "--allow-mismatch",
                        "--save", self.path("c.json"))
        self.assertEqual(r.code, 0, r)
        row = next(line for line in r.stdout.splitlines() if line.strip().startswith("TP=?"))
        self.assertNotIn("missing", row.split()[1])

class Urls(unittest.TestCase):
    def test_as_people_paste_them(self):
        cases = {"http://127.0.0.1:8000/v1": "http://127.0.0.1:8000",
                 "http://127.0.0.1:8000/v1/": "http://127.0.0.1:8000",
                 "http://0.0.0.0:8000": "http://127.0.0.1:8000",
                 "http://[::]:8000/v1": "http://[::1]:8000",
                 "https://gpu.example/llm/v1": "https://gpu.example/llm",
                 "http://localhost:30000/": "http://localhost:30000"}
        for given, wanted in cases.items():
            with self.subTest(url=given):
                self.assertEqual(run.check_url(given, "--url"), wanted)

    def test_a_v1_url_and_the_address_vllm_logs_work(self):
        with StubServer() as stub:
            port = stub.url.rsplit(":", 1)[1]
            for url in ("http://127.0.0.1:%s/v1" % port, "http://0.0.0.0:%s" % port):
                with self.subTest(url=url):
                    r = run_lab("--mode", "sweep", "--url", url, "--sizes", "1,2", "--max-tokens", 4, "--repeat", 1)
                    self.assertEqual(r.code, 0, r)


if __name__ == "__main__":
    unittest.main()
