"""The experiment against an earlier run (BASELINE=DIR): each flag-on sweep runs again with
the earlier run's matching sweep as its --baseline, and REPORT.md says what run.py's saved
verdict found, naming both sides; a BASELINE that is no earlier run's folder is refused before
any arm starts."""

import os
import unittest

from test_launch import Experiment

QUICK = "--sizes 1,2 --max-tokens 8 --repeat 2"


class AgainstAnEarlierRun(Experiment):
    def test_each_flag_on_sweep_against_the_earlier_runs(self):
        code, out, err = self.finish(self.start(SWEEP_ARGS=QUICK))
        self.assertEqual(code, 0, err)
        earlier = self.run_path()
        code, out, err = self.finish(self.start(SWEEP_ARGS=QUICK, BASELINE=earlier))
        self.assertEqual(code, 0, err)
        doc = self.load_run("tp1", "sweep_on_vs_baseline.json")
        self.assertEqual(doc["baseline"]["file"], os.path.join(earlier, "tp1", "sweep_on.json"))
        verdict = doc["baseline"]["verdict"]
        self.assertTrue(verdict.startswith(
            "flag on: the same tokens and logprobs as the baseline measured on 1 x NVIDIA H200, "
            "vLLM 0.26.0 (this sweep: 1 x NVIDIA H200, vLLM 0.26.0;"), verdict)
        report = self.load_run("REPORT.md")
        self.assertTrue(report.startswith("# Batch-invariance experiment, vllm: complete"),
                        report[:300])
        section = report[report.index("## Against the earlier run (BASELINE)"):]
        self.assertIn("- TP 1, concurrent requests: %s." % verdict, section)
        self.assertIn("flag-on sweep, concurrent requests, against BASELINE", report)
        # each finding's count of moved against compared, with the interval run.py saved
        moved = self.load_run("tp1", "sweep_on.json")["summary"]["moved"]
        self.assertIn("moved from the baseline: %d of %d computed completions (95%% CI 0-"
                      % (moved["moved"], moved["compared"]), report)
        self.assert_no_server_left()

    def test_a_folder_of_no_earlier_run_is_refused_before_anything_starts(self):
        os.makedirs(self.path("empty"))
        for folder, words in ((self.path("missing"), "is not a folder"),
                              (self.path("empty"), "holds no flag-on sweep")):
            with self.subTest(folder=folder):
                code, out, err = self.finish(self.start(BASELINE=folder))
                self.assertEqual(code, 2, err)
                self.assertIn("BASELINE=%s %s" % (folder, words), err)
                self.assertEqual(self.runs(), [])


if __name__ == "__main__":
    unittest.main()
