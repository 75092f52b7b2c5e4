"""--prefill-check: do the logprobs a server reports while generating equal the ones it
computes when prompt + completion is read back as one token-id prompt? And how near a tie
was the first step where they differ?"""

import json
import math
import stub_server
import unittest
from unittest import mock

from support import (PROMPT, StubConfig, StubServer, TempDirTest, run, run_lab, short_sweep,
                     stub_completion, ulps32)


PROMPT = run.DEFAULT_PROMPT
SIZES = [1, 2, 9, 17]
TOKENS = 24


def sweep(stub, *extra):
    # copies in one request: each size one batch of the stub's, whose prefill it computes
    # (its prefix cache off: copies of one request share it, and a decode the cache served
    # is not compared)
    return run_lab("--mode", "sweep", "--engine", stub.config.engine, "--url", stub.url, "--sizes",
                   ",".join(map(str, SIZES)), "--max-tokens", TOKENS, "--repeat", 1, "--prefill-check", "--json",
                   "--traffic", "copies", *extra)


def expected_prefill(engine, n, invariant):
    """(max ULP, first differing step) between the stub's decode at batch n and its own prefill
    arithmetic, computed here from the stub's functions, not from run.py."""
    ids, decode, _, _ = stub_completion(engine, PROMPT, n, TOKENS, 5, invariant=invariant)
    prefill = stub_server.prefill_logprobs(PROMPT, ids, stub_server.PREFILL_PLAN)
    distances = [ulps32(a, b) for a, b in zip(decode, prefill)]
    return max(distances), next((i for i, d in enumerate(distances) if d), None)


def expected_kl(engine, invariant):
    """(divergent tokens, mean and largest K3 term) of a flag-on sweep, whose completions are
    all batch 1's: computed from the stub's own arithmetic with the K3 formula written here."""
    ids, decode, _, _ = stub_completion(engine, PROMPT, 1, TOKENS, 5, invariant=invariant)
    prefill = stub_server.prefill_logprobs(PROMPT, ids, stub_server.PREFILL_PLAN)
    terms = [math.exp(p - d) - 1.0 - (p - d) for d, p in zip(decode, prefill) if d != p]
    return len(terms), sum(terms) / len(terms), max(terms)


class DecodeVersusPrefill(TempDirTest):
    def test_the_kl_estimate_of_the_divergent_tokens(self):
        for engine in ("vllm", "sglang"):
            config = StubConfig(engine=engine, invariant=True, prefix_caching=False)
            with self.subTest(engine=engine), StubServer(config) as stub:
                r = sweep(stub)
            self.assertEqual(r.code, 0, r)
            sm = r.json()["summary"]
            divergent, mean, largest = expected_kl(engine, True)
            self.assertGreater(divergent, 0)
            # every size's completion is batch 1's, so each distinct one is checked once a size
            self.assertEqual(sm["prefill_divergent"], divergent * len(SIZES))
            self.assertAlmostEqual(sm["prefill_kl_mean"], mean, delta=1e-12 + 1e-9 * mean)
            self.assertAlmostEqual(sm["prefill_kl_max"], largest, delta=1e-12 + 1e-9 * largest)
            self.assertEqual(sm["prefill_tokens"], TOKENS * len(SIZES))


    def test_with_the_agreement_switch_they_agree_bitwise(self):
        for engine in ("vllm", "sglang"):
            with self.subTest(engine=engine):
                with StubServer(StubConfig(engine=engine, invariant=True, prefill_agrees=True,
                                           prefix_caching=False)) as stub:
                    r = sweep(stub, "--expect", "prefill-equal")
                self.assertEqual(r.code, 0, r)
                sm = r.json()["summary"]
                self.assertEqual((sm["prefill_max_ulp"], sm["prefill_first_step"], sm["prefill_verdict"]),
                                 (0, None, "decode and prefill agree bitwise"))

    def test_without_it_the_distances_are_the_engines_own(self):
        for engine in ("vllm", "sglang"):
            for invariant in (True, False):
                with self.subTest(engine=engine, invariant=invariant):
                    with StubServer(StubConfig(engine=engine, invariant=invariant,
                                               prefix_caching=False)) as stub:
                        r = sweep(stub)
                    self.assertEqual(r.code, 0, r)
                    doc = r.json()
                    got = {s["batch_size"]: (s["prefill_max_ulp"], s["prefill_first_step"])
                           for s in doc["prompts"][0]["sizes"]}
                    wanted = {n: expected_prefill(engine, n, invariant) for n in SIZES}
                    self.assertEqual(got, wanted)
                    self.assertGreater(max(u for u, _ in wanted.values()), 0)
                    self.assertEqual(doc["summary"]["prefill_verdict"], "decode and prefill differ")
                    self.assertEqual(doc["summary"]["prefill_max_ulp"], max(u for u, _ in wanted.values()))

    def test_expect_prefill_equal_fails_when_they_differ(self):
        with StubServer(StubConfig(invariant=True, prefix_caching=False)) as stub:
            r = sweep(stub, "--expect", "prefill-equal")
        self.assertEqual(r.code, 1, r)
        self.assertIn("--expect prefill-equal", r.stderr)

    def test_the_table_keeps_the_prefill_verdict_apart(self):
        with StubServer(StubConfig(invariant=True, prefill_agrees=True, prefix_caching=False)) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 8, "--repeat", 1,
                        "--prefill-check")
        self.assertIn("summary: unique completions 1", r.stdout)
        self.assertIn("prefill check: max ULP 0, first differing step -: decode and prefill agree bitwise", r.stdout)

    def test_one_prefill_per_distinct_sequence(self):
        with StubServer(StubConfig(invariant=True, prefix_caching=False)) as stub:
            sweep(stub)
            bodies = [json.loads(b) for b in stub.generation_bodies()]
        token_prompts = [b for b in bodies if isinstance(b["prompt"], list) and isinstance(b["prompt"][0], int)]
        self.assertEqual(len(token_prompts), 1)  # flag on: one sequence at every size


class RequestBodies(unittest.TestCase):
    """The prefill requests, as pinned from the engines' source (see the README's table)."""

    def capture(self, engine, answer):
        sent = []

        def request(client, path, body=None, as_text=False):
            sent.append((path, body))
            return answer(path, body)

        with mock.patch.object(run.HttpClient, "request", request):
            client = run.HttpClient("http://127.0.0.1:9", None, 5, 1 << 20)
            # through the Sender, which sends every generation request the check makes
            sender = run.Sender(client, run.ADAPTERS[engine], "m",
                                run.Sampling.of(0.0, 8, 5, 42), False)
            ids = sender.prompt_ids("Tell me")
            values = sender.prefill(ids + [7, 9], len(ids))[1]
        return sent, ids, values

    def test_vllm(self):
        def answer(path, body):
            if path == "/tokenize":
                return {"count": 2, "max_model_len": 4096, "tokens": [52, 69], "token_strs": None}
            return {"choices": [{"index": 0, "text": "x", "prompt_logprobs": [
                None, {"69": {"logprob": -7.5, "rank": 3, "decoded_token": "e"}},
                {"7": {"logprob": -1.25, "rank": 1, "decoded_token": "a"}},
                {"9": {"logprob": -2.5, "rank": 1, "decoded_token": "b"}, "4": {"logprob": -0.5, "rank": 2}}]}]}

        sent, ids, values = self.capture("vllm", answer)
        self.assertEqual(sent, [("/tokenize", {"model": "m", "prompt": "Tell me"}),
                                ("/v1/completions", {"model": "m", "prompt": [52, 69, 7, 9], "max_tokens": 1,
                                                     "temperature": 0.0, "prompt_logprobs": 0})])
        self.assertEqual((ids, values), ([52, 69], [-1.25, -2.5]))

    def test_sglang(self):
        def answer(path, body):
            if "text" in body:
                return {"text": "", "meta_info": {"input_token_logprobs": [[None, 52, None], [-7.5, 69, None]]}}
            return {"text": "", "meta_info": {"input_token_logprobs": [[None, 69, None], [-1.25, 7, None],
                                                                       [-2.5, 9, None]]}}

        sent, ids, values = self.capture("sglang", answer)
        params = {"max_new_tokens": 1, "temperature": 0.0}
        self.assertEqual(sent, [
            ("/generate", {"text": "Tell me", "sampling_params": params, "return_logprob": True,
                           "logprob_start_len": 0, "stream": False}),
            ("/generate", {"input_ids": [52, 69, 7, 9], "sampling_params": params, "return_logprob": True,
                           "logprob_start_len": 1, "stream": False})])
        self.assertEqual((ids, values), ([52, 69], [-1.25, -2.5]))


class Missing(unittest.TestCase):
    def test_a_server_that_cannot_serve_the_check_stops_the_check_not_the_sweep(self):
        with StubServer(StubConfig(prefix_caching=False, prompt_logprobs=False)) as stub:
            r = sweep(stub)
            expected = run_lab("--mode", "sweep", "--traffic", "copies", "--url", stub.url, "--sizes", "1,2,9,17",
                               "--max-tokens", 24, "--repeat", 1, "--prefill-check",
                               "--expect", "prefill-equal")
        self.assertEqual(r.code, 0, r)
        lines = [x for x in r.stderr.splitlines() if not x.startswith(("run.py: progress", "run.py: saved"))]
        self.assertEqual(len(lines), 1, r.stderr)
        self.assertIn("the prefill check stops at batch size 1, the sweep goes on", lines[0])
        self.assertIn("no prompt_logprobs", lines[0])
        summary = r.json()["summary"]
        self.assertEqual((summary["state"], summary["total_completions"]), ("complete", 29))
        self.assertTrue(summary["prefill_verdict"].startswith("not measured: the server could not serve it"))
        self.assertEqual(expected.code, 1, expected)  # nothing was measured: the expectation fails

    def test_expect_prefill_equal_needs_the_check(self):
        r = run_lab("--mode", "sweep", "--url", "http://127.0.0.1:9", "--expect", "prefill-equal")
        self.assertEqual(r.code, 2)
        self.assertIn("needs --prefill-check", r.stderr)


class ServedDecodes(unittest.TestCase):
    """A decode whose prompt the prefix cache served compares the cache, not decode with
    prefill: it is not compared, whether the answer counts the hit or only the server's
    counters do."""

    def test_a_decode_the_cache_served_is_not_compared(self):
        for counted in (True, False):
            config = StubConfig(invariant=True, prefill_agrees=True, cache_serves="all",
                                cache_path_differs=True, uncounted_cache_hits=not counted)
            with self.subTest(counted=counted), StubServer(config) as stub:
                r = short_sweep(stub, "--sizes", "1,2", "--prefill-check", "--json",
                                "--traffic", "concurrent", "--expect", "prefill-equal")
            sm = r.json()["summary"]
            # had the served decodes been compared, the cache path's difference would read
            # "decode and prefill differ"
            self.assertEqual(sm["prefill_verdict"],
                             "nothing compared: the cache served, or may have served, 3 completions: not "
                             "compared")
            self.assertEqual((sm["prefill_tokens"], sm["prefill_served"]), (0, 3))
            self.assertEqual(r.code, 1, r)  # nothing compared holds no --expect
            # the table: no size shows a max ULP where none of its tokens was compared
            with StubServer(config) as stub:
                table = short_sweep(stub, "--sizes", "1,2", "--prefill-check", "--traffic",
                                    "concurrent").stdout
            self.assertIn("prefill check, max ULP per batch size: 1: -, 2: -", table)

    def test_some_served_some_compared(self):
        # SGLang counts each copy's own hits: the copies from the middle on were served
        config = StubConfig(engine="sglang", invariant=True, prefill_agrees=True,
                            cache_serves="some", cache_path_differs=True)
        with StubServer(config) as stub:
            r = short_sweep(stub, "--sizes", "1,4", "--prefill-check", "--json")
        sm = r.json()["summary"]
        self.assertEqual(sm["prefill_verdict"].split(";")[0],
                         "decode and prefill agree bitwise where compared")
        self.assertIn("not compared", sm["prefill_verdict"])
        self.assertGreater(sm["prefill_tokens"], 0)


class PrefillMargin(unittest.TestCase):
    def test_the_decodes_runner_up_margin_at_the_first_differing_step(self):
        # Flag on, every completion is batch 1's; its prefill reduces in another order.
        with StubServer(StubConfig(invariant=True, prefix_caching=False)) as stub:
            doc = short_sweep(stub, "--sizes", "1,2", "--prefill-check", "--json").json()
        sm = doc["summary"]
        self.assertEqual(sm["prefill_verdict"], "decode and prefill differ")
        step = sm["prefill_first_step"]
        ids, _, tops, _ = stub_completion("vllm", PROMPT, 1, 24, 5, invariant=True)
        top = tops[step]
        runner_up = max(v for t, v in top.items() if t != ids[step])
        self.assertEqual(sm["prefill_margin"]["ulp"], ulps32(top[ids[step]], runner_up))
        self.assertGreater(sm["prefill_tokens"], 0)


if __name__ == "__main__":
    unittest.main()
