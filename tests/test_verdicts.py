"""Every verdict backed by what was measured: nothing claimed without a comparison (in a
sweep or a cost run), top-k membership part of the comparison, text differences named as
such, and the near-tie margin at every first divergence, checked against the practice
engine's own arithmetic."""

import unittest

from support import (PROMPT, StubConfig, StubServer, TempDirTest, run, run_lab, short_sweep,
                     sent_batch, sizes_of, stub_completion, ulps32)


class NothingCompared(TempDirTest):
    def test_a_sweep_stopped_after_batch_1_claims_nothing(self):
        for engine in ("vllm", "sglang"):
            with self.subTest(engine=engine), StubServer(StubConfig(engine=engine, invariant=True,
                                                                    faults={2: "http500"})) as stub:
                r = short_sweep(stub, "--sizes", "1,2,4", "--repeat", 2, "--expect", "invariant", "--save", self.path(engine + ".json"))
                self.assertEqual(r.code, 3, r)
                doc = self.load(engine + ".json")
                self.assertEqual(doc["summary"]["verdict"], "nothing compared")
                self.assertEqual(doc["prompts"][0]["verdict"], "nothing compared")
                self.assertIn(": nothing compared (stopped: server error)", r.stdout)
                self.assertNotIn("invariant", r.stdout.split("summary:")[1])

    def test_both_expectations_fail_on_it(self):
        for expect in ("invariant", "variant"):
            with self.subTest(expect=expect), StubServer(StubConfig(invariant=expect == "invariant")) as stub:
                r = short_sweep(stub, "--sizes", "1", "--repeat", 2, "--expect", expect)
                self.assertEqual(r.code, 1, r)
                self.assertIn("expectation failed: --expect %s" % expect, r.stdout)

    def test_a_stored_baseline_makes_batch_1_a_comparison(self):
        with StubServer(StubConfig(invariant=True)) as stub:
            self.assertEqual(short_sweep(stub, "--sizes", "1,2", "--save", self.path("base.json")).code, 0)
            r = short_sweep(stub, "--sizes", "1", "--baseline", self.path("base.json"), "--repeat", 2, "--expect", "invariant", "--json")
        self.assertEqual(r.code, 0, r)
        self.assertEqual(r.json()["summary"]["verdict"], "invariant")


class AdviceForTheEngineAtHand(TempDirTest):
    """What the advice says of an engine's prefix cache is that engine's, never another's."""

    def test_a_cache_that_served_copies_is_explained_in_the_engines_own_terms(self):
        own = {"vllm": "vLLM's copies of one request share its cache whatever the salt",
               "sglang": "gives every prompt a cache key of its own (extra_key)"}
        for engine, words in own.items():
            config = StubConfig(engine=engine, invariant=True, cache_serves="one",
                                cache_path_differs=True, prompt_tokens_details=True)
            with self.subTest(engine=engine), StubServer(config) as stub:
                r = short_sweep(stub, "--sizes", "1,2,4", "--save", self.path(engine + ".json"))
                self.assertEqual(r.code, 0, r)
                self.assertEqual(self.load(engine + ".json")["summary"]["verdict"],
                                 "moved only where the cache served (bypass did not hold)")
                advice = r.stdout.split("summary:")[1]
                self.assertIn(words, advice)
                other = own["sglang" if engine == "vllm" else "vllm"]
                self.assertNotIn(other, advice)
                if engine == "sglang":
                    self.assertNotIn("vLLM", advice)


class SamplingWithoutAControl(TempDirTest):
    """At temperature > 0 only the seed makes samples alike: with no run-to-run control to
    check it, what moved is not put down to batching, and the header claims no seed held."""

    def test_one_pass_of_a_server_that_ignores_the_seed_blames_no_batching(self):
        # vLLM is taken to honour the seed; this one takes it and does not use it
        with StubServer(StubConfig(ignore_seed=True, prompt_tokens_details=True)) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2,4", "--repeat", 1,
                        "--max-tokens", 16, "--temperature", "0.8", "--expect", "variant",
                        "--save", self.path("s.json"))
        self.assertEqual(r.code, 1, r)
        self.assertNotIn("(honoured)", r.stdout)
        self.assertIn("seed 42 (the engine takes a per-request seed; not checked: --repeat 1 "
                      "runs no run-to-run control)", r.stdout)
        self.assertEqual(self.load("s.json")["summary"]["verdict"], "sampling noise not ruled out")
        self.assertNotIn("tokens diverged", r.stdout)
        self.assertIn("no run-to-run control checked that it does", r.stdout)
        self.assertIn("Sweep with --repeat 2 or more", r.stdout)
        self.assertNotIn("The server ignores the seed", r.stdout)

    def test_with_a_control_the_header_says_it_checks_the_seed(self):
        with StubServer(StubConfig(prompt_tokens_details=True)) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--repeat", 2,
                        "--max-tokens", 8, "--temperature", "0.8", "--save", self.path("s.json"))
        self.assertEqual(r.code, 0, r)
        self.assertIn("seed 42 (the engine takes a per-request seed; batch 1's run-to-run "
                      "control checks it)", r.stdout)
        summary = self.load("s.json")["summary"]
        self.assertIs(summary["batch1_repeatable"], True)
        self.assertNotEqual(summary["verdict"], "sampling noise not ruled out")

    def test_the_verdict_rule(self):
        m = run.Measured
        moved = dict(moved=True, compared=True, tokens_diverged=True)
        self.assertEqual(run.verdict(m(6, 3, 5, **moved, uncontrolled=True)),
                         run.NOISE_NOT_RULED_OUT)
        self.assertEqual(run.verdict(m(6, 3, 5, **moved)), run.TOKENS_DIVERGED)
        self.assertEqual(run.verdict(m(6, 1, compared=True, uncontrolled=True)), run.INVARIANT)


class EvidenceForABatch(TempDirTest):
    """A difference is put down to batching only where a batch was formed and served cold."""

    def test_divergence_only_where_copies_hit_the_cache_is_not_put_down_to_batching(self):
        # The practice engine's copies of one request share its prefix cache, as vLLM's do
        with StubServer(StubConfig(prompt_tokens_details=True, scheduler_window=0.05)) as stub:
            copies = short_sweep(stub, "--sizes", "1,2,9,17", "--expect", "variant", "--json")
            concurrent = short_sweep(stub, "--sizes", "1,2,9,17", "--traffic", "concurrent",
                                     "--expect", "variant", "--json")
        self.assertEqual(copies.code, 1, copies)
        summary = copies.json()["summary"]
        self.assertEqual(summary["verdict"], "moved only where the cache served (bypass did not hold)")
        self.assertEqual(summary["prefix_cache_bypass"]["hit_sizes"], [2, 9, 17])
        self.assertIn("what moved is not put down to batching", copies.stderr)
        # concurrent requests carry a key each: the bypass holds, and batching is shown
        self.assertEqual(concurrent.code, 0, concurrent)
        self.assertEqual(concurrent.json()["summary"]["prefix_cache_bypass"]["status"], "held")
        self.assertEqual(concurrent.json()["summary"]["verdict"], "tokens diverged")

    def test_scheduled_requests_that_never_overlapped_compare_nothing(self):
        # Two requests a size, 0.5 s apart on average (seeded), against a server answering in
        # milliseconds: each is answered before the next goes out, so no batch is formed
        seed = next(s for s in range(100) if run.Arrivals(2.0).schedule(2, s + 2)[1] > 0.3)
        with StubServer(StubConfig(scheduler_window=0)) as stub:
            r = short_sweep(stub, "--sizes", "1,2", "--traffic", "concurrent", "--request-rate",
                            "2", "--seed", seed, "--repeat", 2, "--expect", "invariant", "--json")
        self.assertEqual(r.code, 1, r)
        doc = r.json()
        self.assertEqual(doc["summary"]["verdict"], "nothing compared")
        self.assertIs(sizes_of(doc)[2]["runs"][0]["overlapped"], False)
        self.assertIn("never in flight together", r.stderr)

    def test_a_burst_overlaps_by_construction_and_is_compared(self):
        with StubServer(StubConfig(invariant=True)) as stub:
            r = short_sweep(stub, "--sizes", "1,4", "--traffic", "concurrent", "--json")
        self.assertEqual(r.json()["summary"]["verdict"], "invariant")
        self.assertNotIn("overlapped", sizes_of(r.json())[4]["runs"][0])

    def test_completions_without_tokens_compare_nothing(self):
        sweep = run.PromptSweep("p")
        empty = run.Completion("", [], [], [])
        sweep.set_baseline(empty, "batch 1")
        for n in (1, 4):
            row = run.compare_batch(sent_batch([empty] * n, 0), empty, ())
            sweep.add(n, n, row, [empty] * n)
        self.assertEqual(run.verdict(sweep.measured()), "nothing compared")
        token = run.Completion("a", ["token_id:1"], [-0.5], [{"token_id:1": -0.5}])
        sweep = run.PromptSweep("p")
        sweep.set_baseline(token, "batch 1")
        for n in (1, 4):
            # each request's answer counted 0 cached tokens: computed cold
            sweep.add(n, n, run.compare_batch(sent_batch([token] * n, 0), token, ()), [token] * n)
        self.assertEqual(run.verdict(sweep.measured()), "invariant")


class EvidencePerRequest(TempDirTest):
    """The verdict reads what each request showed, pass by pass: a request the prefix cache
    served compares nothing about batching, in either direction, and a batch is what was in
    flight."""

    def test_a_cache_hit_in_one_pass_does_not_discount_another_pass(self):
        # pass 1: every request above batch 1 served from the cache (cached tokens reported);
        # pass 2: none, and batching moved just the same
        with StubServer(StubConfig(prompt_tokens_details=True, scheduler_window=0.05,
                                   faults={k: "cachehit" for k in range(2, 17)})) as stub:
            r = short_sweep(stub, "--sizes", "1,2,4,9", "--traffic", "concurrent", "--repeat", 2,
                            "--expect", "variant", "--json")
        self.assertEqual(r.code, 0, r)
        doc = r.json()
        self.assertIn(doc["summary"]["verdict"], ("tokens diverged", "logprobs moved but tokens held"))
        runs = sizes_of(doc)[9]["runs"]
        self.assertEqual([run_.get("served") for run_ in runs], [9, None])
        self.assertEqual(doc["summary"]["served_sizes"], [2, 4, 9])

    def test_one_cached_request_of_several_leaves_the_others_as_evidence(self):
        with StubServer(StubConfig(prompt_tokens_details=True, scheduler_window=0.05,
                                   faults={2: "cachehit"})) as stub:
            r = short_sweep(stub, "--sizes", "1,9", "--traffic", "concurrent", "--repeat", 1,
                            "--expect", "variant", "--json")
        self.assertEqual(r.code, 0, r)
        self.assertEqual(r.json()["summary"]["verdict"], "tokens diverged")
        self.assertEqual(sizes_of(r.json())[9]["runs"][0]["served"], 1)

    def test_flag_on_copies_the_cache_served_certify_nothing(self):
        # copies of one request share the cache: every size above 1 served, the bypass failed
        with StubServer(StubConfig(invariant=True, prompt_tokens_details=True)) as stub:
            r = short_sweep(stub, "--sizes", "1,2,8", "--repeat", 2, "--expect", "invariant")
        self.assertEqual(r.code, 1, r)
        self.assertIn(": nothing compared: the cache served every request above batch 1", r.stdout)
        self.assertNotIn(": invariant", r.stdout.split("summary:")[1])
        self.assertIn("expectation failed: --expect invariant", r.stdout)

    def test_flag_on_where_only_some_sizes_were_served_says_so(self):
        sweep = run.PromptSweep("p")
        token = run.Completion("a", ["token_id:1"], [-0.5], [{"token_id:1": -0.5}])
        sweep.set_baseline(token, "batch 1")
        for n, cached in ((1, 0), (2, 0), (8, 40)):
            batch = sent_batch([token] * n, cached)
            sweep.add(n, n, run.compare_batch(batch, token, ()), [token] * n)
        m = sweep.measured()
        self.assertEqual(run.verdict(m), "invariant")
        self.assertEqual(m.served_sizes, [8])
        summary = run.SweepSummary(1, 11, 0, 0.0, 0.0, None, "copies", 1, "invariant", None, [8],
                                   [], "complete", {}, m)
        self.assertEqual(run.verdict_reasons(summary),
                         ["invariant where computed; size 8 served from the cache, not compared"])

    def test_a_scheduled_size_says_how_many_were_in_flight(self):
        # 8 requests at 10 a second against a server answering each in about 0.1 s: a few
        # at a time at most, never the 8 of the size
        with StubServer(StubConfig(scheduler_window=0, step_delay=0.02)) as stub:
            r = short_sweep(stub, "--sizes", "1,8", "--traffic", "concurrent", "--repeat", 1,
                            "--request-rate", 10, "--max-tokens", 6, "--save", self.path("s.json"),
                            "--wide")  # each row with its notes on its own line
        self.assertIn(r.code, (0,), r)
        size8 = sizes_of(self.load("s.json"))[8]
        reached = size8["runs"][0].get("in_flight")
        self.assertIsNotNone(reached)
        self.assertLess(reached, 8)
        row8 = next(line for line in r.stdout.splitlines() if line.split()[:1] == ["8"])
        if reached > 1:
            self.assertIn("at most %d of 8 requests in flight together" % reached, row8)
        else:
            self.assertIn("never in flight together", row8)

    def test_first_moved_is_what_the_verdict_read(self):
        with StubServer(StubConfig(prefix_caching=False, invariant=True, faults={2: "textonly"})) as stub:
            doc = short_sweep(stub, "--sizes", "1,2", "--json").json()
        self.assertEqual(doc["summary"]["verdict"], "text differs, tokens equal")
        self.assertEqual(doc["summary"]["first_moved"], {"batch": 2, "what": "text", "step": None})
        with StubServer(StubConfig(prefix_caching=False, invariant=True, topk_edge_swap=True)) as stub:
            doc = short_sweep(stub, "--sizes", "1,2", "--json").json()
        self.assertEqual(doc["summary"]["first_moved"]["what"], "top-k")


class TopKMembership(unittest.TestCase):
    def test_a_top_k_set_that_changes_with_the_batch_is_a_move(self):
        for engine in ("vllm", "sglang"):
            with self.subTest(engine=engine), StubServer(StubConfig(prefix_caching=False, engine=engine, invariant=True,
                                                                    topk_edge_swap=True)) as stub:
                r = short_sweep(stub, "--sizes", "1,2", "--repeat", 2, "--expect", "invariant", "--json")
            self.assertEqual(r.code, 1, r)
            doc = r.json()
            size2 = sizes_of(doc)[2]
            self.assertEqual(size2["max_ulp"], 0)  # every shared value is equal ...
            self.assertIn("top-k changed", size2["ulp_notes"])  # ... but the set is not
            self.assertEqual(size2["first_ulp_step"], 0)
            self.assertEqual(size2["runs_matched"], 0)
            self.assertEqual(doc["summary"]["verdict"], "logprobs moved but tokens held")

    def test_the_same_server_without_the_swap_is_invariant(self):
        with StubServer(StubConfig(prefix_caching=False, invariant=True)) as stub:
            r = short_sweep(stub, "--sizes", "1,2", "--repeat", 2, "--expect", "invariant", "--json")
        self.assertEqual(r.code, 0, r)
        self.assertNotIn("top-k changed", r.json()["summary"]["ulp_notes"])


class TextOnly(unittest.TestCase):
    def test_text_that_differs_with_equal_tokens_is_named_so(self):
        with StubServer(StubConfig(prefix_caching=False, invariant=True, faults={2: "textonly"})) as stub:
            r = short_sweep(stub, "--sizes", "1,2", "--repeat", 2, "--expect", "invariant", "--json")
        self.assertEqual(r.code, 1, r)
        doc = r.json()
        self.assertEqual(doc["summary"]["verdict"], "text differs, tokens equal")
        self.assertEqual(sizes_of(doc)[2]["text_only"], 1)
        self.assertIsNone(sizes_of(doc)[2]["first_token_divergence"])

    def test_expect_variant_does_not_pass_on_it(self):
        with StubServer(StubConfig(prefix_caching=False, invariant=True, faults={2: "textonly"})) as stub:
            r = short_sweep(stub, "--sizes", "1,2", "--expect", "variant")
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
                doc = short_sweep(stub, "--sizes", ",".join(map(str, sizes)), "--json").json()
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
            r = short_sweep(stub, "--sizes", "1,9", "--wide")  # the tie margin's column
        row9 = next(line for line in r.stdout.splitlines() if line.split()[:1] == ["9"])
        want = self.expected("vllm", 9)
        self.assertIsNotNone(want)
        self.assertIn("%d ULP" % want["ulp"] if "ulp" in want else want["note"], row9)


class VerdictsClaimOnlyWhatWasMeasured(TempDirTest):
    def test_no_completion_compared_is_no_data_and_fails_every_expect(self):
        for expect in ("invariant", "variant"):
            with self.subTest(expect=expect), StubServer(StubConfig(faults={1: "http500"})) as stub:
                r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--expect", expect, "--repeat", 2,
                            "--save", self.path(expect + ".json"))
                self.assertNotEqual(r.code, 0)
                self.assertEqual(self.load(expect + ".json")["summary"]["verdict"], "no data")

    def test_a_single_size_cannot_be_invariant(self):
        with StubServer(StubConfig(invariant=True)) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1", "--repeat", 2, "--expect", "invariant", "--json")
        self.assertEqual(r.code, 1, r)
        self.assertEqual(r.json()["summary"]["verdict"], "nothing compared")
        self.assertIn("batch 1 was the only size", r.stderr)

    def test_too_few_pairs_have_no_interval_and_are_never_significant(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 1, "--trials",
                        run.MIN_PAIRS_FOR_INTERVAL - 1, "--warmup", 0, "--max-tokens", 2)
        self.assertEqual(r.code, 0, r)
        self.assertIn("no interval: 5 trial pairs, an interval needs at least 6", r.stdout)
        stats = run.Overhead.of([1.0] * 5, [2.0] * 5)
        self.assertEqual((stats.ci95_pct, stats.significant), (None, False))
        self.assertTrue(run.Overhead.of([1.0] * 6, [2.0] * 6).significant)


if __name__ == "__main__":
    unittest.main()
