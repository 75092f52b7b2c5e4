"""Every rate with its interval: one function gives the exact (Clopper-Pearson) 95 % interval
of k of n, checked here against the closed forms at 0 of n and n of n and against published
values at k of n; each count of moved against compared is saved with its interval and printed
where the count is, and an interval from too few comparisons is said to be wide."""

import math
import unittest

from support import StubConfig, StubServer, TempDirTest, run, short_sweep, sizes_of


class ExactInterval(unittest.TestCase):
    def test_none_of_n_has_the_closed_form_upper_bound(self):
        # at k = 0 the upper bound solves (1 - p)^n = 0.025
        for n in (1, 6, 20, 666, 10000):
            low, high = run.rate_interval(0, n)
            self.assertEqual(low, 0.0)
            self.assertAlmostEqual(high, 1 - 0.025 ** (1 / n), places=9)
        self.assertAlmostEqual(run.rate_interval(0, 666)[1], 0.0055, places=4)  # about 0.55 %

    def test_n_of_n_has_the_closed_form_lower_bound(self):
        # at k = n the lower bound solves p^n = 0.025
        for n in (1, 6, 20, 666):
            low, high = run.rate_interval(n, n)
            self.assertEqual(high, 1.0)
            self.assertAlmostEqual(low, 0.025 ** (1 / n), places=9)
        self.assertAlmostEqual(run.rate_interval(6, 6)[0], 0.5407, places=4)  # about 54 %

    def test_k_of_n_matches_published_values(self):
        # Clopper-Pearson 95 % bounds as tabulated (R's binom.test), and 1 of 2's closed form
        for (k, n), (low, high) in {(3, 10): (0.06673951, 0.65245285),
                                    (50, 100): (0.39832113, 0.60167887),
                                    (1, 2): (1 - 0.975 ** 0.5, 0.975 ** 0.5)}.items():
            got = run.rate_interval(k, n)
            self.assertAlmostEqual(got[0], low, places=6, msg=(k, n))
            self.assertAlmostEqual(got[1], high, places=6, msg=(k, n))

    def test_k_of_n_leaves_two_and_a_half_percent_in_each_binomial_tail(self):
        # the definition, summed term by term: at the lower bound k or more are that likely,
        # at the upper bound k or fewer
        def at_most(k, n, p):
            return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1))
        for k, n in ((5, 666), (1, 30), (17, 40), (299, 300)):
            low, high = run.rate_interval(k, n)
            self.assertAlmostEqual(1 - at_most(k - 1, n, low), 0.025, places=7, msg=(k, n))
            self.assertAlmostEqual(at_most(k, n, high), 0.025, places=7, msg=(k, n))

    def test_k_and_n_minus_k_mirror_each_other(self):
        low, high = run.rate_interval(7, 40)
        mirror = run.rate_interval(33, 40)
        self.assertAlmostEqual(low, 1 - mirror[1], places=9)
        self.assertAlmostEqual(high, 1 - mirror[0], places=9)

    def test_nothing_compared_has_no_interval(self):
        self.assertIsNone(run.rate_interval(0, 0))
        self.assertEqual(run.Rate.of(0, 0).interval(), "no interval: nothing compared")

    def test_too_few_comparisons_are_said_to_be_wide(self):
        self.assertTrue(run.Rate.of(6, 6).wide)
        self.assertIn("wide", run.Rate.of(6, 6).text())
        self.assertFalse(run.Rate.of(0, 666).wide)
        self.assertEqual(run.Rate.of(0, 666).text("completions"),
                         "0 of 666 completions (95% CI 0-0.55%)")
        self.assertEqual(run.Rate.of(6, 6).text(), "6 of 6 (95% CI 54-100%, wide)")


class SavedAndPrinted(TempDirTest):
    def test_a_sweep_saves_and_prints_each_rate_beside_its_count(self):
        with StubServer(StubConfig()) as stub:
            r = short_sweep(stub, "--sizes", "1,2,17", "--repeat", 2, "--neighbours", "50",
                            "--traffic", "concurrent",
                            "--observer-check", "--prefill-check", "--save", self.path("s.json"))
        self.assertIn(r.code, (0, 1), r)
        doc = self.load("s.json")
        summary = doc["summary"]
        moved = summary["moved"]
        self.assertGreater(moved["compared"], 0)
        low, high = run.rate_interval(moved["moved"], moved["compared"])
        self.assertEqual((moved["low"], moved["high"]), (low, high))
        self.assertIn("moved from the baseline: %d of %d computed completions (95%% CI"
                      % (moved["moved"], moved["compared"]), r.stdout)
        sizes = doc["prompts"][0]["sizes"]
        self.assertNotIn("diverged", sizes[0])  # batch 1 is the baseline
        self.assertEqual(sum(s["diverged"]["moved"] for s in sizes[1:]), moved["moved"])
        self.assertEqual(sum(s["diverged"]["compared"] for s in sizes[1:]), moved["compared"])
        for size in sizes:
            runs = size["runs_moved"]
            self.assertEqual(runs["moved"], len(size["runs"]) - size["runs_matched"])
        self.assertEqual(summary["prefill_divergent_rate"]["compared"], summary["prefill_tokens"])
        self.assertIn("prefill check, decoded tokens whose logprob differs from the prefill's: ",
                      r.stdout)
        self.assertIn("moved_rate", summary["neighbours_lengths"][0])
        self.assertIn("neighbour check, 50 tokens beside: ", r.stdout)
        self.assertIn("(moved: 95% CI 0-", r.stdout)
        self.assertTrue(all("changed_rate" in s for s in summary["observer_settings"]))
        self.assertIn("[changed: 95% CI 0-", r.stdout)

    def test_the_sizes_rates_are_in_the_table(self):
        with StubServer(StubConfig()) as stub:
            r = short_sweep(stub, "--sizes", "1,17", "--repeat", 2, "--json", "--traffic",
                            "concurrent")
        doc = r.json()
        size = sizes_of(doc)[17]
        self.assertIn("diverged", size)
        with StubServer(StubConfig()) as stub:
            r = short_sweep(stub, "--sizes", "1,17", "--repeat", 2, "--traffic", "concurrent")
        row = [line for line in r.stdout.splitlines() if line.strip().startswith("17 ")][0]
        self.assertIn("%", row)


if __name__ == "__main__":
    unittest.main()
