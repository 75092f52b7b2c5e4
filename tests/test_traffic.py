"""--traffic, --repeat and --prefix-cache: the traffic real servers see, with a run-to-run
control, against a practice engine that batches concurrent requests as a server does; the
prefix-cache bypass proven by the server's counts, or called unverified."""

import json
import stub_server
import unittest

from support import (PROMPT, StubConfig, StubServer, TempDirTest, expected_sweep, run, run_lab,
                     short_sweep, sizes_of)


PROMPT = run.DEFAULT_PROMPT
TOKENS = 32
WINDOW = 0.2   # seconds the scheduling stub gathers requests into one step batch


def sweep(stub, *extra):
    # copies in one request unless extra names a --traffic: each size one request
    return run_lab("--mode", "sweep", "--engine", stub.config.engine, "--url", stub.url,
                   "--max-tokens", TOKENS, "--json", "--traffic", "copies", *extra)


class ConcurrentTraffic(unittest.TestCase):
    def test_unique_count_equals_what_the_scheduling_stub_served(self):
        for engine in ("vllm", "sglang"):
            with self.subTest(engine=engine):
                with StubServer(StubConfig(engine=engine, scheduler_window=WINDOW)) as stub:
                    r = sweep(stub, "--traffic", "concurrent", "--sizes", "1,5,17,25", "--repeat", 2,
                              "--max-tokens", 12)
                    stats = stub.httpd.state.stats()
                self.assertEqual(r.code, 0, r)
                doc = r.json()
                self.assertEqual(doc["summary"]["unique_completions"], stats["distinct_texts"])
                self.assertGreater(doc["summary"]["unique_completions"], 1)
                self.assertEqual(stats["generation_requests"], 2 * (1 + 5 + 17 + 25))
                self.assertEqual(doc["summary"]["total_completions"], 2 * (1 + 5 + 17 + 25))
                self.assertTrue(doc["summary"]["batch1_repeatable"])
                spreads = [run_.get("send_spread_s") for s in doc["prompts"][0]["sizes"][1:] for run_ in s["runs"]]
                self.assertTrue(all(isinstance(x, float) and x >= 0 for x in spreads), spreads)

    def test_flag_on_is_invariant_under_concurrent_traffic(self):
        with StubServer(StubConfig(invariant=True, scheduler_window=WINDOW)) as stub:
            r = sweep(stub, "--traffic", "concurrent", "--sizes", "1,9,25", "--repeat", 2, "--max-tokens", 12,
                      "--expect", "invariant")
        self.assertEqual(r.code, 0, r)
        sm = r.json()["summary"]
        self.assertEqual((sm["unique_completions"], sm["max_ulp"], sm["verdict"]), (1, 0, "invariant"))

    def test_sixty_four_concurrent_requests_form_one_step_batch(self):
        # A wide window: the 64 client threads and the in-process server share one interpreter,
        # and on a loaded machine the last request may leave well after the first.
        with StubServer(StubConfig(scheduler_window=1.0)) as stub:
            r = sweep(stub, "--traffic", "concurrent", "--sizes", "1,64", "--repeat", 1, "--max-tokens", 4)
            self.assertEqual(r.code, 0, r)
            with run.urllib.request.urlopen(stub.url + "/stub/stats", timeout=10) as resp:
                stats = json.loads(resp.read())
        self.assertGreaterEqual(stats["largest_step_batch"], 58)
        self.assertEqual(stats["generation_requests"], 65)

    def test_a_failed_request_stops_the_size_and_keeps_what_was_measured(self):
        with StubServer(StubConfig(faults={5: "http500"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--traffic", "concurrent", "--sizes", "1,2,8",
                        "--repeat", 1, "--max-tokens", 4, "--json")
        self.assertEqual(r.code, 3, r)
        self.assertIn("batch size 8: HTTP 500", r.stderr)
        self.assertIn("1 of 8 concurrent requests failed", r.stderr)
        self.assertEqual([s["batch_size"] for s in r.json()["prompts"][0]["sizes"]], [1, 2])


class MixedTraffic(TempDirTest):
    def test_only_the_measured_prompt_is_compared_and_it_moves_as_its_batch_does(self):
        sizes = [1, 2, 9, 17, 25]
        rows, unique = expected_sweep("vllm", PROMPT, sizes, TOKENS, 5)
        with StubServer() as stub:
            r = sweep(stub, "--traffic", "mixed", "--sizes", ",".join(map(str, sizes)), "--repeat", 1)
            bodies = [json.loads(b) for b in stub.generation_bodies()]
        self.assertEqual(r.code, 0, r)
        doc = r.json()
        got = {s["batch_size"]: (s["first_token_divergence"], s["max_ulp"]) for s in doc["prompts"][0]["sizes"]}
        self.assertEqual(got, rows)
        self.assertEqual(doc["summary"]["total_completions"], len(sizes))
        positions = []
        for body, n in zip(bodies, sizes):
            self.assertEqual(len(body["prompt"]), n)
            self.assertEqual(body["prompt"].count(PROMPT), 1)
            positions.append(body["prompt"].index(PROMPT))
            lengths = {len(p.split()) for p in body["prompt"] if p != PROMPT}
            if n >= 17:
                self.assertGreater(max(lengths), 100)
                self.assertLess(min(lengths), 20)
        self.assertGreater(len(set(positions[1:])), 1)  # the position varies with n

    def test_fillers_follow_the_seed(self):
        a, pos_a = run.mixed_batch("p", 12, 42)
        b, pos_b = run.mixed_batch("p", 12, 42)
        c, _ = run.mixed_batch("p", 12, 7)
        self.assertEqual((a, pos_a), (b, pos_b))
        self.assertNotEqual(a, c)
        self.assertEqual(a[pos_a], "p")
        self.assertEqual(len(set(a)), 12)


class Repeats(TempDirTest):
    SIZES = [1, 2, 9, 17]

    def test_total_completions_for_every_shape_with_and_without_repeats(self):
        with StubServer(StubConfig(scheduler_window=0.05)) as stub:
            for traffic, per_pass in (("copies", sum(self.SIZES)), ("concurrent", sum(self.SIZES)),
                                      ("mixed", len(self.SIZES))):
                for repeat in (1, 3):
                    with self.subTest(traffic=traffic, repeat=repeat):
                        r = sweep(stub, "--traffic", traffic, "--repeat", repeat, "--max-tokens", 8,
                                  "--sizes", ",".join(map(str, self.SIZES)))
                        self.assertEqual(r.code, 0, r)
                        doc = r.json()
                        self.assertEqual(doc["summary"]["total_completions"], repeat * per_pass)
                        self.assertEqual([len(s["runs"]) for s in doc["prompts"][0]["sizes"]], [repeat] * 4)

    def test_passes_go_through_the_whole_ladder_in_turn(self):
        with StubServer() as stub:
            r = sweep(stub, "--repeat", 2, "--sizes", "1,3,5", "--max-tokens", 4)
            sent = [len(json.loads(b)["prompt"]) for b in stub.generation_bodies()]
        self.assertEqual(r.code, 0, r)
        self.assertEqual(sent, [1, 3, 5, 1, 3, 5])

    def test_repeats_aggregate_per_size_and_the_table_shows_them(self):
        rows, unique = expected_sweep("vllm", PROMPT, self.SIZES, TOKENS, 5)
        with StubServer() as stub:
            r = run_lab("--mode", "sweep", "--traffic", "copies", "--url", stub.url, "--repeat", 3, "--max-tokens", TOKENS,
                        "--sizes", ",".join(map(str, self.SIZES)), "--save", self.path("s.json"))
        self.assertEqual(r.code, 0, r)
        doc = self.load("s.json")
        for s in doc["prompts"][0]["sizes"]:
            n = s["batch_size"]
            self.assertEqual((s["first_token_divergence"], s["max_ulp"]), rows[n])
            self.assertEqual(s["completions"], 3 * n)
            self.assertEqual(s["runs_matched"], 3 if rows[n] == (None, 0) else 0)
        self.assertEqual(doc["summary"]["unique_completions"], unique)
        self.assertTrue(doc["summary"]["batch1_repeatable"])
        self.assertIn("batch 1 repeatable over 3 passes", r.stdout)
        row9 = next(line for line in r.stdout.splitlines() if line.split()[:1] == ["9"])
        self.assertIn("0/3", row9)

    def test_one_pass_has_no_control(self):
        with StubServer() as stub:
            r = sweep(stub, "--repeat", 1, "--sizes", "1,2")
        self.assertIsNone(r.json()["summary"]["batch1_repeatable"])


class PrefixCache(unittest.TestCase):
    def test_vllm_bypass_salts_every_request_and_keep_reports_cached_tokens(self):
        with StubServer(StubConfig(prompt_tokens_details=True, scheduler_window=0.05)) as stub:
            r = sweep(stub, "--traffic", "concurrent", "--sizes", "1,4", "--repeat", 2)
            salts = [json.loads(b).get("cache_salt") for b in stub.generation_bodies()]
            self.assertEqual(r.code, 0, r)
            self.assertEqual(len(salts), 10)
            self.assertEqual(len(set(salts)), 10)
            self.assertTrue(all(s.startswith("lab-") for s in salts))
            self.assertEqual({run_["cached_tokens"] for s in r.json()["prompts"][0]["sizes"] for run_ in s["runs"]}, {0})
            r = sweep(stub, "--prefix-cache", "keep", "--sizes", "1,4", "--repeat", 1)
            bodies = [json.loads(b) for b in stub.generation_bodies()[10:]]
        self.assertTrue(all("cache_salt" not in b for b in bodies))
        sizes = r.json()["prompts"][0]["sizes"]
        self.assertEqual(sizes[0]["cached_tokens"], 0)          # the first time this prompt is seen
        self.assertGreater(sizes[1]["cached_tokens"], 0)        # batch 4 is served batch 1's prefill
        self.assertEqual(r.json()["params"]["prefix_cache"], "keep")

    def test_sglang_bypass_flushes_before_every_size_and_keep_does_not(self):
        with StubServer(StubConfig(engine="sglang")) as stub:
            r = sweep(stub, "--sizes", "1,2,4", "--repeat", 2)
            flushes = [p for m, p, _ in stub.requests if m == "POST" and p == "/flush_cache"]
            self.assertEqual(r.code, 0, r)
            self.assertEqual(len(flushes), 6)
            # batch 1 of the second pass is not served the first pass's prefill
            self.assertEqual([run_["cached_tokens"] for run_ in r.json()["prompts"][0]["sizes"][0]["runs"]], [0, 0])
            r = sweep(stub, "--sizes", "1,2,4", "--repeat", 2, "--prefix-cache", "keep")
            flushes_after = [p for m, p, _ in stub.requests if m == "POST" and p == "/flush_cache"]
        self.assertEqual(len(flushes_after), 6)
        batch1 = [run_["cached_tokens"] for run_ in r.json()["prompts"][0]["sizes"][0]["runs"]]
        # The bypassed sweep cached under keys of its own, so only pass 2 is served pass 1's prefill.
        self.assertEqual(batch1[0], 0)
        self.assertGreater(batch1[1], 0)

    def test_a_failed_flush_stops_the_sweep(self):
        with StubServer(StubConfig(engine="sglang")) as stub:
            stub.config.flush_refused = True
            r = sweep(stub, "--sizes", "1,2", "--repeat", 1)
        self.assertEqual(r.code, 3, r)
        self.assertIn("/flush_cache", r.stderr)


class SchemaAndBaselines(TempDirTest):
    def test_an_old_sweep_file_still_serves_as_baseline(self):
        with StubServer(StubConfig(invariant=True)) as on:
            run_lab("--mode", "sweep", "--url", on.url, "--sizes", "1,9", "--max-tokens", 16, "--repeat", 1,
                    "--save", self.path("new.json"))
            old = self.load("new.json")
            old["schema"] = "batch-invariance-lab/sweep/1"
            for key in ("traffic", "repeat", "prefix_cache"):
                old["params"].pop(key)
            for s in old["prompts"][0]["sizes"]:
                s.pop("runs")
            with open(self.path("old.json"), "w") as f:
                json.dump(old, f)
            r = run_lab("--mode", "sweep", "--url", on.url, "--sizes", "1,9", "--max-tokens", 16,
                        "--baseline", self.path("old.json"), "--expect", "invariant")
        self.assertEqual(r.code, 0, r)


class BadInput(unittest.TestCase):
    def test_refused_before_any_request(self):
        with StubServer() as stub:
            cases = [(("--repeat", "0"), "--repeat"), (("--repeat", "101"), "--repeat: give 1 to 100"),
                     (("--repeat", "x"), "not a whole number"), (("--traffic", "burst"), "--traffic"),
                     (("--traffic", "mixed", "--sizes", "1"), "--traffic mixed"),
                     (("--traffic", "mixed", "--max-batch", "1"), "--traffic mixed"),
                     (("--prefix-cache", "sometimes"), "--prefix-cache")]
            for extra, message in cases:
                with self.subTest(args=extra):
                    r = run_lab("--mode", "sweep", "--url", stub.url, *extra)
                    self.assertEqual(r.code, 2, r)
                    self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
                    self.assertIn(message, r.stderr)
            self.assertEqual(stub.requests, [])

    def test_concurrent_sizes_above_max_num_seqs_are_warned_about_not_refused(self):
        with StubServer(StubConfig(max_num_seqs=4, scheduler_window=0.05)) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--traffic", "concurrent", "--sizes", "1,8",
                        "--repeat", 1, "--max-tokens", 4)
        self.assertEqual(r.code, 0, r)
        self.assertIn("exceed the server's max-num-seqs", r.stderr)


class RequestRate(unittest.TestCase):
    """--request-rate: arrivals that a recording loopback server sees as Poisson at that rate."""

    def gaps(self, stub):
        times = [t for (m, path, _), t in zip(stub.requests, stub.httpd.arrived)
                 if m == "POST" and path == "/v1/completions"]
        return [b - a for a, b in zip(times, times[1:])]

    def test_concurrent_requests_arrive_at_the_rate(self):
        with StubServer(StubConfig()) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--traffic", "concurrent", "--sizes", "1,201",
                        "--max-tokens", 1, "--repeat", 1, "--request-rate", 100, "--json")
            gaps = self.gaps(stub)[1:]  # the 200 gaps between batch 201's requests
        self.assertEqual(r.code, 0, r)
        self.assertEqual(r.json()["params"]["arrivals"], "poisson at 100/s")
        self.assertEqual(len(gaps), 200)
        mean = sum(gaps) / len(gaps)
        self.assertLess(abs(mean - 0.01) / 0.01, 0.10, mean)
        # exponential gaps: their spread is about their mean (a burst's, or a fixed pace's, is not)
        spread = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
        self.assertTrue(0.7 < spread / mean < 1.3, (spread, mean))

    def test_the_default_is_a_burst(self):
        with StubServer(StubConfig()) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--traffic", "concurrent", "--sizes", "1,50",
                        "--max-tokens", 1, "--repeat", 1, "--json")
            gaps = self.gaps(stub)[1:]
        self.assertEqual(r.json()["params"]["arrivals"], "burst")
        self.assertLess(sum(gaps), 0.5 * 50 / 100)  # far faster than any rate the test above sets

    def test_a_seed_repeats_the_schedule(self):
        a = run.Arrivals(50.0).schedule(100, 7)
        self.assertEqual(a, run.Arrivals(50.0).schedule(100, 7))
        self.assertNotEqual(a, run.Arrivals(50.0).schedule(100, 8))
        self.assertEqual(run.Arrivals(None).schedule(3, 7), [0.0, 0.0, 0.0])

    def test_load_trials_arrive_at_the_rate_too(self):
        with StubServer(StubConfig()) as off, StubServer(StubConfig(invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--concurrency", 64,
                        "--requests", 101, "--trials", 1, "--warmup", 0, "--max-tokens", 1,
                        "--request-rate", 100, "--quiet", "--json")
            gaps = self.gaps(off)
        self.assertEqual(r.code, 0, r)
        self.assertEqual(r.json()["arrivals"], "poisson at 100/s, seed 42")
        mean = sum(gaps) / len(gaps)
        self.assertLess(abs(mean - 0.01) / 0.01, 0.15, mean)

    def test_only_where_requests_go_one_a_prompt(self):
        with StubServer(StubConfig()) as stub, StubServer(StubConfig(invariant=True)) as on:
            for extra in (("--mode", "sweep", "--traffic", "copies"), ("--mode", "cost", "--invariant", on.url)):
                with self.subTest(extra=extra):
                    r = run_lab("--url", stub.url, "--request-rate", 10, *extra)
                    self.assertEqual(r.code, 2, r)
                    self.assertIn("--request-rate goes with", r.stderr)


class LoadCellArrivals(TempDirTest):
    def test_a_load_cell_is_known_by_the_seed_of_its_arrivals(self):
        # two seeds draw two schedules: two cells, neither replacing the other
        path = self.path("cost.json")
        with StubServer(StubConfig()) as off, StubServer(StubConfig(invariant=True)) as on:
            for seed in (7, 8):
                r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url,
                            "--concurrency", 4, "--requests", 8, "--trials", 1, "--warmup", 0,
                            "--max-tokens", 2, "--request-rate", 200, "--seed", seed,
                            "--save", path)
                self.assertEqual(r.code, 0, r)
        self.assertEqual([c["arrivals"] for c in self.load("cost.json")["cells"]],
                         ["poisson at 200/s, seed 7", "poisson at 200/s, seed 8"])


class LongPrompts(unittest.TestCase):
    """--prompt-tokens: a prompt built to N tokens as the server counts them, and whether its
    prefill crosses the chunked-prefill budget."""

    def test_a_prompt_across_a_2048_token_budget(self):
        budget = {("vllm_config", "scheduler_config", "max_num_batched_tokens"): 2048}
        with StubServer(StubConfig(info_overrides=budget, max_model_len=8192)) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--prompt-tokens", 3000, "--sizes", "1,2",
                        "--max-tokens", 4, "--repeat", 1, "--json")
            bodies = [json.loads(b) for b in stub.generation_bodies()]
        self.assertEqual(r.code, 0, r)
        found = r.json()["params"]["prompt_tokens"]
        # the practice engine's tokenizer: one id per UTF-8 byte, counted here on its own
        counted = len(stub_server.tokenize(bodies[0]["prompt"][0]))
        self.assertEqual(found["tokens"], counted)
        self.assertLessEqual(abs(counted - 3000), 30)
        self.assertEqual((found["asked"], found["prefill_budget"], found["prefill_chunks"]), (3000, 2048, 2))
        with StubServer(StubConfig(info_overrides=budget, max_model_len=8192)) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--prompt-tokens", 3000, "--sizes", "1,2",
                        "--max-tokens", 4, "--repeat", 1)
        self.assertIn("crosses the chunked-prefill budget of 2048 tokens: prefilled in 2 chunks", r.stdout)

    def test_one_that_fits(self):
        with StubServer(StubConfig()) as stub:  # the template's budget: 8192
            r = run_lab("--mode", "sweep", "--url", stub.url, "--prompt-tokens", 500, "--sizes", "1,2",
                        "--max-tokens", 4, "--repeat", 1)
        self.assertEqual(r.code, 0, r)
        self.assertIn("fits in one chunk of the chunked-prefill budget (8192 tokens)", r.stdout)

    def test_not_with_a_prompt_of_ones_own(self):
        r = run_lab("--mode", "sweep", "--prompt-tokens", 100, "--prompt", "hello")
        self.assertEqual(r.code, 2, r)
        self.assertIn("--prompt-tokens builds the prompt itself", r.stderr)


class PrefixCacheBypass(unittest.TestCase):
    def test_copies_in_one_vllm_request_share_the_cache_and_the_lab_says_so(self):
        # As on real vLLM 0.26.0: one cache_salt covers every copy of one request, and the
        # copies hit each other's prefix (the usage counts the last prompt's cached tokens).
        with StubServer(StubConfig(prompt_tokens_details=True)) as stub:
            r = short_sweep(stub, "--sizes", "1,2,4", "--wide")  # each row with its notes
        self.assertEqual(r.code, 0, r)
        self.assertIn("cache hit: bypass did not hold at batch sizes 2,4", r.stdout)
        row4 = next(line for line in r.stdout.splitlines() if line.split()[:1] == ["4"])
        self.assertIn("cache hit: bypass did not hold", row4)
        with StubServer(StubConfig(prompt_tokens_details=True)) as stub:
            doc = short_sweep(stub, "--sizes", "1,2,4", "--json").json()
        self.assertEqual(doc["summary"]["prefix_cache_bypass"], {"status": "did not hold", "hit_sizes": [2, 4]})
        self.assertEqual(sizes_of(doc)[1]["cached_tokens"], 0)
        self.assertGreater(sizes_of(doc)[2]["cached_tokens"], 0)

    def test_concurrent_vllm_requests_each_get_a_salt_and_hold(self):
        with StubServer(StubConfig(prompt_tokens_details=True)) as stub:
            doc = short_sweep(stub, "--sizes", "1,2,4", "--traffic", "concurrent", "--json").json()
        self.assertEqual(doc["summary"]["prefix_cache_bypass"]["status"], "held")

    def test_sglang_copies_each_get_a_cache_key_and_hold(self):
        with StubServer(StubConfig(engine="sglang")) as stub:
            r = short_sweep(stub, "--sizes", "1,2,4", "--json")
            keys = [json.loads(b).get("extra_key") for b in stub.generation_bodies()]
        self.assertEqual(r.json()["summary"]["prefix_cache_bypass"], {"status": "held", "hit_sizes": []})
        self.assertEqual([len(set(k)) for k in keys], [1, 2, 4])  # a fresh key for every prompt

    def test_a_server_that_reports_no_counts_leaves_the_bypass_unverified(self):
        # vLLM without --enable-prompt-tokens-details, its /metrics not reachable (a proxy)
        with StubServer(StubConfig(no_metrics=True)) as stub:
            r = short_sweep(stub, "--sizes", "1,2")
        self.assertEqual(r.code, 0, r)
        self.assertIn("prefix cache bypass unverified: the server reports no cached-token counts "
                      "(start vLLM with --enable-prompt-tokens-details", r.stdout)

    def test_keep_makes_no_claim(self):
        with StubServer(StubConfig(prompt_tokens_details=True)) as stub:
            doc = short_sweep(stub, "--sizes", "1,2", "--prefix-cache", "keep", "--json").json()
        self.assertNotIn("prefix_cache_bypass", doc["summary"])


if __name__ == "__main__":
    unittest.main()
