"""Every verdict backed by what was measured: nothing claimed without a comparison, top-k
membership part of the comparison, the prefix-cache bypass proven or called unverified, text
differences named as such, and the near-tie margin at every first divergence, checked
against the practice engine's own arithmetic."""

import copy
import json
import unittest

from support import StubConfig, StubServer, TempDirTest, run_lab, stub_completion, ulps32

PROMPT = "Explain, step by step, why adding the same floating-point numbers in a different order can give a different answer:"


def sweep(stub, *extra):
    return run_lab("--mode", "sweep", "--engine", stub.config.engine, "--url", stub.url, "--repeat", 1,
                   "--max-tokens", 24, *extra)


def sizes_of(doc):
    return {s["batch_size"]: s for s in doc["prompts"][0]["sizes"]}


class NothingCompared(TempDirTest):
    def test_a_sweep_stopped_after_batch_1_claims_nothing(self):
        for engine in ("vllm", "sglang"):
            with self.subTest(engine=engine), StubServer(StubConfig(engine=engine, invariant=True,
                                                                    faults={2: "http500"})) as stub:
                r = sweep(stub, "--sizes", "1,2,4", "--expect", "invariant", "--save", self.path(engine + ".json"))
                self.assertEqual(r.code, 3, r)
                doc = self.load(engine + ".json")
                self.assertEqual(doc["summary"]["verdict"], "nothing compared")
                self.assertEqual(doc["prompts"][0]["verdict"], "nothing compared")
                self.assertIn(": nothing compared (stopped: server error)", r.stdout)
                self.assertNotIn("invariant", r.stdout.split("summary:")[1])

    def test_both_expectations_fail_on_it(self):
        for expect in ("invariant", "variant"):
            with self.subTest(expect=expect), StubServer(StubConfig(invariant=expect == "invariant")) as stub:
                r = sweep(stub, "--sizes", "1", "--expect", expect)
                self.assertEqual(r.code, 1, r)
                self.assertIn("expectation failed: --expect %s" % expect, r.stdout)

    def test_a_stored_baseline_makes_batch_1_a_comparison(self):
        with StubServer(StubConfig(invariant=True)) as stub:
            self.assertEqual(sweep(stub, "--sizes", "1,2", "--save", self.path("base.json")).code, 0)
            r = sweep(stub, "--sizes", "1", "--baseline", self.path("base.json"), "--expect", "invariant", "--json")
        self.assertEqual(r.code, 0, r)
        self.assertEqual(r.json()["summary"]["verdict"], "invariant")


class TopKMembership(unittest.TestCase):
    def test_a_top_k_set_that_changes_with_the_batch_is_a_move(self):
        for engine in ("vllm", "sglang"):
            with self.subTest(engine=engine), StubServer(StubConfig(engine=engine, invariant=True,
                                                                    topk_edge_swap=True)) as stub:
                r = sweep(stub, "--sizes", "1,2", "--expect", "invariant", "--json")
            self.assertEqual(r.code, 1, r)
            doc = r.json()
            size2 = sizes_of(doc)[2]
            self.assertEqual(size2["max_ulp"], 0)  # every shared value is equal ...
            self.assertIn("top-k changed", size2["ulp_notes"])  # ... but the set is not
            self.assertEqual(size2["first_ulp_step"], 0)
            self.assertEqual(size2["runs_matched"], 0)
            self.assertEqual(doc["summary"]["verdict"], "logprobs moved but tokens held")

    def test_the_same_server_without_the_swap_is_invariant(self):
        with StubServer(StubConfig(invariant=True)) as stub:
            r = sweep(stub, "--sizes", "1,2", "--expect", "invariant", "--json")
        self.assertEqual(r.code, 0, r)
        self.assertNotIn("top-k changed", r.json()["summary"]["ulp_notes"])


class PrefixCacheBypass(unittest.TestCase):
    def test_copies_in_one_vllm_request_share_the_cache_and_the_lab_says_so(self):
        # As on real vLLM 0.26.0: one cache_salt covers every copy of one request, and the
        # copies hit each other's prefix (the usage counts the last prompt's cached tokens).
        with StubServer(StubConfig(prompt_tokens_details=True)) as stub:
            r = sweep(stub, "--sizes", "1,2,4")
        self.assertEqual(r.code, 0, r)
        self.assertIn("cache hit: bypass did not hold at batch sizes 2,4", r.stdout)
        row4 = next(line for line in r.stdout.splitlines() if line.split()[:1] == ["4"])
        self.assertIn("cache hit: bypass did not hold", row4)
        with StubServer(StubConfig(prompt_tokens_details=True)) as stub:
            doc = sweep(stub, "--sizes", "1,2,4", "--json").json()
        self.assertEqual(doc["summary"]["prefix_cache_bypass"], {"status": "did not hold", "hit_sizes": [2, 4]})
        self.assertEqual(sizes_of(doc)[1]["cached_tokens"], 0)
        self.assertGreater(sizes_of(doc)[2]["cached_tokens"], 0)

    def test_concurrent_vllm_requests_each_get_a_salt_and_hold(self):
        with StubServer(StubConfig(prompt_tokens_details=True)) as stub:
            doc = sweep(stub, "--sizes", "1,2,4", "--traffic", "concurrent", "--json").json()
        self.assertEqual(doc["summary"]["prefix_cache_bypass"]["status"], "held")

    def test_sglang_copies_each_get_a_cache_key_and_hold(self):
        with StubServer(StubConfig(engine="sglang")) as stub:
            r = sweep(stub, "--sizes", "1,2,4", "--json")
            keys = [json.loads(b).get("extra_key") for b in stub.generation_bodies()]
        self.assertEqual(r.json()["summary"]["prefix_cache_bypass"], {"status": "held", "hit_sizes": []})
        self.assertEqual([len(set(k)) for k in keys], [1, 2, 4])  # a fresh key for every prompt

    def test_a_server_that_reports_no_counts_leaves_the_bypass_unverified(self):
        with StubServer(StubConfig()) as stub:  # vLLM without --enable-prompt-tokens-details
            r = sweep(stub, "--sizes", "1,2")
        self.assertEqual(r.code, 0, r)
        self.assertIn("prefix cache bypass unverified: the server reports no cached-token counts "
                      "(start vLLM with --enable-prompt-tokens-details", r.stdout)

    def test_keep_makes_no_claim(self):
        with StubServer(StubConfig(prompt_tokens_details=True)) as stub:
            doc = sweep(stub, "--sizes", "1,2", "--prefix-cache", "keep", "--json").json()
        self.assertIsNone(doc["summary"]["prefix_cache_bypass"])


class TextOnly(unittest.TestCase):
    def test_text_that_differs_with_equal_tokens_is_named_so(self):
        with StubServer(StubConfig(invariant=True, faults={2: "textonly"})) as stub:
            r = sweep(stub, "--sizes", "1,2", "--expect", "invariant", "--json")
        self.assertEqual(r.code, 1, r)
        doc = r.json()
        self.assertEqual(doc["summary"]["verdict"], "text differs, tokens equal")
        self.assertEqual(sizes_of(doc)[2]["text_only"], 1)
        self.assertIsNone(sizes_of(doc)[2]["first_token_divergence"])

    def test_expect_variant_does_not_pass_on_it(self):
        with StubServer(StubConfig(invariant=True, faults={2: "textonly"})) as stub:
            r = sweep(stub, "--sizes", "1,2", "--expect", "variant")
        self.assertEqual(r.code, 1, r)
        self.assertIn("text differs, tokens equal (1)", r.stdout)


class NearTieMargin(unittest.TestCase):
    """The margin the lab reports equals the one computed from the stub's own arithmetic."""

    def expected(self, engine, n, k=5, tokens=24):
        base = stub_completion(engine, PROMPT, 1, tokens, k)
        other = stub_completion(engine, PROMPT, n, tokens, k)
        ids_a, _, tops_a, _ = base
        ids_b = other[0]
        step = next((t for t in range(min(len(ids_a), len(ids_b))) if ids_a[t] != ids_b[t]), None)
        if step is None:
            return None
        top = tops_a[step]
        if ids_b[step] not in top:
            return {"note": "not in top-k"}
        a, b = top[ids_a[step]], top[ids_b[step]]
        return {"ulp": ulps32(a, b), "logprob": a - b}

    def test_the_margin_at_each_first_divergence(self):
        sizes = (1, 2, 5, 9, 17, 25)
        for engine in ("vllm", "sglang"):
            with StubServer(StubConfig(engine=engine)) as stub:
                doc = sweep(stub, "--sizes", ",".join(map(str, sizes)), "--json").json()
            seen = 0
            for n, size in sizes_of(doc).items():
                with self.subTest(engine=engine, n=n):
                    want = self.expected(engine, n)
                    got = size["divergence_margin"]
                    if want is None:
                        self.assertIsNone(got)
                        continue
                    seen += 1
                    if "note" in want:
                        self.assertEqual(got["note"], want["note"])
                    else:
                        self.assertEqual(got["ulp"], want["ulp"])
                        self.assertAlmostEqual(got["logprob"], want["logprob"], places=12)
                        self.assertGreaterEqual(got["logprob"], 0.0)  # greedy chose the larger
            self.assertGreater(seen, 0, "no size diverged: the test compared nothing")

    def test_the_table_shows_it(self):
        with StubServer(StubConfig()) as stub:
            r = sweep(stub, "--sizes", "1,9")
        row9 = next(line for line in r.stdout.splitlines() if line.split()[:1] == ["9"])
        want = self.expected("vllm", 9)
        self.assertIsNotNone(want)
        self.assertIn("%d ULP" % want["ulp"] if "ulp" in want else want["note"], row9)


class MalformedBaselines(TempDirTest):
    def test_each_malformed_field_is_refused_before_any_request(self):
        with StubServer(StubConfig()) as stub:
            self.assertEqual(sweep(stub, "--sizes", "1,2", "--save", self.path("good.json")).code, 0)
            good = self.load("good.json")

            def base(doc):
                return doc["prompts"][0]["baseline"]

            cases = [
                ("short logprobs", lambda d: base(d)["logprobs"].pop(), "baseline.logprobs has 23 entries for 24 tokens"),
                ("tokens not strings", lambda d: base(d).__setitem__("tokens", [1] * 24), "baseline.tokens"),
                ("null text", lambda d: base(d).__setitem__("text", None), "baseline.text"),
                ("logprob a string", lambda d: base(d)["logprobs"].__setitem__(0, "x"), "baseline.logprobs"),
                ("short top-k", lambda d: base(d)["top_logprobs"].pop(), "baseline.top_logprobs"),
                ("top-k not a map", lambda d: base(d)["top_logprobs"].__setitem__(3, [1]), "top_logprobs[3]"),
                ("prompt not a record", lambda d: d["prompts"].append("x"), "prompts[2] is not a prompt record"),
                ("baseline missing", lambda d: d["prompts"][0].__setitem__("baseline", None), "not a record"),
            ]
            for name, damage, words in cases:
                with self.subTest(name):
                    doc = copy.deepcopy(good)
                    damage(doc)
                    path = self.path(name.replace(" ", "_") + ".json")
                    with open(path, "w") as f:
                        json.dump(doc, f)
                    before = len(stub.requests)
                    r = sweep(stub, "--sizes", "1,2", "--baseline", path)
                    self.assertEqual(r.code, 2, r)
                    self.assertEqual(len(stub.requests), before)  # refused before any request
                    self.assertIn(words, r.stderr)
                    self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)


class PrefillMargin(unittest.TestCase):
    def test_the_decodes_runner_up_margin_at_the_first_differing_step(self):
        # Flag on, every completion is batch 1's; its prefill reduces in another order.
        with StubServer(StubConfig(invariant=True)) as stub:
            doc = sweep(stub, "--sizes", "1,2", "--prefill-check", "--json").json()
        sm = doc["summary"]
        self.assertEqual(sm["prefill_verdict"], "decode and prefill differ")
        step = sm["prefill_first_step"]
        ids, _, tops, _ = stub_completion("vllm", PROMPT, 1, 24, 5, invariant=True)
        top = tops[step]
        runner_up = max(v for t, v in top.items() if t != ids[step])
        self.assertEqual(sm["prefill_margin"]["ulp"], ulps32(top[ids[step]], runner_up))
        self.assertGreater(sm["prefill_tokens"], 0)


class AgainstAnotherServer(TempDirTest):
    """--baseline URL: batch 1 of another server (a TP degree, a version, a restart)."""

    def test_a_server_with_other_arithmetic_is_reported_against_the_baseline_server(self):
        with StubServer(StubConfig(invariant=True)) as base, \
                StubServer(StubConfig(invariant=True, tp_size=2, rotation_offset=1)) as other:
            r = sweep(other, "--sizes", "1,2", "--baseline", base.url, "--expect", "invariant",
                      "--save", self.path("s.json"))
            base_bodies = base.generation_bodies()
        self.assertEqual(r.code, 1, r)  # the arithmetic moved between the servers
        doc = self.load("s.json")
        self.assertEqual(doc["params"]["baseline_server"], base.url)
        self.assertIn({"setting": "TP size", "baseline": 1, "here": 2}, doc["params"]["baseline_differences"])
        self.assertEqual(doc["prompts"][0]["baseline_source"], "batch 1 of %s" % base.url)
        self.assertIn(doc["summary"]["verdict"], ("tokens diverged", "logprobs moved but tokens held"))
        self.assertGreater(sizes_of(doc)[1]["max_ulp"], 0)  # its own batch 1 differs from the baseline's
        self.assertEqual(len(base_bodies), 1)  # the baseline server answered batch 1 once
        self.assertIn("baseline: batch 1 of %s, TP size 1 there, 2 here" % base.url, r.stdout)
        self.assertIn("against batch 1 of %s" % base.url, r.stdout)

    def test_two_servers_alike_are_invariant_against_each_other(self):
        with StubServer(StubConfig(invariant=True)) as base, StubServer(StubConfig(invariant=True)) as other:
            r = sweep(other, "--sizes", "1,2,9", "--baseline", base.url, "--expect", "invariant")
        self.assertEqual(r.code, 0, r)
        self.assertIn("reporting the same settings", r.stdout)

    def test_the_server_under_test_is_no_baseline(self):
        with StubServer(StubConfig()) as stub:
            r = sweep(stub, "--baseline", stub.url.replace("127.0.0.1", "localhost"))
        self.assertEqual(r.code, 2, r)
        self.assertIn("--baseline names the server under test", r.stderr)


class CacheCheck(TempDirTest):
    """--cache-check: each batch cold, then again from the prefix cache, compared bitwise."""

    def check(self, engine, *extra, **config):
        details = {"prompt_tokens_details": True} if engine == "vllm" else {}
        details.update(config)
        with StubServer(StubConfig(engine=engine, invariant=True, **details)) as stub:
            r = sweep(stub, "--sizes", "1,2,4", "--cache-check", "--json", *extra)
            bodies = [json.loads(b) for b in stub.generation_bodies()]
        return r, bodies

    def test_a_cache_path_that_computes_otherwise_is_found(self):
        for engine in ("vllm", "sglang"):
            with self.subTest(engine=engine):
                r, _ = self.check(engine, "--expect", "cache-equal", cache_path_differs=True)
                self.assertEqual(r.code, 1, r)
                sm = r.json()["summary"]
                self.assertEqual(sm["cache_verdict"], "cache hit differs from cold prefill")
                self.assertGreater(sm["cache_max_ulp"], 0)

    def test_one_that_does_not_passes_with_the_hit_proven(self):
        for engine in ("vllm", "sglang"):
            with self.subTest(engine=engine):
                r, bodies = self.check(engine, "--expect", "cache-equal")
                self.assertEqual(r.code, 0, r)
                sm = r.json()["summary"]
                self.assertEqual((sm["cache_verdict"], sm["cache_max_ulp"], sm["cache_batches"]),
                                 ("cache hit equals cold prefill bitwise", 0, 3))
                rows = [run_ for size in r.json()["prompts"][0]["sizes"] for run_ in size["runs"]]
                self.assertTrue(all(row["cache_check"]["cached_tokens"] > 0 for row in rows))
                self.assertIn("expect cache-equal: held", r.stderr)
                # the repeat carries the cold request's key: that is what the cache serves
                key = "cache_salt" if engine == "vllm" else "extra_key"
                self.assertEqual([b[key] for b in bodies[0::2]], [b[key] for b in bodies[1::2]])

    def test_without_counts_the_hit_is_unverified(self):
        r, _ = self.check("vllm", "--expect", "cache-equal", prompt_tokens_details=False)
        self.assertEqual(r.code, 1, r)
        self.assertEqual(r.json()["summary"]["cache_verdict"],
                         "equal, but the hit is unverified (the server reports no cached-token counts)")

    def test_a_server_without_a_cache_misses(self):
        r, _ = self.check("sglang", prefix_caching=False)
        self.assertEqual(r.code, 0, r)
        self.assertEqual(r.json()["summary"]["cache_verdict"],
                         "equal, but the repeat was not served from the cache (cached-token count 0)")

    def test_only_with_copies_and_the_bypass(self):
        for extra in (("--traffic", "concurrent"), ("--prefix-cache", "keep")):
            with self.subTest(extra=extra):
                r = run_lab("--mode", "sweep", "--cache-check", *extra)
                self.assertEqual(r.code, 2, r)
                self.assertIn("--cache-check goes with", r.stderr)
        r = run_lab("--mode", "sweep", "--expect", "cache-equal")
        self.assertEqual(r.code, 2, r)


if __name__ == "__main__":
    unittest.main()
