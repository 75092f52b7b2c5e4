"""--baseline: a stored sweep or another server as the baseline, refused when malformed."""

import copy
import json
import unittest

from support import StubConfig, StubServer, TempDirTest, short_sweep, sizes_of


class MalformedBaselines(TempDirTest):
    def test_each_malformed_field_is_refused_before_any_request(self):
        with StubServer(StubConfig()) as stub:
            self.assertEqual(short_sweep(stub, "--sizes", "1,2", "--save", self.path("good.json")).code, 0)
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
                    r = short_sweep(stub, "--sizes", "1,2", "--baseline", path)
                    self.assertEqual(r.code, 2, r)
                    self.assertEqual(len(stub.requests), before)  # refused before any request
                    self.assertIn(words, r.stderr)
                    self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)

class BaselinesThatMatch(TempDirTest):
    def test_a_baseline_with_other_top_k_lists_is_refused(self):
        with StubServer(StubConfig(invariant=True)) as stub:
            self.assertEqual(short_sweep(stub, "--sizes", "1,2", "--save", self.path("k5.json")).code, 0)
            r = short_sweep(stub, "--sizes", "1,2", "--logprobs", 2, "--baseline", self.path("k5.json"))
        self.assertEqual(r.code, 2, r)
        self.assertIn("was recorded with logprobs=5, this sweep uses 2", r.stderr)

    def test_the_labs_own_nan_baseline_is_read_back(self):
        with StubServer(StubConfig(invariant=True, faults={1: "nanlogprobs"})) as stub:
            self.assertEqual(short_sweep(stub, "--sizes", "1,2", "--save", self.path("nan.json")).code, 0)
        self.assertIn("NaN", json.dumps(self.load("nan.json")["prompts"][0]["baseline"]))
        with StubServer(StubConfig(invariant=True)) as stub:
            r = short_sweep(stub, "--sizes", "1,2", "--baseline", self.path("nan.json"), "--json")
        self.assertNotEqual(r.code, 2, r)  # read back, and compared
        self.assertEqual(r.json()["prompts"][0]["baseline_source"], self.path("nan.json"))

    def test_a_built_prompt_takes_a_baseline_made_with_the_same_length(self):
        with StubServer(StubConfig(invariant=True)) as stub:
            first = short_sweep(stub, "--sizes", "1,2", "--prompt-tokens", 40, "--save", self.path("p40.json"))
            self.assertEqual(first.code, 0, first)
            r = short_sweep(stub, "--sizes", "1,2", "--prompt-tokens", 40, "--baseline", self.path("p40.json"),
                            "--repeat", 2, "--expect", "invariant")
        self.assertEqual(r.code, 0, r)


class ServedBaselines(TempDirTest):
    """A saved sweep whose batch 1 the prefix cache served holds no baseline: refused before
    any request, whatever says so (its verdict, or its batch-1 row)."""

    def test_a_saved_sweep_whose_batch_1_was_served_is_refused_before_any_request(self):
        served = StubConfig(invariant=True, prompt_tokens_details=True, cache_serves="all")
        with StubServer(served) as stub:
            first = short_sweep(stub, "--sizes", "1,2", "--repeat", 2,
                                "--save", self.path("s.json"))
        self.assertEqual(first.code, 0, first)
        doc = self.load("s.json")
        self.assertEqual(doc["prompts"][0]["verdict"],
                         "nothing compared: the cache served batch 1, the baseline")
        # the same file with its verdict worded otherwise (an older lab's): its row says it
        older = copy.deepcopy(doc)
        older["prompts"][0]["verdict"] = older["summary"]["verdict"] = "invariant"
        with open(self.path("older.json"), "w") as f:
            json.dump(older, f)
        with StubServer(StubConfig(invariant=True, prompt_tokens_details=True)) as clean:
            for name, why in (("s.json", "its verdict: nothing compared"),
                              ("older.json", "its batch 1 came with")):
                with self.subTest(name):
                    r = short_sweep(clean, "--sizes", "1,2", "--baseline", self.path(name),
                                    "--repeat", 2, "--expect", "invariant")
                    self.assertEqual(r.code, 2, r)
                    self.assertEqual(clean.generation_bodies(), [])  # before any request
                    self.assertIn("was served from the prefix cache, not computed (%s" % why,
                                  r.stderr)
                    self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)


    def test_a_saved_sweep_whose_batch_1_is_not_known_cold_is_refused(self):
        # neither counts nor counters: the saved row says so (unknown), and an older lab's
        # verdict on it says nothing
        unsaid = StubConfig(invariant=True, no_metrics=True)
        with StubServer(unsaid) as stub:
            short_sweep(stub, "--sizes", "1,2", "--repeat", 2, "--save", self.path("s.json"))
        doc = self.load("s.json")
        doc["prompts"][0]["verdict"] = doc["summary"]["verdict"] = "invariant"
        with open(self.path("older.json"), "w") as f:
            json.dump(doc, f)
        with StubServer(StubConfig(invariant=True, prompt_tokens_details=True)) as clean:
            r = short_sweep(clean, "--sizes", "1,2", "--baseline", self.path("older.json"),
                            "--repeat", 2)
        self.assertEqual(r.code, 2, r)
        self.assertIn("whether the cache served its batch 1 is not known", r.stderr)


class AgainstAnotherServer(TempDirTest):
    """--baseline URL: batch 1 of another server (a TP degree, a version, a restart)."""

    def test_a_server_with_other_arithmetic_is_reported_against_the_baseline_server(self):
        with StubServer(StubConfig(invariant=True)) as base, \
                StubServer(StubConfig(invariant=True, tp_size=2, rotation_offset=1)) as other:
            r = short_sweep(other, "--sizes", "1,2", "--baseline", base.url, "--repeat", 2, "--expect", "invariant",
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
            r = short_sweep(other, "--sizes", "1,2,9", "--baseline", base.url, "--repeat", 2, "--expect", "invariant")
        self.assertEqual(r.code, 0, r)
        self.assertIn("reporting the same settings", r.stdout)

    def test_a_baseline_server_whose_cache_served_batch_1_is_no_baseline(self):
        # Its cache serves every prompt, computed another way: against it a clean server
        # would seem to move, and the move be put down to batching
        served = StubConfig(invariant=True, prompt_tokens_details=True, cache_serves="all",
                            cache_path_differs=True)
        with StubServer(served) as base, \
                StubServer(StubConfig(invariant=True, prompt_tokens_details=True)) as other:
            r = short_sweep(other, "--sizes", "1,2,4", "--baseline", base.url, "--repeat", 2,
                            "--traffic", "concurrent", "--expect", "invariant",
                            "--save", self.path("s.json"))
        self.assertEqual(r.code, 1, r)
        doc = self.load("s.json")
        verdict = "nothing compared: the cache served batch 1, the baseline"
        self.assertEqual(doc["summary"]["verdict"], verdict)
        self.assertEqual(doc["prompts"][0]["verdict"], verdict)
        self.assertNotIn("logprobs moved", r.stdout)
        self.assertNotIn("bug report", r.stdout)
        self.assertIn("against batch 1 of %s, which its prefix cache served, or may have "
                      "served (1 prompt): no baseline, nothing compared" % base.url, r.stdout)

    def test_a_baseline_served_uncounted_is_found_by_its_counters_that_lag(self):
        # its answers count no hit, and its counters count a prefill 1.5 s late: its one
        # batch 1 a prompt is waited for as long as counters are ever waited for
        served = StubConfig(invariant=True, uncounted_cache_hits=True, cache_serves="all",
                            cache_path_differs=True, counters_lag=1.5)
        with StubServer(served) as base, StubServer(StubConfig(invariant=True)) as other:
            r = short_sweep(other, "--sizes", "1,2", "--baseline", base.url, "--repeat", 2,
                            "--traffic", "concurrent", "--expect", "invariant",
                            "--save", self.path("s.json"))
        self.assertEqual(r.code, 1, r)
        self.assertEqual(self.load("s.json")["summary"]["verdict"],
                         "nothing compared: the cache served batch 1, the baseline")
        self.assertNotIn("bug report", r.stdout)

    def test_the_server_under_test_is_no_baseline(self):
        with StubServer(StubConfig()) as stub:
            r = short_sweep(stub, "--baseline", stub.url.replace("127.0.0.1", "localhost"))
        self.assertEqual(r.code, 2, r)
        self.assertIn("--baseline names the server under test", r.stderr)


if __name__ == "__main__":
    unittest.main()
