"""What the server's stated limits allow, checked before the first generation request, and a
check the server refuses ending that check, not the sweep."""

import unittest

from support import StubConfig, StubServer, TempDirTest, one_error_line, run_lab, short_sweep


class LimitsBeforeTheFirstRequest(TempDirTest):
    def test_a_neighbour_longer_than_the_model_length_is_refused(self):
        with StubServer(StubConfig(max_model_len=2048)) as stub:
            r = short_sweep(stub, "--sizes", "1", "--neighbours", "16,5000")
            self.assertEqual(stub.generation_bodies(), [])
        one_error_line(self, r, 2, "--neighbours: a neighbour of 5000 tokens")
        self.assertIn("maximum model length of 2048", r.stderr)

    def test_more_top_logprobs_than_the_server_allows_is_refused(self):
        with StubServer(StubConfig(max_logprobs=5)) as stub:
            r = short_sweep(stub, "--sizes", "1,2", "--logprobs", 10)
            self.assertEqual(stub.generation_bodies(), [])
        one_error_line(self, r, 2, "--logprobs 10 is more top logprobs than the server allows")

    def test_a_server_that_allows_no_top_logprobs_is_refused_too(self):
        # vLLM --max-logprobs 0: none allowed (0 is a limit, not an unknown)
        with StubServer(StubConfig(max_logprobs=0)) as stub:
            r = short_sweep(stub, "--sizes", "1,2", "--logprobs", 1)
            self.assertEqual(stub.generation_bodies(), [])
        one_error_line(self, r, 2, "--logprobs 1 is more top logprobs than the server allows")
        self.assertIn("its max_logprobs is 0): give at most 0", r.stderr)

    def test_a_malformed_max_logprobs_is_unknown_and_refuses_nothing(self):
        # a string, a negative (vLLM's -1: no limit), a float, a boolean: what /server_info
        # states is no limit the lab can read, so nothing is refused; the server, which
        # allows 20, answers
        path = ("vllm_config", "model_config", "max_logprobs")
        for stated in ("5", -1, -3, 5.0, 2.5, True, None, [5]):
            with self.subTest(stated=stated), StubServer(StubConfig(
                    max_logprobs=20, info_overrides={path: stated})) as stub:
                r = short_sweep(stub, "--sizes", "1,2", "--logprobs", 10, "--observer-check",
                                "--json")
                self.assertEqual(r.code, 0, r)
                self.assertNotIn("Traceback", r.stderr)
                self.assertNotIn("more top logprobs than the server allows", r.stderr)
                asked = {s["logprobs"]: s["runs"]
                         for s in r.json()["summary"]["observer_settings"]}
                self.assertEqual(asked[20], 1)  # unknown: every setting asked


class ACheckTheServerCannotServe(TempDirTest):
    def test_the_observer_asks_only_what_the_server_allows(self):
        # vLLM --max-logprobs 5, stated in /server_info: top-20 is not asked, the rest is
        with StubServer(StubConfig(prefix_caching=False, max_logprobs=5)) as stub:
            r = short_sweep(stub, "--sizes", "1,2", "--observer-check", "--json")
        self.assertEqual(r.code, 0, r)
        summary = r.json()["summary"]
        self.assertEqual(summary["verdict"], "logprobs moved but tokens held")
        self.assertIn("top-20: not asked (the server allows at most 5)", summary["observer_verdict"])
        asked = {s["logprobs"]: s["runs"] for s in summary["observer_settings"]}
        self.assertEqual((asked[5], asked[20]), (1, 0))

    def test_the_observer_asks_no_top_k_list_of_a_server_that_allows_none(self):
        # --max-logprobs 0, stated: top-0 is asked (no list), top-5 and top-20 are not
        with StubServer(StubConfig(max_logprobs=0)) as stub:
            r = short_sweep(stub, "--sizes", "1,2", "--logprobs", 0, "--observer-check",
                            "--json")
        self.assertEqual(r.code, 0, r)
        summary = r.json()["summary"]
        asked = {s["logprobs"]: s["runs"] for s in summary["observer_settings"]}
        self.assertEqual((asked[0], asked[5], asked[20]), (1, 0, 0))
        self.assertIn("top-5: not asked (the server allows at most 0)",
                      summary["observer_verdict"])

    def test_a_refused_check_ends_with_its_reason_and_the_sweep_goes_on(self):
        # the same limit, not stated (no /server_info): the refusal ends the observer check
        with StubServer(StubConfig(max_logprobs=5, dev_mode=False)) as stub:
            r = short_sweep(stub, "--sizes", "1,2", "--observer-check", "--save", self.path("s.json"))
        self.assertEqual(r.code, 0, r)
        doc = self.load("s.json")
        self.assertEqual([s["batch_size"] for s in doc["prompts"][0]["sizes"]], [1, 2])
        self.assertTrue(doc["summary"]["observer_verdict"].startswith(
            "not measured: the server could not serve it"), doc["summary"]["observer_verdict"])
        self.assertIn("the observer check stops at batch size 1, the sweep goes on", r.stderr)


if __name__ == "__main__":
    unittest.main()
