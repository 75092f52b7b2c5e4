"""Which completion the prefix cache served, per completion: SGLang counts each item of a
request, vLLM one count a request (its last prompt's), so a count is a completion's only
where it can be; a completion whose cache state is not known compares nothing where the cache
was kept."""

import unittest

from support import StubConfig, StubServer, TempDirTest, run, short_sweep, sizes_of


class PerItem(TempDirTest):
    def test_sglang_copies_one_item_of_five_served_leave_four_compared(self):
        # One item of five reports cached tokens: that item compares nothing, the other four
        # were computed cold beside it and are evidence of batching
        with StubServer(StubConfig(engine="sglang", cache_serves="one")) as stub:
            r = short_sweep(stub, "--sizes", "1,5", "--repeat", 2, "--expect", "variant",
                            "--save", self.path("s.json"))
        doc = self.load("s.json")
        self.assertEqual(doc["summary"]["served_sizes"], [5])
        row = sizes_of(doc)[5]["runs"][0]
        self.assertEqual(row["served"], 1)  # one completion of five, not all five
        self.assertNotIn("moved only where the cache served", doc["summary"]["verdict"])
        self.assertEqual(r.code, 0, r)
        self.assertIn(doc["summary"]["verdict"], ("tokens diverged", "logprobs moved but tokens held"))


class CountOfAnotherPrompt(TempDirTest):
    # vLLM reports the cached count of a request's last prompt, a filler: the measured prompt,
    # cached by batch 1 and served from the cache (computed another way here), is never
    # judged cold, and its difference is not put down to batching
    def test_mixed_traffic_with_the_cache_kept_on_vllm_is_not_judged_cold(self):
        # /metrics not reachable: its cache state is not known
        with StubServer(StubConfig(prompt_tokens_details=True, cache_path_differs=True,
                                   invariant=True, no_metrics=True)) as stub:
            r = short_sweep(stub, "--sizes", "1,5", "--traffic", "mixed", "--prefix-cache",
                            "keep", "--expect", "variant", "--json")
        self.assertEqual(r.code, 1, r)
        summary = r.json()["summary"]
        self.assertNotEqual(summary["verdict"], "logprobs moved but tokens held")
        self.assertTrue(summary["verdict"].startswith("nothing compared"), summary["verdict"])
        self.assertIn("the cache was kept", summary["verdict"])

    def test_the_counters_show_the_request_served_not_which_prompt(self):
        # the server's counters saw the cache serve more than the filler's count: the request
        # was served, but which of its prompts the counters do not say; the measured one is
        # not known to be cold (nor served), and the disagreement is in the row
        with StubServer(StubConfig(prompt_tokens_details=True, cache_path_differs=True,
                                   invariant=True)) as stub:
            r = short_sweep(stub, "--sizes", "1,5", "--traffic", "mixed", "--prefix-cache",
                            "keep", "--expect", "variant")
        self.assertEqual(r.code, 1, r)
        self.assertIn("summary: ", r.stdout)
        summary = [line for line in r.stdout.splitlines() if line.startswith("summary: ")][0]
        self.assertIn(": %s" % run.CACHE_UNKNOWN, summary)
        self.assertNotIn("logprobs moved", summary)
        self.assertNotIn("bypass did not hold", r.stdout)  # no bypass was asked
        self.assertIn("the server's counters: ", r.stdout)
        self.assertIn("not known to be cold, not compared", r.stdout)


if __name__ == "__main__":
    unittest.main()
