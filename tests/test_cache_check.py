"""--cache-check: a batch sent again from the prefix cache must equal its cold prefill
bitwise, the hit proven by the server's cached-token counts."""

import json
import types
import unittest

from support import StubConfig, StubServer, TempDirTest, run, run_lab, short_sweep


class CacheCheck(TempDirTest):
    """--cache-check: each batch cold, then again from the prefix cache, compared bitwise."""

    def check(self, engine, *extra, **config):
        details = {"prompt_tokens_details": True} if engine == "vllm" else {}
        details.update(config)
        with StubServer(StubConfig(engine=engine, invariant=True, **details)) as stub:
            r = short_sweep(stub, "--sizes", "1,2,4", "--cache-check", "--json", *extra)
            bodies = [json.loads(b) for b in stub.generation_bodies()]
        return r, bodies

    def test_a_cache_path_that_computes_otherwise_is_found(self):
        for engine in ("vllm", "sglang"):
            with self.subTest(engine=engine):
                r, _ = self.check(engine, "--expect", "cache-equal", cache_path_differs=True)
                self.assertEqual(r.code, 1, r)
                sm = r.json()["summary"]
                # vLLM's copies share the cache: a cold batch of several is partly warm, and
                # the verdict names the batches that compared nothing
                self.assertEqual(sm["cache_verdict"].split(";")[0], "cache hit differs from cold prefill")
                self.assertGreater(sm["cache_max_ulp"], 0)

    def test_one_that_does_not_passes_with_the_hit_proven(self):
        for engine in ("vllm", "sglang"):
            with self.subTest(engine=engine):
                r, bodies = self.check(engine, "--expect", "cache-equal")
                self.assertEqual(r.code, 0, r)
                sm = r.json()["summary"]
                self.assertEqual((sm["cache_verdict"].split(";")[0], sm["cache_max_ulp"], sm["cache_batches"]),
                                 ("cache hit equals cold prefill bitwise", 0, 3))
                rows = [run_ for size in r.json()["prompts"][0]["sizes"] for run_ in size["runs"]]
                self.assertTrue(all(row["cache_check"]["cached_tokens"] > 0 for row in rows))
                self.assertIn("expect cache-equal: held", r.stderr)
                # the repeat carries the cold request's key: that is what the cache serves
                key = "cache_salt" if engine == "vllm" else "extra_key"
                self.assertEqual([b[key] for b in bodies[0::2]], [b[key] for b in bodies[1::2]])

    def test_without_counts_or_counters_nothing_is_compared(self):
        # neither the answers nor the counters say whether the cold request was cold or the
        # repeat served: an unverified hit is no comparison of a hit with a cold prefill
        r, _ = self.check("vllm", "--expect", "cache-equal", prompt_tokens_details=False,
                          no_metrics=True)
        self.assertEqual(r.code, 1, r)
        verdict = r.json()["summary"]["cache_verdict"]
        self.assertTrue(verdict.startswith("nothing compared: whether the cold request was cold "
                                           "and the repeat served is not known"), verdict)
        self.assertEqual(r.json()["summary"]["checks_outcome"]["cache_check"], "uncompared")

    def test_without_counts_the_servers_counters_prove_the_hit(self):
        # the answers count nothing; the server's own counters saw every repeat served
        for config in ({"prompt_tokens_details": False}, {"uncounted_cache_hits": True}):
            with self.subTest(**config):
                r, _ = self.check("vllm", "--expect", "cache-equal", **config)
                self.assertEqual(r.code, 0, r)
                sm = r.json()["summary"]
                self.assertEqual(sm["cache_verdict"].split(";")[0],
                                 "cache hit equals cold prefill bitwise")
                rows = [run_ for size in r.json()["prompts"][0]["sizes"]
                        for run_ in size["runs"]]
                self.assertTrue(all(row["cache_check"]["cached_tokens"] > 0 for row in rows))

    def test_an_uncounted_hit_is_found_differing(self):
        # the server serves the repeat from its cache, says 0 cached tokens, and its cache
        # path computes otherwise: the counters prove the hit, and the difference is found
        r, _ = self.check("vllm", "--expect", "cache-equal", uncounted_cache_hits=True,
                          cache_path_differs=True)
        self.assertEqual(r.code, 1, r)
        self.assertEqual(r.json()["summary"]["cache_verdict"].split(";")[0],
                         "cache hit differs from cold prefill")

    def test_a_server_without_a_cache_misses(self):
        r, _ = self.check("sglang", prefix_caching=False)
        self.assertEqual(r.code, 0, r)
        self.assertEqual(r.json()["summary"]["cache_verdict"],
                         "nothing compared: the repeat was not served from the cache (cached-token count 0)")

    def test_a_cold_request_served_from_the_cache_compares_nothing(self):
        def compared(cold, warm):
            # the cache states as cache_states decides them from these counts
            return run.CacheComparison(0, None, False, (), None, warm, cold, cold == 0, warm > 0)

        every_cold_hit = run.CacheSummary.of([compared(19, 19), compared(19, 19)])
        self.assertEqual(every_cold_hit.verdict,
                         "nothing compared: every cold request was itself served from the cache")
        held, line = run.check_expectation(run.CacheCheck(True), "cache-equal",
                                           types.SimpleNamespace(checks={"cache_check": every_cold_hit}))
        self.assertFalse(held)
        one_cold = run.CacheSummary.of([compared(0, 19), compared(19, 19)])
        self.assertEqual((one_cold.verdict, one_cold.verified),
                         ("cache hit equals cold prefill bitwise; 1 of 2 batches compared nothing (their cold "
                          "request was itself served from the cache)", 1))

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
