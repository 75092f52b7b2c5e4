"""Faults and bad input: one clear line, the right exit code, and nothing measured lost.

Each test here backs one row of the README's reliability table."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import unittest
from unittest import mock

from stub_server import EngineState, sglang_generate, vllm_completions
from support import ROOT, StubConfig, StubServer, TempDirTest, free_port, run, run_lab, wait_for

SIZES = "1,2,4,8"   # the fault is injected at the 3rd generation request: batch size 4




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


class ServerFaultsInCost(TempDirTest):
    def test_trial_failure_keeps_the_trials_before_it(self):
        # generation requests per arm: 1 warm-up, then trials; the 4th on the flag-on arm is trial 3
        with StubServer() as off, StubServer(StubConfig(invariant=True, faults={4: "http500"})) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 2,
                        "--trials", 6, "--warmup", 1, "--max-tokens", 4, "--save", self.path("c.json"))
        self.assertEqual(r.code, 3, r)
        self.assertIn("cost stopped at trial 3, on arm: HTTP 500", r.stderr)
        cell = self.load("c.json")["cells"][0]
        self.assertEqual(cell["trials"], 2)
        self.assertEqual(cell["state"], "stopped: server error")
        self.assertEqual(len(cell["off"]["samples_s"]), 3)  # trial 3's flag-off sample is kept too
        self.assertEqual(len(cell["on"]["samples_s"]), 2)

    def test_a_failed_run_does_not_replace_a_finished_cell(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            args = ("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 2,
                    "--trials", 3, "--warmup", 0, "--max-tokens", 4, "--save", self.path("c.json"))
            self.assertEqual(run_lab(*args).code, 0)
        with StubServer() as off, StubServer(StubConfig(invariant=True, faults={2: "drop"})) as on:
            args = ("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 2,
                    "--trials", 3, "--warmup", 0, "--max-tokens", 4, "--save", self.path("c.json"))
            self.assertEqual(run_lab(*args).code, 3)
        doc = self.load("c.json")
        self.assertEqual([c["state"] for c in doc["cells"]], ["complete"])
        self.assertEqual([c["trials"] for c in doc["incomplete_cells"]], [1])

    def test_warm_up_is_retried_once_and_says_so(self):
        with StubServer(StubConfig(faults={1: "http500"})) as off, StubServer(StubConfig(invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 2,
                        "--trials", 2, "--warmup", 1, "--max-tokens", 4)
        self.assertEqual(r.code, 0, r)
        self.assertIn("retrying once, as only warm-up may", r.stderr)

    def test_unreachable_arm(self):
        with StubServer() as off:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant",
                        "http://127.0.0.1:%d" % free_port())
        self.assertEqual(r.code, 3)
        self.assertIn("flag-on arm (--invariant)", r.stderr)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1)


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


if __name__ == "__main__":
    unittest.main()
