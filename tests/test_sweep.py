"""--mode sweep against the stub, with expectations derived from the stub's arithmetic alone."""

import json
import os
import unittest

from unittest import mock

from support import StubConfig, StubServer, TempDirTest, expected_sweep, run, run_lab

PROMPT = run.DEFAULT_PROMPT
SIZES = [1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 25, 32]
TOKENS = 64


def sweep(stub, *extra):
    """One pass of copies traffic: today's sweep, whose figures follow from the stub's arithmetic."""
    return run_lab("--mode", "sweep", "--engine", stub.config.engine, "--url", stub.url, "--repeat", 1,
                   "--sizes", ",".join(map(str, SIZES)), "--max-tokens", TOKENS, "--traffic", "copies",
                   *extra)


class AgainstTheStubsArithmetic(TempDirTest):
    def check(self, engine, invariant, temperature=0.0):
        seed = 42 if temperature > 0 else None
        rows, unique = expected_sweep(engine, PROMPT, SIZES, TOKENS, 5, temperature=temperature,
                                      seed=seed, invariant=invariant)
        with StubServer(StubConfig(engine=engine, invariant=invariant, prefix_caching=False)) as stub:
            name = "s-%s-%s-%s.json" % (engine, invariant, temperature)  # a finished sweep is never replaced
            r = sweep(stub, "--temperature", temperature, "--save", self.path(name))
        doc = self.load(name)
        got = {s["batch_size"]: (s["first_token_divergence"], s["max_ulp"]) for s in doc["prompts"][0]["sizes"]}
        self.assertEqual(got, rows, (engine, invariant, temperature))
        self.assertEqual(doc["summary"]["unique_completions"], unique)
        self.assertEqual(doc["summary"]["max_ulp"], max(u for _, u in rows.values()))
        self.assertEqual(doc["summary"]["total_completions"], sum(SIZES))
        return r, doc, rows

    def test_flag_off_reproduces_the_effect_on_both_wire_formats_greedy(self):
        for engine in ("vllm", "sglang"):
            with self.subTest(engine=engine):
                r, doc, rows = self.check(engine, invariant=False)
                self.assertEqual(r.code, 0)
                self.assertGreater(doc["summary"]["unique_completions"], 1)
                self.assertGreater(doc["summary"]["max_ulp"], 0)
                self.assertEqual(doc["summary"]["verdict"], "tokens diverged")
                # some size kept every token while its logprobs moved
                held = [n for n, (div, ulp) in rows.items() if div is None and ulp > 0]
                self.assertTrue(held)
                self.assertIn("tokens diverged", r.stdout)

    def test_flag_off_seeded_sampling(self):
        # vLLM honours the seed with the flag off; SGLang does not (see test_sglang.py).
        r, doc, _ = self.check("vllm", invariant=False, temperature=0.6)
        self.assertGreater(doc["summary"]["max_ulp"], 0)
        self.assertEqual(doc["params"]["seed"], 42)
        self.assertIs(doc["params"]["seed_honoured"], True)

    def test_flag_on_gives_exactly_one_completion_and_zero_ulp(self):
        for engine in ("vllm", "sglang"):
            for temperature in (0.0, 0.6):
                with self.subTest(engine=engine, temperature=temperature):
                    r, doc, _ = self.check(engine, invariant=True, temperature=temperature)
                    self.assertEqual(doc["summary"]["unique_completions"], 1)
                    self.assertEqual(doc["summary"]["max_ulp"], 0)
                    self.assertEqual(doc["summary"]["verdict"], "invariant")

    def test_a_run_where_tokens_hold_and_logprobs_move(self):
        rows, unique = expected_sweep("vllm", PROMPT, [1, 2, 3, 4], TOKENS, 5)
        self.assertEqual(unique, 1)  # the stub's arithmetic: these sizes move only logprobs
        with StubServer(StubConfig(prefix_caching=False)) as stub:
            r = run_lab("--mode", "sweep", "--traffic", "copies", "--url", stub.url, "--sizes", "1,2,3,4", "--max-tokens", TOKENS, "--json")
        doc = r.json()
        self.assertEqual(doc["summary"]["verdict"], "logprobs moved but tokens held")
        self.assertEqual(doc["summary"]["unique_completions"], 1)
        self.assertEqual(doc["summary"]["max_ulp"], max(u for _, u in rows.values()))


class SweepBehaviour(TempDirTest):
    def test_save_schema_and_no_credentials(self):
        with StubServer() as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,17", "--max-tokens", 8,
                        "--api-key", "sekret-key-123", "--save", self.path("s.json"))
            auth = [h.get("Authorization") for _, _, h in stub.requests]
        self.assertEqual(r.code, 0, r)
        self.assertTrue(all(a == "Bearer sekret-key-123" for a in auth), auth)
        with open(self.path("s.json")) as f:
            raw = f.read()
        self.assertNotIn("sekret", raw)
        self.assertNotIn("sekret", r.stdout + r.stderr)
        doc = json.loads(raw)
        self.assertEqual(doc["schema"], "batch-invariance-lab/sweep/2")
        for key in ("engine", "url", "model", "server", "params", "prompts", "summary"):
            self.assertIn(key, doc)
        p = doc["prompts"][0]
        for key in ("prompt", "baseline", "sizes", "unique_completions", "total_completions", "max_ulp"):
            self.assertIn(key, p)
        for key in ("text", "tokens", "logprobs"):
            self.assertIn(key, p["baseline"])
        for key in ("batch_size", "completions", "distinct_in_batch", "same_as_baseline",
                    "first_token_divergence", "first_ulp_step", "max_ulp", "seconds", "runs", "runs_matched"):
            self.assertIn(key, p["sizes"][0])
        for key in ("completions", "distinct_in_batch", "same_as_baseline", "first_token_divergence",
                    "first_ulp_step", "max_ulp", "seconds", "matched", "cached_tokens"):
            self.assertIn(key, p["sizes"][0]["runs"][0])
        for key in ("unique_completions", "total_completions", "max_ulp", "verdict", "state", "traffic",
                    "repeat", "batch1_repeatable"):
            self.assertIn(key, doc["summary"])
        for key in ("traffic", "repeat", "prefix_cache"):
            self.assertIn(key, doc["params"])
        self.assertEqual(doc["model"], "stub/tiny-f32")  # from /v1/models
        self.assertFalse(doc["server"]["flag"])

    def test_api_key_from_the_environment(self):
        with StubServer() as stub:
            env = dict(os.environ, OPENAI_API_KEY="env-key-9")
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1", "--max-tokens", 4, env=env)
            self.assertEqual(r.code, 0, r)
            self.assertTrue(any(h.get("Authorization") == "Bearer env-key-9" for _, _, h in stub.requests))

    def test_expect_exit_codes(self):
        with StubServer(StubConfig(prefix_caching=False)) as off, \
                StubServer(StubConfig(invariant=True, prefix_caching=False)) as on:
            args = ("--mode", "sweep", "--traffic", "copies", "--sizes", "1,17,25", "--max-tokens", 32)
            self.assertEqual(run_lab(*args, "--url", off.url, "--expect", "variant").code, 0)
            r = run_lab(*args, "--url", off.url, "--expect", "invariant")
            self.assertEqual(r.code, 1)
            self.assertIn("expectation failed", r.stdout)
            self.assertEqual(run_lab(*args, "--url", on.url, "--expect", "invariant").code, 0)
            r = run_lab(*args, "--url", on.url, "--expect", "variant")
            self.assertEqual(r.code, 1)
            self.assertIn("longer generations", r.stdout)
            self.assertEqual(run_lab(*args, "--url", on.url, "--expect", "variant", "--json").code, 1)

    def test_baseline_round_trip(self):
        with StubServer(StubConfig(invariant=True)) as on:
            r = run_lab("--mode", "sweep", "--traffic", "copies", "--url", on.url, "--sizes", "1,9", "--max-tokens", 32,
                        "--save", self.path("week1.json"))
            self.assertEqual(r.code, 0)
            # the same server next week: batch 1 and batch 9 both match last week's batch 1
            r = run_lab("--mode", "sweep", "--traffic", "copies", "--url", on.url, "--sizes", "1,9", "--max-tokens", 32,
                        "--baseline", self.path("week1.json"), "--expect", "invariant", "--json")
            self.assertEqual(r.code, 0, r)
            self.assertEqual(r.json()["prompts"][0]["baseline_source"], self.path("week1.json"))
        with StubServer() as off:
            # a flag-off server checked against the flag-on baseline: batch 1 still agrees (same
            # plan), batch 9 does not
            rows, unique = expected_sweep("vllm", PROMPT, [1, 9], 32, 5)
            r = run_lab("--mode", "sweep", "--traffic", "copies", "--url", off.url, "--sizes", "1,9", "--max-tokens", 32,
                        "--baseline", self.path("week1.json"), "--json")
            doc = r.json()
            got = {s["batch_size"]: (s["first_token_divergence"], s["max_ulp"]) for s in doc["prompts"][0]["sizes"]}
            self.assertEqual(got, rows)

    def test_baseline_for_another_model_prompt_or_sampling_is_refused(self):
        # another engine is not refused: comparing across engines is what a file is for
        # (test_baseline_travels)
        with StubServer(StubConfig(invariant=True)) as on:
            run_lab("--mode", "sweep", "--url", on.url, "--sizes", "1", "--max-tokens", 8,
                    "--save", self.path("b.json"))
            cases = [(("--prompt", "another prompt"), "no baseline for the prompt"),
                     (("--model", "other/model"), "recorded for model"),
                     (("--temperature", "0.5"), "temperature")]
            for extra, message in cases:
                with self.subTest(args=extra):
                    r = run_lab("--mode", "sweep", "--url", on.url, "--sizes", "1", "--max-tokens", 8,
                                "--baseline", self.path("b.json"), *extra)
                    self.assertEqual(r.code, 2)
                    self.assertIn(message, r.stderr)
                    self.assertEqual(len(r.stderr.strip().splitlines()), 1)
        with StubServer(StubConfig(invariant=True, model="other/served")) as other:
            r = run_lab("--mode", "sweep", "--url", other.url, "--sizes", "1", "--max-tokens", 8,
                        "--baseline", self.path("b.json"))
            self.assertEqual(r.code, 2)
            self.assertIn("this server serves other/served", r.stderr)
            self.assertFalse([p for m, p, _ in other.requests if m == "POST"])

    def test_several_prompts_each_get_their_own_sweep(self):
        with open(self.path("prompts.txt"), "w") as f:
            f.write("first prompt about sums\n\nsecond prompt about tiles\n")
        with StubServer() as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,17", "--max-tokens", 16,
                        "--prompt", "zeroth prompt", "--prompt-file", self.path("prompts.txt"), "--json")
        doc = r.json()
        self.assertEqual([p["prompt"] for p in doc["prompts"]],
                         ["zeroth prompt", "first prompt about sums", "second prompt about tiles"])
        self.assertEqual(doc["summary"]["unique_completions"], max(p["unique_completions"] for p in doc["prompts"]))

    def test_table_shows_buckets_and_none_above_the_largest_graph(self):
        with StubServer(StubConfig(engine="sglang")) as stub:
            r = run_lab("--mode", "sweep", "--engine", "sglang", "--url", stub.url,
                        "--sizes", "1,15,16,17,23,24,25,33", "--max-tokens", 8)
        self.assertEqual(r.code, 0, r)
        rows = {int(line.split()[0]): line.split()[1] for line in r.stdout.splitlines()
                if line.strip() and line.split()[0].isdigit()}
        self.assertEqual(rows, {1: "1", 15: "16", 16: "16", 17: "24", 23: "24", 24: "24", 25: "32", 33: "none"})
        self.assertIn("graph sizes 1,2,4,8,12,16,24,32", r.stdout)

    def test_default_ladder_follows_the_servers_graph_sizes(self):
        with StubServer(StubConfig(graph_sizes=[1, 2, 4, 8, 16])) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--max-batch", 12, "--max-tokens", 4, "--json")
        self.assertEqual(r.json()["params"]["sizes"], [1, 2, 3, 4, 5, 7, 8, 9])

    def test_one_request_larger_than_the_server_batches_together_is_refused(self):
        with StubServer(StubConfig(max_num_seqs=4)) as stub:
            r = run_lab("--mode", "sweep", "--traffic", "copies", "--url", stub.url, "--sizes", "1,8", "--max-tokens", 4)
            sent = stub.generation_bodies()
        self.assertEqual(r.code, 2, r)
        self.assertIn("the server runs at most 4 requests at once", r.stderr)
        self.assertEqual(sent, [])

    def test_flag_state_unknown_without_dev_mode(self):
        with StubServer(StubConfig(dev_mode=False)) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4)
        self.assertEqual(r.code, 0)
        self.assertIn("VLLM_SERVER_DEV_MODE=1", r.stderr)
        self.assertIn("flag unknown", r.stdout)

    def test_flag_on_divergence_prints_the_coverage_checklist(self):
        with StubServer(StubConfig(invariant=True, coverage_gap=True, prefix_caching=False)) as stub:
            r = run_lab("--mode", "sweep", "--traffic", "copies", "--url", stub.url, "--sizes", "1,17,25", "--max-tokens", 32)
        self.assertIn("reports the flag ON, yet results moved", r.stdout)
        self.assertIn("fused-MoE", r.stdout)
        self.assertLess(r.stdout.index("fused-MoE"), r.stdout.index("bug report"))

    def test_model_not_served_is_refused_before_generating(self):
        with StubServer() as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--model", "nope", "--sizes", "1")
            self.assertEqual(r.code, 2)
            self.assertIn("serves: stub/tiny-f32", r.stderr)
            self.assertFalse([p for m, p, _ in stub.requests if m == "POST"])

    def test_values_that_are_not_float32_are_measured_in_float64(self):
        with StubServer(StubConfig(float64=True)) as stub:
            r = run_lab("--mode", "sweep", "--traffic", "copies", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 16, "--json")
        doc = r.json()
        self.assertIn("float64", doc["summary"]["ulp_notes"])
        self.assertGreater(doc["summary"]["max_ulp"], 0)

    def test_clamped_logprob_is_reported(self):
        with StubServer(StubConfig(invariant=True, faults={2: "clamp"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 8)
        self.assertEqual(r.code, 0, r)
        self.assertIn("clamped -inf", r.stdout)
        self.assertIn("logprobs moved but tokens held", r.stdout)


class CopiesInTwoRuns(unittest.TestCase):
    def test_a_sweep_compares_each_run_of_copies_and_finds_what_a_plain_decode_finds(self):
        compared = []
        real = run.compare_completions
        with StubServer(StubConfig(copies_split=3)) as stub, \
                mock.patch.object(run, "compare_completions",
                                  lambda *a: (compared.append(a[1]), real(*a))[1]):
            r = run_lab("--mode", "sweep", "--traffic", "copies", "--url", stub.url, "--sizes", "1,8", "--max-tokens", 16,
                        "--repeat", 1, "--json")
            self.assertEqual(r.code, 0, r)
            client = run.HttpClient(stub.url, None, 10, 1 << 20)
            bodies = [json.loads(b) for b in stub.generation_bodies()]
            plain = [run.VllmAdapter().completions(client.request("/v1/completions", b), len(b["prompt"]), True)
                     for b in bodies]
        row = {s["batch_size"]: s for s in json.loads(r.stdout)["prompts"][0]["sizes"]}[8]
        base, batch = plain[0][0], plain[1]
        self.assertEqual(row["max_ulp"], max(real(base, c).max_ulp for c in batch))
        self.assertGreater(row["max_ulp"], 0)
        self.assertEqual(len(compared), 1 + 2)  # batch 1, then each run of batch 8 once


if __name__ == "__main__":
    unittest.main()
