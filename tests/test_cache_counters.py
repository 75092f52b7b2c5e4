"""The prefix cache's evidence from two sources: the server's own counters (/metrics), read
before and after a batch, against the cached-token counts its answers report."""

import os
import unittest

from support import FIXTURES, StubConfig, StubServer, free_port, run

COPIES = ["Copies of one prompt in one request share the cache. " * 3] * 4
ALONE = ["A prompt sent alone with a cache key of its own."]


def client(url):
    return run.HttpClient(url, None, 30.0, 1 << 20)


def batch_evidence(stub, prompts, isolate=True, cache_key=None):
    """One batch sent as the sweep sends it, judged by the counters around it."""
    adapter = run.ADAPTERS[stub.config.engine]
    http = client(stub.url)
    before = adapter.prefix_cache_counters(http)
    sampling = run.Sampling.of(0.0, 2, None, 42)
    executor = run.Executor(http, adapter, stub.config.model, isolate)
    sent = run.send_requests(executor, [run.Request(tuple(prompts), sampling, cache_key)], "batch")
    after = adapter.prefix_cache_counters(http)
    return run.cache_evidence(before, after, [a.cached_tokens for a in sent.answers])


class TheThreeCasesOnThePracticeEngine(unittest.TestCase):
    def test_copies_in_one_request_served_and_counted(self):
        # one vLLM request takes one salt: its copies hit each other's prefix, as on 0.33.0
        with StubServer(StubConfig(prompt_tokens_details=True)) as stub:
            found = batch_evidence(stub, COPIES)
        self.assertEqual(found.verdict, run.CACHE_COUNTED_AND_SERVED, found)
        self.assertGreater(found.served, 0)
        self.assertGreater(found.counted, 0)

    def test_copies_served_but_not_counted(self):
        config = StubConfig(prompt_tokens_details=True, uncounted_cache_hits=True)
        with StubServer(config) as stub:
            found = batch_evidence(stub, COPIES)
        self.assertEqual(found.verdict, run.CACHE_SERVED_NOT_COUNTED, found)
        self.assertEqual(found.counted, 0)
        self.assertGreater(found.served, 0)
        self.assertIn("0 cached tokens", found.why)

    def test_a_server_that_reports_no_counts_but_served(self):
        with StubServer(StubConfig()) as stub:  # no --enable-prompt-tokens-details
            found = batch_evidence(stub, COPIES)
        self.assertEqual((found.verdict, found.counted), (run.CACHE_SERVED_NOT_COUNTED, None))

    def test_neither(self):
        for config in (StubConfig(prompt_tokens_details=True),
                       StubConfig(prompt_tokens_details=True, uncounted_cache_hits=True),
                       StubConfig(prompt_tokens_details=True, prefix_caching=False)):
            with self.subTest(config=config), StubServer(config) as stub:
                found = batch_evidence(stub, ALONE if config.prefix_caching else COPIES)
            self.assertEqual(found.verdict, run.CACHE_NEITHER, found)
            self.assertEqual(found.served, 0)

    def test_sglang_with_its_metrics(self):
        config = StubConfig(engine="sglang", enable_metrics=True, prefix_caching=True)
        with StubServer(config) as stub:
            cold = batch_evidence(stub, COPIES[:2], isolate=False, cache_key="k")
            again = batch_evidence(stub, COPIES[:2], isolate=False, cache_key="k")
            flushed = batch_evidence(stub, COPIES[:2], isolate=True)
        self.assertEqual(cold.verdict, run.CACHE_NEITHER, cold)
        self.assertEqual(again.verdict, run.CACHE_COUNTED_AND_SERVED, again)
        self.assertEqual(flushed.verdict, run.CACHE_NEITHER, flushed)
        config.uncounted_cache_hits = True
        with StubServer(config) as stub:
            batch_evidence(stub, COPIES[:2], isolate=False, cache_key="k")
            again = batch_evidence(stub, COPIES[:2], isolate=False, cache_key="k")
        self.assertEqual(again.verdict, run.CACHE_SERVED_NOT_COUNTED, again)

    def test_sglang_without_metrics_is_unknown(self):
        with StubServer(StubConfig(engine="sglang")) as stub:
            self.assertIsNone(run.ADAPTERS["sglang"].prefix_cache_counters(client(stub.url)))
            found = batch_evidence(stub, COPIES[:2], isolate=False, cache_key="k")
        self.assertEqual(found.verdict, run.CACHE_EVIDENCE_UNKNOWN)
        self.assertIn("exposes no prefix-cache counters", found.why)


class ReadingCounters(unittest.TestCase):
    def test_the_real_vllm_answer(self):
        with open(os.path.join(FIXTURES, "metrics_excerpt.txt"), encoding="utf-8") as f:
            text = f.read()
        self.assertEqual(run.metric_sums(text, "vllm:prefix_cache_queries_total"), 29088.0)
        self.assertEqual(run.metric_sums(text, "vllm:prefix_cache_hits_total"), 0.0)
        # the _created gauges beside them are not the counters
        self.assertIsNone(run.metric_sums(text, "vllm:prefix_cache_hits"))

    def test_one_sample_per_engine_summed_and_labels_chosen(self):
        text = ('vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10.0\n'
                'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 5.0 1700000000000\n'
                '# TYPE sglang:prefill_effective_tokens counter\n'
                'sglang:prefill_effective_tokens_total{mode="input",x="a\\"b"} 7\n'
                'sglang:prefill_effective_tokens_total{mode="host_hit"} 3\n')
        self.assertEqual(run.metric_sums(text, "vllm:prefix_cache_hits_total"), 15.0)
        self.assertEqual(run.metric_sums(text, "sglang:prefill_effective_tokens_total",
                                         {"mode": ("device_hit", "host_hit")}), 3.0)
        self.assertEqual(run.metric_sums(text, "sglang:prefill_effective_tokens_total",
                                         {"mode": ("storage_hit",)}), 0.0)

    def test_malformed_answers_never_raise(self):
        for text in (None, 12, "", "<html>Not Found</html>", "vllm:prefix_cache_hits_total nan",
                     "vllm:prefix_cache_hits_total{engine=\"0\"} -1\n", "\x00\xff" * 50,
                     "vllm:prefix_cache_hits_total{engine=\"0\" 4\n",
                     "vllm:prefix_cache_hits_total 1e400\nvllm:prefix_cache_hits_total abc\n"):
            with self.subTest(text=repr(text)[:40]):
                value = run.metric_sums(text, "vllm:prefix_cache_hits_total")
                self.assertIn(value, (None, 0.0))

    def test_a_server_that_cannot_answer_gives_none(self):
        port = free_port()
        for adapter in run.ADAPTERS.values():
            with self.subTest(engine=adapter.name):
                self.assertIsNone(adapter.prefix_cache_counters(
                    client("http://127.0.0.1:%d" % port)))
        with StubServer(StubConfig(engine="sglang")) as stub:  # 404 without --enable-metrics
            self.assertIsNone(run.ADAPTERS["vllm"].prefix_cache_counters(client(stub.url)))


class Judging(unittest.TestCase):
    C = run.CacheCounters

    def test_the_verdicts(self):
        before = self.C(100, 10, "x")
        cases = [
            (self.C(200, 50, "x"), [40], run.CACHE_COUNTED_AND_SERVED),
            (self.C(200, 50, "x"), [0, 0], run.CACHE_SERVED_NOT_COUNTED),
            (self.C(200, 50, "x"), [None], run.CACHE_SERVED_NOT_COUNTED),
            (self.C(200, 10, "x"), [0], run.CACHE_NEITHER),
            (self.C(200, 10, "x"), [None], run.CACHE_NEITHER),
            (self.C(200, 10, "x"), [16], run.CACHE_EVIDENCE_UNKNOWN),  # counted, not seen
            (self.C(50, 5, "x"), [0], run.CACHE_EVIDENCE_UNKNOWN),  # went down: restarted
            (None, [0], run.CACHE_EVIDENCE_UNKNOWN)]
        for after, reported, verdict in cases:
            with self.subTest(after=after, reported=reported):
                self.assertEqual(run.cache_evidence(before, after, reported).verdict, verdict)
        self.assertEqual(run.cache_evidence(None, None, [3]).counted, 3)

    def test_other_clients_traffic_says_nothing_of_the_batch(self):
        found = run.cache_evidence(self.C(100, 10, "x"), self.C(400, 60, "x"), [0],
                                   prompt_tokens=120)
        self.assertEqual(found.verdict, run.CACHE_EVIDENCE_UNKNOWN)
        self.assertIn("other requests", found.why)
        self.assertEqual(run.cache_evidence(self.C(100, 10, "x"), self.C(220, 60, "x"), [0],
                                            prompt_tokens=120).verdict,
                         run.CACHE_SERVED_NOT_COUNTED)


if __name__ == "__main__":
    unittest.main()
