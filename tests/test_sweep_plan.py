"""The sweep as a plan: per prompt and pass, batch 1 first whatever order --sizes gives, the
baseline from batch 1 only (or from the file or server --baseline names), and --expect
invariant only where batch 1 can be repeated (the run-to-run control)."""

import json
import unittest

from support import StubConfig, StubServer, TempDirTest, run_lab, short_sweep, sizes_of


class BatchOneFirst(TempDirTest):
    def test_sizes_given_largest_first_on_a_flag_off_server_are_not_invariant(self):
        # Flag off, batch 4 computes another way than batch 1: sent first, it must not be
        # taken for the baseline, and size 1 must not be left out of the evidence
        with StubServer(StubConfig()) as stub:
            r = short_sweep(stub, "--sizes", "4,1", "--repeat", 2, "--expect", "invariant",
                            "--save", self.path("s.json"))
            given_first = stub.generation_bodies()[0]
        self.assertEqual(r.code, 1, r)
        doc = self.load("s.json")
        self.assertNotEqual(doc["summary"]["verdict"], "invariant")
        self.assertIn("expectation failed: --expect invariant", r.stdout)
        self.assertEqual(doc["params"]["sizes"], [1, 4])
        self.assertEqual(doc["prompts"][0]["baseline_source"], "batch 1")
        self.assertEqual(list(sizes_of(doc)), [1, 4])
        # the first request the server saw is batch 1: one prompt
        self.assertEqual(len(json.loads(given_first)["prompt"]), 1)

    def test_either_order_gives_one_verdict(self):
        with StubServer(StubConfig()) as stub:
            verdicts = [short_sweep(stub, "--sizes", sizes, "--repeat", 2, "--json")
                        .json()["summary"]["verdict"] for sizes in ("4,1", "1,4")]
        self.assertEqual(verdicts[0], verdicts[1])


class InvariantNeedsTheControl(TempDirTest):
    def test_one_pass_cannot_pass_expect_invariant(self):
        with StubServer(StubConfig(invariant=True)) as stub:
            r = short_sweep(stub, "--sizes", "1,4", "--expect", "invariant")
            self.assertEqual(stub.generation_bodies(), [])
        self.assertEqual(r.code, 2, r)
        self.assertIn("--expect invariant needs --repeat 2 or more", r.stderr)
        self.assertNotIn("Traceback", r.stderr)

    def test_two_passes_can(self):
        with StubServer(StubConfig(prefix_caching=False, invariant=True)) as stub:
            r = short_sweep(stub, "--sizes", "1,4", "--repeat", 2, "--expect", "invariant")
        self.assertEqual(r.code, 0, r)
        self.assertIn("expect invariant: held", r.stdout)


if __name__ == "__main__":
    unittest.main()
