"""Pure functions of run.py: ULPs, comparisons, ladders, statistics, workloads, request bodies."""

import json
import math
import random
import statistics
import struct
import unittest
from unittest import mock

from support import fixture, run, ulps32

Completion = run.Completion


def next_f32(x, steps=1):
    """The float32 `steps` representable values above x (x a positive float32)."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    return struct.unpack("<f", struct.pack("<I", bits + steps))[0]


class UlpDistance(unittest.TestCase):
    def test_adjacent_float32_values_are_one_apart(self):
        self.assertEqual(run.ulp_distance(1.0, next_f32(1.0)), 1)
        self.assertEqual(run.ulp_distance(-4.645697593688965, -next_f32(4.645697593688965, 7)), 7)

    def test_signed_zeros_are_zero_apart_and_order_crosses_the_sign(self):
        self.assertEqual(run.ulp_distance(-0.0, 0.0), 0)
        tiny = struct.unpack("<f", struct.pack("<I", 1))[0]  # smallest subnormal
        self.assertEqual(run.ulp_distance(-tiny, tiny), 2)
        self.assertEqual(run.ulp_distance(-tiny, 0.0), 1)

    def test_agrees_with_an_independent_formulation(self):
        values = [-9.5, -4.645697593688965, -1e-30, -0.0, 0.0, 3e-39, 1.0, 123.25]
        for a in values:
            for b in values:
                with self.subTest(a=a, b=b):
                    self.assertEqual(run.ulp_distance(a, b), ulps32(a, b))

    def test_float64_width(self):
        self.assertEqual(run.ulp_distance(1.0, math.nextafter(1.0, 2.0) if hasattr(math, "nextafter")
                                          else 1.0 + 2.0 ** -52, 64), 1)

    def test_clamp_and_non_finite_are_reported_not_crashed(self):
        clamps = run.VllmAdapter.logprob_clamps
        self.assertEqual(run.logprob_distance(-9999.0, -9999.0, clamps), (0, "float32"))
        self.assertEqual(run.logprob_distance(-9999.0, -12.5, clamps), (None, "clamped"))
        self.assertEqual(run.logprob_distance(float("-inf"), -1.0), (None, "non-finite"))
        self.assertEqual(run.logprob_distance(float("nan"), float("nan"))[0], None)

    def test_values_that_are_not_float32_are_measured_in_float64(self):
        a = -0.1  # not a float32 value
        ulps, unit = run.logprob_distance(a, a * (1 + 2 ** -50))
        self.assertEqual(unit, "float64")
        self.assertGreater(ulps, 0)
        self.assertTrue(run.is_float32_exact(-4.645697593688965))
        self.assertFalse(run.is_float32_exact(-0.1))


def comp(tokens, logprobs, tops, text=None):
    return Completion(text if text is not None else "".join(tokens), list(tokens), list(logprobs),
                      [dict(t) for t in tops])


class CompareCompletions(unittest.TestCase):
    def setUp(self):
        self.lp = [-1.25, -2.5, -0.75, -3.0]
        self.base = comp("abcd", self.lp, [{"a": -1.25, "x": -2.0}, {"b": -2.5, "y": -2.75},
                                           {"c": -0.75, "z": -4.0}, {"d": -3.0}])

    def test_identical(self):
        d = run.compare_completions(self.base, comp("abcd", self.lp, self.base.top_logprobs))
        self.assertEqual((d.first_token_divergence, d.max_ulp, d.first_ulp_step), (None, 0, None))

    def test_before_divergence_chosen_and_shared_topk_count(self):
        other = comp("abcd", [-1.25, -next_f32(2.5, 3), -0.75, -3.0],
                     [{"a": -1.25, "x": -next_f32(2.0, 9)}, {"b": -next_f32(2.5, 3), "y": -2.75},
                      {"c": -0.75, "q": -1.0}, {"d": -3.0}])
        d = run.compare_completions(self.base, other)
        self.assertEqual(d.first_token_divergence, None)
        self.assertEqual(d.max_ulp, 9)       # the shared top-k token "x" at step 0
        self.assertEqual(d.first_ulp_step, 0)

    def test_at_divergence_only_shared_topk_after_it_nothing(self):
        # Step 1 diverges: the chosen logprobs there (-2.5 vs -7.0) are NOT compared, the
        # shared top-k token "y" is; step 2's huge difference is after the divergence.
        other = comp("aYcd", [-1.25, -7.0, -0.1, -9.0],
                     [{"a": -1.25, "x": -2.0}, {"Y": -7.0, "y": -next_f32(2.75, 5)},
                      {"c": -0.1}, {"d": -9.0}])
        d = run.compare_completions(self.base, other)
        self.assertEqual(d.first_token_divergence, 1)
        self.assertEqual(d.max_ulp, 5)
        self.assertEqual(d.first_ulp_step, 1)

    def test_an_early_end_is_a_divergence(self):
        other = comp("ab", self.lp[:2], self.base.top_logprobs[:2])
        d = run.compare_completions(self.base, other)
        self.assertEqual(d.first_token_divergence, 2)
        self.assertEqual(d.max_ulp, 0)

    def test_zero_logprobs_and_signed_zeros(self):
        tiny = struct.unpack("<f", struct.pack("<I", 1))[0]
        base = comp("ab", [0.0, -1.5], [{}, {}])
        self.assertEqual(run.compare_completions(base, comp("ab", [-0.0, -1.5], [{}, {}])).max_ulp, 0)
        d = run.compare_completions(base, comp("ab", [-tiny, -1.5], [{}, {}]))
        self.assertEqual((d.max_ulp, d.first_ulp_step), (1, 0))
        d = run.compare_completions(base, comp("ab", [tiny, -1.5], [{}, {}]))  # a positive one: slow path
        self.assertEqual((d.max_ulp, d.first_ulp_step), (1, 0))

    def test_clamped_value_is_flagged(self):
        other = comp("abcd", [-9999.0] + self.lp[1:], self.base.top_logprobs)
        d = run.compare_completions(self.base, other, run.VllmAdapter.logprob_clamps)
        self.assertIn("clamped", d.ulp_notes)
        self.assertEqual(d.first_ulp_step, 0)
        self.assertEqual(run.verdict(run.Measured(2, 1, moved=True, compared=True)),
                         "logprobs moved but tokens held")


class FastPathAgreesWithThePairByPairRule(unittest.TestCase):
    """compare_completions counts most ULPs in bulk; it must agree with ulp_distance pair by pair."""

    def random_completion(self, rng, steps, shift=0, zero_at=None):
        lps, tops = [], []
        for t in range(steps):
            vals = sorted((-rng.uniform(0.0, 6.0) for _ in range(4)), reverse=True)
            vals = [struct.unpack("<f", struct.pack("<f", v))[0] for v in vals]
            if t == zero_at:
                vals[0] = 0.0
            vals = [v if shift == 0 or v == 0.0 else -next_f32(-v, rng.randrange(shift + 1)) for v in vals]
            lps.append(vals[0])
            tops.append({"t%d" % k: v for k, v in enumerate(vals)})
        return comp(["x"] * steps, lps, tops, text="x")

    def slow(self, base, other):
        worst, first = 0, None
        for t in range(len(base.tokens)):
            pairs = [(base.logprobs[t], other.logprobs[t])] + [
                (base.top_logprobs[t][k], other.top_logprobs[t][k]) for k in base.top_logprobs[t]]
            for a, b in pairs:
                d = ulps32(a, b)
                worst = max(worst, d)
                if d and first is None:
                    first = t
        return worst, first

    def test_random_completions(self):
        rng = random.Random(3)
        for trial in range(200):
            steps = rng.randrange(1, 12)
            zero_at = rng.choice([None, 0, steps - 1])
            base = self.random_completion(random.Random(trial), steps, 0, zero_at)
            other = self.random_completion(random.Random(trial), steps, rng.choice([0, 1, 3, 40]), zero_at)
            with self.subTest(trial=trial):
                d = run.compare_completions(base, other)
                self.assertEqual((d.max_ulp, d.first_ulp_step), self.slow(base, other))


    def test_exotic_values_give_what_the_pair_by_pair_rule_gives(self):
        # Every value the bulk path must recognise as its own case or hand over: zeros of
        # both signs, subnormals, clamps, infinities, NaN, positives, float64 values, ints.
        exotic = [0.0, -0.0, -1e-45, -1.2e-38, -9999.0, -3.4028234663852886e38, -math.inf, math.inf,
                  math.nan, 0.5, -0.1, -2.0 ** -200, -2.0 ** 200, -1e300, -3, 0]
        rng = random.Random(5)
        for trial in range(300):
            steps = rng.randrange(1, 6)
            base = self.random_completion(random.Random(trial), steps)
            other = self.random_completion(random.Random(trial), steps, rng.choice([0, 1, 7]))
            for c in (base, other):
                for _ in range(rng.randrange(3)):
                    t = rng.randrange(steps)
                    key = rng.choice(list(c.top_logprobs[t]))
                    c.top_logprobs[t][key] = value = rng.choice(exotic)
                    if key == "t0":
                        c.logprobs[t] = value
            clamps = rng.choice([(), (-9999.0,), (-3.4028234663852886e38,)])
            with self.subTest(trial=trial):
                bulk = run.compare_completions(base, other, clamps)
                fresh = [run.Completion(c.text, c.tokens, c.logprobs, c.top_logprobs) for c in (base, other)]
                with mock.patch.object(run, "negative_float32_bits", lambda values, clamps: None):
                    pairwise = run.compare_completions(*fresh, clamps)
                self.assertEqual(bulk, pairwise)


class SavedText(unittest.TestCase):
    def test_a_document_written_in_pieces_is_the_document_written_at_once(self):
        docs = [{"schema": "s", "prompts": [], "summary": {"n": 0}},
                {"schema": "s", "prompts": [{"a": math.nan, "t": "\u00e9\u0000 \"prompts\": []"},
                                             {"b": [1, 2.5, -math.inf]}], "z": {"k": [math.nan]}}]
        for doc in docs:
            with self.subTest(doc=doc):
                self.assertEqual("".join(run.json_chunks(doc, "prompts")), run.json_text(doc))


class LaddersAndBuckets(unittest.TestCase):
    def test_vllm_capture_sizes(self):
        self.assertEqual(run.VllmAdapter.capture_sizes(32), [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64])
        big = run.VllmAdapter.capture_sizes(512)
        self.assertEqual(big[-3:], [480, 496, 512])
        self.assertIn(256, big)
        self.assertNotIn(264, big)

    def test_ladder_straddles_every_capture_size(self):
        ladder = run.straddling_ladder(32, run.VllmAdapter.capture_sizes(32))
        self.assertEqual(ladder, [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 23, 24, 25, 31, 32])
        self.assertEqual(run.straddling_ladder(25, run.SglangAdapter.GRAPH_SIZES),
                         [1, 2, 3, 4, 5, 7, 8, 9, 11, 12, 13, 15, 16, 17, 23, 24, 25])

    def test_bucket_padding_and_none_above_the_largest(self):
        sizes = run.VllmAdapter.capture_sizes(32)
        self.assertEqual([run.graph_bucket(n, sizes) for n in (15, 17, 23, 25)], [16, 24, 24, 32])
        self.assertIsNone(run.graph_bucket(65, sizes))
        self.assertEqual(run.graph_bucket(9, run.SglangAdapter.GRAPH_SIZES), 12)

    def test_parse_sizes(self):
        self.assertEqual(run.parse_sizes("1,15, 16,17"), [1, 15, 16, 17])
        for bad in ("", "1,,2", "0,1", "-3", "a,b", "1,2,1", "1.5", "1,\u00b2", "\u0661"):
            with self.subTest(bad=bad), self.assertRaises(run.UsageError):
                run.parse_sizes(bad)

    def test_verdict_words(self):
        m = run.Measured
        self.assertEqual(run.verdict(m(2, 1, compared=True)), "invariant")
        self.assertEqual(run.verdict(m(2, 1, 3, moved=True, compared=True)), "logprobs moved but tokens held")
        self.assertEqual(run.verdict(m(2, 2, 3, True, moved=True, compared=True)), "tokens diverged")
        self.assertEqual(run.verdict(m(2, 2, text_only=True, moved=True, compared=True)), "text differs, tokens equal")
        self.assertEqual(run.verdict(m(2, 2, 3, True, text_only=True, moved=True, compared=True)), "tokens diverged")
        # what the cache served compares nothing, in either direction
        self.assertEqual(run.verdict(m(3, 1, served_sizes=[2])), "nothing compared: the cache served every request above batch 1")
        self.assertEqual(run.verdict(m(3, 2, 3, served_moved=True, served_sizes=[2])),
                         "moved only where the cache served (bypass did not hold)")
        self.assertEqual(run.verdict(m(3, 2, 3, True, moved=True, compared=True, served_moved=True, served_sizes=[2])),
                         "tokens diverged")
        self.assertEqual(run.verdict(m(1, 1)), "nothing compared")  # batch 1 alone is no comparison
        self.assertEqual(run.verdict(m(0, 0, compared=True)), "no data")


class Statistics(unittest.TestCase):
    def test_median_and_mad(self):
        self.assertEqual(run.mad([1.0, 2.0, 3.0, 4.0, 100.0]), 1.0)
        self.assertEqual(run.mad([5.0, 5.0, 5.0]), 0.0)

    def test_known_overhead_is_recovered_with_an_interval_around_it(self):
        off = [1.0, 1.1, 0.9, 1.05, 0.95, 1.02, 0.98, 1.01]
        noise = [1.01, 0.99, 1.02, 0.98, 1.0, 1.01, 0.99, 1.0]
        on = [a * 1.3 * n for a, n in zip(off, noise)]
        stats = run.Overhead.of(off, on)
        self.assertAlmostEqual(stats.pct, 30.0, delta=0.5)
        lo, hi = stats.ci95_pct
        self.assertTrue(lo <= 30.0 <= hi, (lo, hi))
        self.assertTrue(stats.significant)

    def test_no_overhead_is_not_significant(self):
        off = [1.0, 1.1, 0.9, 1.05, 0.95, 1.02, 0.98, 1.01]
        on = [a * n for a, n in zip(off, [1.03, 0.97, 1.02, 0.98, 1.01, 0.99, 1.04, 0.96])]
        stats = run.Overhead.of(off, on)
        self.assertFalse(stats.significant)
        self.assertLessEqual(stats.ci95_pct[0], 0.0)

    def test_bootstrap_follows_its_seed(self):
        # The interval, recomputed here from the documented recipe: resample with
        # random.Random(seed), take the medians' 2.5th and 97.5th percentiles.
        data = [1.1, 1.3, 1.2, 1.25, 1.4, 1.15]
        rng = random.Random(run.BOOTSTRAP_SEED)
        meds = sorted(statistics.median([data[rng.randrange(6)] for _ in range(6)]) for _ in range(4000))
        self.assertEqual(run.bootstrap_median_ci(data), (meds[int(0.025 * 3999)], meds[int(math.ceil(0.975 * 3999))]))

    def test_noise_flag(self):
        self.assertTrue(run.ArmStats.of([1.0, 1.6], [10, 10]).noisy)
        self.assertFalse(run.ArmStats.of([1.0, 1.4], [10, 10]).noisy)


class Workloads(unittest.TestCase):
    def test_cold_openings_are_distinct_across_prompts_and_trials(self):
        openings = set()
        for trial in range(-2, 5):
            for p in run.workload_prompts("cold", 8, trial, "abcd1234"):
                openings.add(p.split("]")[0])
        self.assertEqual(len(openings), 7 * 8)
        other_run = run.workload_prompts("cold", 8, 0, "ffff0000")
        self.assertTrue(openings.isdisjoint(p.split("]")[0] for p in other_run))

    def test_shared_prefix_is_the_same_for_every_prompt_and_trial(self):
        prompts = run.workload_prompts("shared-prefix", 4, 0, "x", 1000) + \
            run.workload_prompts("shared-prefix", 4, 7, "y", 1000)
        prefixes = {p.split("\nQuestion")[0] for p in prompts}
        self.assertEqual(len(prefixes), 1)
        self.assertGreaterEqual(len(prefixes.pop().split()), 1000)
        self.assertEqual(len(set(prompts)), 8)

    def test_cost_bodies_are_exactly_these_bytes(self):
        # Both arms are sent these bytes; nothing in them may vary between calls.
        sampling = run.Sampling.of(0.0, 128, None, 42, ignore_eos=True)
        prompts = run.workload_prompts("cold", 2, 3, "r")
        self.assertEqual(prompts, ["[r.3.0] Write a short story about fox jumps over a lazy dog.",
                                   "[r.3.1] Write a short story about jumps over a lazy dog while."])
        expected = {
            "vllm": '{"model": "m", "prompt": %s, "max_tokens": 128, "temperature": 0.0, "top_p": 1.0, '
                    '"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "ignore_eos": true}'
                    % json.dumps(prompts),
            "sglang": '{"text": %s, "sampling_params": {"temperature": 0.0, "top_p": 1.0, "top_k": -1, '
                      '"min_p": 0.0, "repetition_penalty": 1.0, "max_new_tokens": 128, "ignore_eos": true}, '
                      '"stream": false}' % json.dumps(prompts)}
        for name, adapter in run.ADAPTERS.items():
            with self.subTest(engine=name):
                self.assertEqual(json.dumps(adapter.body("m", prompts, sampling)), expected[name])

    def test_the_seed_is_sent_only_when_sampling(self):
        self.assertIsNone(run.Sampling.of(0.0, 8, 5, 42).seed)
        self.assertEqual(run.Sampling.of(0.6, 8, 5, 42).seed, 42)
        self.assertEqual(run.as_record(run.Sampling.of(0.6, 8, 5, 42, ignore_eos=True)),
                         {"temperature": 0.6, "top_p": 1.0, "max_tokens": 8, "logprobs": 5, "seed": 42,
                          "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0})

    def test_request_bodies_carry_what_the_engines_need(self):
        s = run.Sampling(0.6, 1.0, 8, 5, seed=42, ignore_eos=True)
        v = run.ADAPTERS["vllm"].body("m", ["p", "p"], s)
        self.assertEqual(v, {"model": "m", "prompt": ["p", "p"], "max_tokens": 8, "temperature": 0.6,
                             "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                             "logprobs": 5, "return_tokens_as_token_ids": True,
                             "seed": 42, "ignore_eos": True})
        g = run.ADAPTERS["sglang"].body("m", ["p", "p"], s)
        self.assertEqual(g, {"text": ["p", "p"], "stream": False, "return_logprob": True,
                             "top_logprobs_num": 5,
                             "sampling_params": {"temperature": 0.6, "top_p": 1.0, "top_k": -1,
                                                 "min_p": 0.0, "repetition_penalty": 1.0,
                                                 "max_new_tokens": 8, "sampling_seed": 42,
                                                 "ignore_eos": True}})


class Adapters(unittest.TestCase):
    def test_real_vllm_answer_becomes_completion_records(self):
        answer = fixture("completions_two_prompts_logprobs3_token_ids.json")
        comps = run.ADAPTERS["vllm"].completions(answer, 2, True)
        self.assertEqual(len(comps), 2)
        self.assertEqual(comps[0].text, "outvarianimport {}varian")
        self.assertEqual(comps[0].tokens[:2], ["token_id:403", "token_id:481"])
        self.assertEqual(comps[0].top_logprobs[1]["token_id:1651"], -5.111370086669922)
        self.assertIs(run.compare_completions(comps[0], comps[1]), run.IDENTICAL)
        self.assertTrue(all(run.is_float32_exact(x) for x in comps[0].logprobs))

    def test_sglang_answer_becomes_the_same_record(self):
        answer = [{"text": " a b", "output_ids": [7, 9], "meta_info": {
            "finish_reason": {"type": "length", "length": 2}, "completion_tokens": 2,
            "output_token_logprobs": [[-0.5, 7, None], [-1.25, 9, None]],
            "output_top_logprobs": [[[-0.5, 7, None], [-1.5, 3, None]], None]}}]
        c = run.ADAPTERS["sglang"].completions(answer, 1, True)[0]
        self.assertEqual(c.tokens, ["token_id:7", "token_id:9"])
        self.assertEqual(c.logprobs, [-0.5, -1.25])
        self.assertEqual(c.top_logprobs, [{"token_id:7": -0.5, "token_id:3": -1.5}, {}])
        self.assertEqual(c.finish_reason, "length")


if __name__ == "__main__":
    unittest.main()
