"""The checks no other tool runs over HTTP, each one entry of run.py's SWEEP_CHECKS: a decode
beside its neighbours' prefills (--neighbours), the observer effect of asking for logprobs
(--observer-check), and every comparison's drift in nats beside its ULPs, with its flip
risk, each against a practice engine that can fail it."""

import json
import math
import unittest

from support import StubConfig, StubServer, TempDirTest, run, run_lab, short_sweep, sizes_of


def sweep(stub, *extra):
    return short_sweep(stub, "--sizes", "1,2", "--max-tokens", 16, *extra)


class NeighbourCheck(TempDirTest):
    def test_flag_off_moves_beside_a_long_prefill_and_flag_on_holds(self):
        found = {}
        for engine in ("vllm", "sglang"):
            for invariant in (False, True):
                with self.subTest(engine=engine, invariant=invariant), \
                        StubServer(StubConfig(engine=engine, invariant=invariant,
                                              scheduler_window=0.05)) as stub:
                    r = sweep(stub, "--neighbours", "16,64", "--json")
                    self.assertEqual(r.code, 0, r)
                    summary = r.json()["summary"]
                    lengths = {p["length"]: p for p in summary["neighbours_lengths"]}
                    found[engine, invariant] = summary["neighbours_verdict"]
                    for p in lengths.values():
                        self.assertEqual(p["runs"], run.NEIGHBOUR_RUNS)  # each overlapped
                        self.assertGreater(p["neighbours"], 0)
                    # the practice engine's tile: 16 tokens beside is within it, 64 is not
                    self.assertEqual(lengths[16]["equal"], run.NEIGHBOUR_RUNS)
                    self.assertEqual(lengths[64]["equal"],
                                     run.NEIGHBOUR_RUNS if invariant else 0)
                    row = sizes_of(r.json())[1]["runs"][0]["neighbours"]
                    self.assertEqual([p["length"] for p in row["lengths"]], [16, 64])
        self.assertEqual(found["vllm", False], "moved beside neighbours of 64 tokens")
        self.assertEqual(found["vllm", True], "held beside every neighbour length")

    def test_its_expectation_and_lines(self):
        with StubServer(StubConfig(invariant=True, scheduler_window=0.05)) as on, \
                StubServer(StubConfig(scheduler_window=0.05)) as off:
            held = sweep(on, "--neighbours", "64", "--expect", "neighbours-equal")
            failed = sweep(off, "--neighbours", "64", "--expect", "neighbours-equal")
        self.assertEqual(held.code, 0, held)
        self.assertIn("neighbour check, 64 tokens beside: 2 of 2 runs equal to the lone run",
                      held.stdout)
        self.assertIn("expect neighbours-equal: held", held.stdout)
        self.assertEqual(failed.code, 1, failed)
        self.assertIn("neighbour check: moved beside neighbours of 64 tokens", failed.stdout)

    def test_neighbours_are_prefill_only_token_prompts_with_a_key_each(self):
        with StubServer() as stub:
            r = sweep(stub, "--neighbours", "8")
            bodies = [json.loads(b) for b in stub.generation_bodies()]
        self.assertEqual(r.code, 0, r)
        neighbours = [b for b in bodies if b["max_tokens"] == 1]
        self.assertTrue(neighbours)
        self.assertTrue(all(len(b["prompt"]) == 8 and all(isinstance(t, int) for t in b["prompt"])
                            for b in neighbours))
        self.assertEqual(len({b["cache_salt"] for b in neighbours}), len(neighbours))

    def test_a_control_or_lone_run_the_cache_served_compares_nothing(self):
        # the cache kept: the lone run of the second pass, and every run again (the control
        # included), are served from the cache batch 1 filled; only the first lone run is cold
        with StubServer(StubConfig(prompt_tokens_details=True, scheduler_window=0.05)) as stub:
            r = short_sweep(stub, "--sizes", "1", "--repeat", 2, "--max-tokens", 16,
                            "--prefix-cache", "keep", "--neighbours", "16", "--json")
        self.assertEqual(r.code, 0, r)
        summary = r.json()["summary"]
        self.assertEqual(summary["neighbours_control_runs"], 0)
        length = summary["neighbours_lengths"][0]
        self.assertEqual((length["runs"], length["served"]), (0, 2 * run.NEIGHBOUR_RUNS))
        self.assertTrue(summary["neighbours_verdict"].startswith("nothing compared"),
                        summary["neighbours_verdict"])

    def test_bad_lengths_are_refused(self):
        for value in ("", "a", "0", "16,16", "1,,2"):
            with self.subTest(value=value):
                r = run_lab("--mode", "sweep", "--neighbours", value)
                self.assertEqual(r.code, 2, r)
                self.assertIn("--neighbours", r.stderr)
        r = run_lab("--mode", "sweep", "--expect", "neighbours-equal")
        self.assertEqual(r.code, 2, r)


class ObserverCheck(TempDirTest):
    def test_a_server_whose_text_moves_with_logprobs_is_caught(self):
        for engine in ("vllm", "sglang"):
            with self.subTest(engine=engine), \
                    StubServer(StubConfig(engine=engine)) as plain, \
                    StubServer(StubConfig(engine=engine, logprobs_path_differs=True)) as odd:
                held = sweep(plain, "--observer-check", "--expect", "observer-equal", "--json")
                moved = sweep(odd, "--observer-check", "--expect", "observer-equal", "--json")
            self.assertEqual(held.code, 0, held)
            self.assertEqual(held.json()["summary"]["observer_verdict"],
                             "the same text with and without logprobs")
            self.assertEqual(moved.code, 1, moved)
            self.assertTrue(moved.json()["summary"]["observer_verdict"].startswith(
                "the text changed when logprobs"))

    def test_runs_the_cache_served_compare_nothing(self):
        # the cache serves every prompt whatever its key, and says so: no run of the check
        # is compared, its control neither, and --expect observer-equal does not hold
        with StubServer(StubConfig(cache_serves="all", prompt_tokens_details=True)) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1", "--max-tokens", 8,
                        "--observer-check", "--expect", "observer-equal", "--save",
                        self.path("s.json"))
        self.assertEqual(r.code, 1, r)
        summary = self.load("s.json")["summary"]
        self.assertTrue(summary["observer_verdict"].startswith("nothing compared: top-0: "
                                                               "nothing compared (the cache "
                                                               "served, or may have served, "
                                                               "3 runs)"),
                        summary["observer_verdict"])
        runs = {s["logprobs"]: (s["runs"], s["served"]) for s in summary["observer_settings"]}
        self.assertEqual(runs, {None: (0, 3), 0: (0, 3), 5: (0, 3), 20: (0, 3)})
        line = next(l for l in r.stdout.splitlines() if l.startswith("observer check ("))
        self.assertIn("control 0/0 (3 the cache served, or may have)", line)
        self.assertIn("expectation failed: --expect observer-equal", r.stdout)

    def test_a_kept_cache_whose_counts_are_not_said_compares_nothing(self):
        # --prefix-cache keep: the same prompt again may be served by the cache batch 1
        # filled; where the server gives no count that is not known, and nothing is compared.
        # Under the bypass a request with a fresh key is computed, as the sweep trusts it.
        with StubServer() as stub:
            kept = short_sweep(stub, "--sizes", "1", "--prefix-cache", "keep",
                               "--observer-check", "--json")
            bypassed = short_sweep(stub, "--sizes", "1", "--observer-check", "--json")
        self.assertTrue(kept.json()["summary"]["observer_verdict"].startswith(
            "nothing compared"), kept.stdout)
        self.assertEqual(bypassed.json()["summary"]["observer_verdict"],
                         "the same text with and without logprobs")


class DriftInNats(TempDirTest):
    def test_a_flag_off_sweep_saves_its_drift_and_flip_risk(self):
        with StubServer() as stub:
            doc = short_sweep(stub, "--sizes", "1,2,5", "--json").json()
        summary, size2 = doc["summary"], sizes_of(doc)[2]
        self.assertGreater(summary["max_nats"], 0.0)
        self.assertLess(summary["max_nats"], 1e-3)  # a few float32 ULPs of a logprob near -1
        self.assertGreater(summary["flip_risk"], 0.0)
        self.assertLessEqual(summary["flip_risk"], 1.0)
        self.assertGreater(size2["max_nats"], 0.0)
        self.assertEqual(size2["max_nats"], max(r["max_nats"] for r in size2["runs"]))

    def test_nothing_moved_is_no_drift_and_no_risk(self):
        with StubServer(StubConfig(invariant=True)) as stub:
            doc = short_sweep(stub, "--sizes", "1,2", "--json").json()
        self.assertEqual((doc["summary"]["max_nats"], doc["summary"]["flip_risk"]), (0.0, 0.0))

    def test_the_nats_are_the_largest_logprob_difference(self):
        base = run.Completion("ab", ["a", "b"], [-1.0, -2.0], [{"a": -1.0, "x": -1.5},
                                                               {"b": -2.0, "y": -2.25}])
        other = run.Completion("ab", ["a", "b"], [-1.0, -2.125], [{"a": -1.0, "x": -1.5},
                                                                  {"b": -2.125, "y": -2.25}])
        delta = run.compare_completions(base, other)
        self.assertEqual(delta.max_nats, 0.125)
        # margins 0.5 and 0.25: a drift of 0.125 is within neither; 0.25 is within one
        self.assertEqual(run.flip_risk(base, 0.125), 0.0)
        self.assertEqual(run.flip_risk(base, 0.25), 0.5)


class DriftWithoutABound(unittest.TestCase):
    def test_a_prefill_logprob_far_above_the_decodes_is_an_infinite_kl_term(self):
        kl = run.KlEstimate()
        kl.add([-2000.0], [-0.5], ())
        self.assertEqual((kl.divergent, kl.largest), (1, math.inf))


if __name__ == "__main__":
    unittest.main()
