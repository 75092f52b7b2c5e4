# SPDX-License-Identifier: Apache-2.0
"""Servers that fail or lie: every HTTP error, dropped connection, malformed or hostile answer
ends the run with one line naming what happened and where (exit 3), with everything measured
before it saved; a fuzz test feeds randomly damaged answers through whole sweeps."""

import json
import math
import os
import random
import resource
import socket
import unittest
from unittest import mock

from stub_server import (BadRequest, EngineState, models_list, sglang_generate, sglang_server_info, vllm_completions, vllm_server_info)
from support import (StubConfig, StubServer, TempDirTest, finish, free_port, run, run_lab,
                     sent_batch, start_lab)


SIZES = "1,2,4,8"   # the fault is injected at the 3rd generation request: batch size 4
FUZZ_RUNS = 300  # sweeps against randomly damaged answers (about 5 s)


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
                r = run_lab("--mode", "sweep", "--traffic", "copies", "--engine", engine, "--url", "http://127.0.0.1:9", "--sizes", "1,2",
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
                r = run_lab("--mode", "sweep", "--traffic", "copies", "--url", stub.url, "--sizes", "1,2,4", "--max-tokens", 4, "--repeat", 1,
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


class ServerFaultsInASweep(TempDirTest):
    def sweep_with_fault(self, fault, engine="vllm", *extra):
        with StubServer(StubConfig(engine=engine, faults={3: fault})) as stub:
            r = run_lab("--mode", "sweep", "--engine", engine, "--url", stub.url, "--sizes", SIZES,
                        "--max-tokens", 8, "--save", self.path("s.json"), "--traffic", "copies",
                        *extra)  # copies: the fault's answer is one request's
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
        # a limit the server does not state (no /server_info): found by its answer
        with StubServer(StubConfig(max_logprobs=3, dev_mode=False)) as stub:
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
                    run.compare_batch(sent_batch(comps), base, adapter.logprob_clamps)


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
        self.assertEqual(r.code, 0, r)  # the check stops, the sweep goes on
        self.assertIn("the prefill check stops at batch size 1, the sweep goes on: the prefill "
                      "check needs token ids, and the server's tokens are not ids", r.stderr)
        self.assertNotIn("Traceback", r.stderr)


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

    def test_a_run_stopped_in_a_later_pass_counts_the_batch_1_runs_it_compared(self):
        # the 5th request is pass 3's batch 1: two batch-1 runs came back, not three
        with StubServer(StubConfig(faults={5: "http500"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                        "--traffic", "copies", "--repeat", 3)
        self.assertEqual(r.code, 3, r)
        self.assertIn("batch 1 repeatable over 2 passes:", r.stdout)
        self.assertNotIn("over 3 passes", r.stdout)

    def test_a_batch_1_the_cache_served_in_every_pass_is_no_control_and_says_why(self):
        config = StubConfig(invariant=True, prompt_tokens_details=True, cache_serves="all")
        with StubServer(config) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                        "--repeat", 2)
        self.assertEqual(r.code, 0, r)
        self.assertIn("no run-to-run control (the cache served batch 1 in every pass)", r.stdout)
        self.assertNotIn("stopped before a second pass", r.stdout)

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


class ServerTextOnOneLine(unittest.TestCase):
    def test_escape_sequences_and_line_breaks_are_written_as_escapes(self):
        body = json.dumps({"error": {"message": "bad\n\x1b[31mrun.py: expect invariant: held"}}).encode()
        message = run.server_message(body)
        self.assertNotIn("\n", message)
        self.assertNotIn("\x1b", message)
        self.assertIn("\\x1b[31m", message)
        self.assertEqual(run.plain_scalar("model\rX"), "model\\rX")


if __name__ == "__main__":
    unittest.main()
