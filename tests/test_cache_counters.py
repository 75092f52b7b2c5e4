"""The prefix cache's evidence from two sources: the server's own counters (/metrics), read
before and after a batch, against the cached-token counts its answers report."""

import os
import threading
import time
import unittest
from unittest import mock

from support import (FIXTURES, HERE, StubConfig, StubServer, TempDirTest, free_port, run,
                     short_sweep, sizes_of)

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
        self.assertIn("the counters could not be read", found.why)


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



def counters_of(doc, size):
    """The cache's evidence each pass of a batch size saved (BatchRow.cache_seen)."""
    return [r.get("cache_seen") for r in sizes_of(doc)[size]["runs"]]


class TheSweepReadsTheCounters(TempDirTest):
    """Around each of its own batches the sweep reads the server's counters and sets them
    against the answers' counts: a batch the cache served is said to be, counted or not."""

    def test_copies_served_but_not_counted_are_not_invariant(self):
        # the answers say 0 cached tokens; the counters saw the copies served from each
        # other's prefill: nothing about batching was compared, whatever the answers say
        config = StubConfig(invariant=True, prompt_tokens_details=True, uncounted_cache_hits=True)
        with StubServer(config) as stub:
            r = short_sweep(stub, "--sizes", "1,4", "--repeat", 2, "--expect", "invariant",
                            "--save", self.path("s.json"), "--wide")  # a row and its notes
        self.assertEqual(r.code, 1, r)
        doc = self.load("s.json")
        self.assertNotEqual(doc["summary"]["verdict"], "invariant")
        self.assertTrue(doc["summary"]["verdict"].startswith("nothing compared"), doc["summary"])
        self.assertEqual(doc["summary"]["served_sizes"], [4])
        for seen in counters_of(doc, 4):
            self.assertEqual(seen["verdict"], run.CACHE_SERVED_NOT_COUNTED, seen)
            self.assertGreater(seen["served"], 0)
            self.assertEqual(seen["counted"], 0)
        self.assertEqual(doc["summary"]["prefix_cache_bypass"]["status"], "did not hold")
        row = [line for line in r.stdout.splitlines() if line.lstrip().startswith("4 ")][0]
        self.assertIn("the server's counters: %d prompt tokens served from the cache, the "
                      "answers counted none" % sum(s["served"] for s in counters_of(doc, 4)), row)

    def test_copies_counted_and_served(self):
        config = StubConfig(invariant=True, prompt_tokens_details=True)
        with StubServer(config) as stub:
            r = short_sweep(stub, "--sizes", "1,4", "--save", self.path("s.json"))
        doc = self.load("s.json")
        seen = counters_of(doc, 4)[0]
        self.assertEqual(seen["verdict"], run.CACHE_COUNTED_AND_SERVED, seen)
        self.assertEqual(doc["summary"]["served_sizes"], [4], r)
        self.assertEqual(counters_of(doc, 1)[0]["verdict"], run.CACHE_NEITHER)

    def test_neither_under_concurrent_traffic_proves_the_bypass(self):
        # each request a key of its own: the counters saw no hit, so the bypass held, though
        # the answers report no counts (vLLM without --enable-prompt-tokens-details)
        with StubServer(StubConfig(invariant=True)) as stub:
            r = short_sweep(stub, "--sizes", "1,4", "--repeat", 2, "--traffic", "concurrent",
                            "--repeat", 2, "--expect", "invariant", "--save", self.path("s.json"))
        self.assertEqual(r.code, 0, r)
        doc = self.load("s.json")
        self.assertEqual(doc["summary"]["verdict"], "invariant")
        self.assertEqual(doc["summary"]["prefix_cache_bypass"]["status"], "held")
        for size in (1, 4):
            self.assertEqual({s["verdict"] for s in counters_of(doc, size)}, {run.CACHE_NEITHER})
        self.assertIn("prefix-cache counters read around each batch (vllm:prefix_cache_queries_"
                      "total, vllm:prefix_cache_hits_total)", r.stdout)
        self.assertNotIn("unverified", r.stdout)

    def test_counters_that_count_late_are_waited_for(self):
        # the counters count a prefill 0.3 s after it: read once at once, the batch would
        # look cold; read until they cover the batch's prompt tokens, it is served
        config = StubConfig(invariant=True, prompt_tokens_details=True, uncounted_cache_hits=True,
                            counters_lag=0.3)
        with StubServer(config) as stub:
            short_sweep(stub, "--sizes", "1,4", "--save", self.path("s.json"))
        doc = self.load("s.json")
        self.assertEqual(counters_of(doc, 4)[0]["verdict"], run.CACHE_SERVED_NOT_COUNTED)

    def test_a_server_with_its_cache_off_is_not_asked_for_counters(self):
        with StubServer(StubConfig(invariant=True, prefix_caching=False)) as stub:
            r = short_sweep(stub, "--sizes", "1,4", "--save", self.path("s.json"))
            reads = [path for _, path, _ in stub.requests if path == "/metrics"]
        self.assertEqual(reads, [])
        self.assertIn("prefix cache off (the server's settings)", r.stdout)
        doc = self.load("s.json")
        self.assertEqual(doc["summary"]["verdict"], "invariant")
        self.assertEqual(doc["summary"]["prefix_cache_bypass"]["status"], "held")

    def test_sglang_counters_only_with_its_metrics(self):
        for metrics in (False, True):
            config = StubConfig(engine="sglang", invariant=True, enable_metrics=metrics)
            with self.subTest(metrics=metrics), StubServer(config) as stub:
                r = short_sweep(stub, "--sizes", "1,4", "--save", self.path("g%s.json" % metrics))
                doc = self.load("g%s.json" % metrics)
                seen = counters_of(doc, 4)[0]
                if metrics:
                    self.assertEqual(seen["verdict"], run.CACHE_NEITHER, seen)
                    self.assertIn("sglang:prefill_effective_tokens_total", r.stdout)
                else:
                    self.assertIsNone(seen)
                    self.assertNotIn("prefix-cache counters read", r.stdout)


class FakeCounters:
    """An adapter whose counters are read from a list, one reading a call (the last repeats)."""

    def __init__(self, *readings):
        self.readings = [run.CacheCounters(q, h, "fake") if q is not None else None
                         for q, h in readings]

    def prefix_cache_counters(self, client):
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]


def watch_of(adapter, start=(100, 0)):
    return run.CounterWatch(adapter, client("http://127.0.0.1:9"),
                            run.CacheCounters(start[0], start[1], "fake"))


class CounterWatchAtTheSeams(unittest.TestCase):
    """How the counters are read: late ones waited for, flat or failing ones read no more."""

    def test_counters_that_never_move_cost_at_most_the_sweeps_wait(self):
        # a counter over any count a server keeps is skipped, so it reads flat: every batch
        # looked up nothing; the lab waits for them only within the sweep's budget, however
        # many batches there are, and none of those batches is taken as cold by them
        wait, budget = run.COUNTERS_WAIT_S, run.COUNTERS_WAIT_BUDGET_S
        try:
            run.COUNTERS_WAIT_S, run.COUNTERS_WAIT_BUDGET_S = 0.01, 0.05
            watch = watch_of(FakeCounters((100, 0)))
            for _ in range(20):
                seen = watch.after(watch.before(), 20, 0)
                self.assertEqual(seen.verdict, run.CACHE_EVIDENCE_UNKNOWN)
            self.assertLess(watch.waited, 0.05 + 2 * run.COUNTERS_POLL_S)
        finally:
            run.COUNTERS_WAIT_S, run.COUNTERS_WAIT_BUDGET_S = wait, budget

    def test_one_failed_read_is_one_unknown_batch_not_the_end_of_the_counters(self):
        # /metrics answers 503 once (read None), then answers again: that batch is unknown,
        # and the next one is judged by the counters as before
        fake = FakeCounters((100, 0), (None, None), (120, 0), (120, 0), (140, 0))
        watch = watch_of(fake)
        seen = watch.after(watch.before(), 20, 0)
        self.assertEqual(seen.verdict, run.CACHE_EVIDENCE_UNKNOWN)
        self.assertEqual(watch.stopped, "")
        again = watch.after(watch.before(), 20, 0)
        self.assertEqual(again.verdict, run.CACHE_NEITHER, again)

    def test_reads_that_fail_in_a_row_stop_the_counters(self):
        watch = watch_of(FakeCounters((None, None)))
        for _ in range(run.COUNTERS_FAILURES_MAX):
            watch.after(watch.before(), 20, 0)
        self.assertEqual(watch.stopped, "%d reads of its /metrics in a row failed"
                         % run.COUNTERS_FAILURES_MAX)
        self.assertIsNone(watch.before())

    def test_a_hung_metrics_costs_its_own_timeout_not_the_sweeps(self):
        slow = run.HttpClient("http://127.0.0.1:9", None, 600.0, 1 << 20)
        watch = run.CounterWatch(FakeCounters((100, 0)), slow, run.CacheCounters(0, 0, "fake"))
        self.assertEqual(watch.client.timeout, run.METRICS_TIMEOUT_S)

    def test_a_batch_counted_late_is_waited_for_before_the_next(self):
        # the first batch's 20 lookups land only after the wait: the next batch's "before"
        # waits for them, so they are not taken for the next batch's own
        fake = FakeCounters((100, 0))
        watch = watch_of(fake, start=(90, 0))
        watch.settle = 0.01
        first = watch.after(watch.before(), 20, 0)
        self.assertEqual(first.verdict, run.CACHE_EVIDENCE_UNKNOWN)
        self.assertIn("had not counted it all yet", first.why)
        self.assertEqual(watch.settle, 0.02)  # lagging: waited for longer from now on
        watch.settle = 10.0  # long enough for the readings below
        fake.readings = [run.CacheCounters(q, 0, "fake") for q in (100, 100, 120)]
        before = watch.before()
        self.assertEqual(before.queried, 120)  # read again until the late lookups landed
        fake.readings = [run.CacheCounters(140, 0, "fake")]
        second = watch.after(before, 20, 0)
        self.assertEqual(second.verdict, run.CACHE_NEITHER, second)
        self.assertEqual(watch.stopped, "")


class TheSweepAtTheSeams(TempDirTest):
    """The counters against what a hostile server or a busy one does."""

    def test_the_checks_read_the_counters(self):
        # the cache serves every run and the answers count none: only the counters say so,
        # and a check that compared only served runs compared nothing
        config = StubConfig(invariant=True, prompt_tokens_details=True,
                            uncounted_cache_hits=True, cache_serves="all")
        for check, expect in (("--neighbours=16", "neighbours-equal"),
                              ("--observer-check", "observer-equal")):
            with self.subTest(check=check), StubServer(config) as stub:
                r = short_sweep(stub, "--sizes", "1,2", "--repeat", 2, "--traffic",
                                "concurrent", check, "--expect", expect, "--json")
                self.assertEqual(r.code, 1, r)
                checks = r.json()["summary"]
                verdict = checks["neighbours_verdict" if "neigh" in check else "observer_verdict"]
                self.assertTrue(verdict.startswith("nothing compared"), verdict)

    def test_counters_that_lag_past_the_first_wait(self):
        # the counters count a prefill 1.2 s after it, beyond the first wait: the lab waits
        # longer from then on, and the copies the cache served are found served, not moved
        config = StubConfig(invariant=True, prompt_tokens_details=True, uncounted_cache_hits=True,
                            cache_serves="one", cache_path_differs=True, counters_lag=1.2)
        with StubServer(config) as stub:
            r = short_sweep(stub, "--sizes", "1,2,4", "--repeat", 2, "--save", self.path("s.json"))
        doc = self.load("s.json")
        self.assertEqual(doc["summary"]["verdict"], run.CACHE_CONFOUNDED, r)
        # the first batch was not counted in the first wait: said, not taken as cold
        self.assertRegex(r.stdout, r"prefix-cache counters could not say of [1-6] of 6 passes")
        self.assertIsNotNone(counters_of(doc, 4)[-1])

    def test_another_clients_hits_are_not_the_bypass_failing(self):
        # another client keeps sending one unsalted prompt, served from the cache: the
        # counters see its hits beside the sweep's batches, which its answers count cold
        config = StubConfig(invariant=True, prompt_tokens_details=True)
        with StubServer(config) as stub:
            stop = threading.Event()

            def other_client():
                http = client(stub.url)
                body = {"model": stub.config.model, "prompt": "another client's prompt " * 8,
                        "max_tokens": 1, "temperature": 0}
                while not stop.is_set():
                    http.request("/v1/completions", body)
                    time.sleep(0.01)

            thread = threading.Thread(target=other_client)
            thread.start()
            try:
                r = short_sweep(stub, "--sizes", "1,2,4", "--repeat", 2, "--traffic",
                                "concurrent", "--save", self.path("s.json"))
            finally:
                stop.set()
                thread.join()
        doc = self.load("s.json")
        self.assertEqual(doc["summary"]["prefix_cache_bypass"]["status"], "held", r)
        self.assertEqual(doc["summary"]["verdict"], "invariant", r)
        self.assertNotIn("bypass did not hold", r.stdout)

    def test_mixed_traffic_a_filler_the_cache_served_says_nothing_of_the_prompt(self):
        # vLLM counts a request's last prompt only, here a filler the cache served: the
        # measured prompt's own state is not known, so it is neither served nor cold
        config = StubConfig(invariant=True, prompt_tokens_details=True, cache_serves="one",
                            cache_path_differs=True)
        with StubServer(config) as stub:
            r = short_sweep(stub, "--sizes", "1,2,4", "--repeat", 2, "--traffic", "mixed",
                            "--save", self.path("s.json"))
        doc = self.load("s.json")
        self.assertEqual(doc["summary"]["verdict"], run.CACHE_UNCLEAR, r)
        self.assertIsNone(doc["summary"].get("served_sizes"))  # none is known served
        self.assertIn("(0 of 2 requests served, 2 not known to be cold, not compared)", r.stdout)


class CountersThatLag(TempDirTest):
    """Counters that lag past the first wait, against a server that counts no hit in its
    answers: what they show once they have counted is read back over the passes before."""

    def test_passes_judged_before_the_counters_caught_up_are_not_known_cold(self):
        # batch 1 of pass 1 is judged before its lookups are counted, and the answers count
        # nothing: only the next batch's counters show the cache serving uncounted; from then
        # on, that batch 1 is not known to be cold either, and the sweep compared nothing
        config = StubConfig(invariant=True, uncounted_cache_hits=True, cache_serves="all",
                            cache_path_differs=True, counters_lag=1.5)
        with StubServer(config) as stub:
            r = short_sweep(stub, "--sizes", "1,2", "--repeat", 2, "--traffic", "concurrent",
                            "--repeat", 2, "--expect", "invariant", "--save", self.path("s.json"))
        self.assertEqual(r.code, 1, r)
        verdict = self.load("s.json")["summary"]["verdict"]
        self.assertTrue(verdict.startswith("nothing compared"), verdict)
        self.assertNotIn(": invariant", r.stdout)

    def test_mixed_traffic_an_uncounted_hit_says_nothing_of_the_prompt(self):
        # the counters saw a request of the prompt and its fillers served, and do not say
        # which of its prompts: the measured one is not known to be cold, not served
        config = StubConfig(invariant=True, uncounted_cache_hits=True, cache_serves="one",
                            cache_path_differs=True, prompt_tokens_details=True)
        with StubServer(config) as stub:
            r = short_sweep(stub, "--sizes", "1,3,4", "--repeat", 2, "--traffic", "mixed",
                            "--save", self.path("s.json"))
        verdict = self.load("s.json")["summary"]["verdict"]
        self.assertEqual(verdict, run.CACHE_UNCLEAR, r)
        self.assertNotIn("the cache served every request", r.stdout)

    def test_counters_never_counted_in_time_leave_their_batches_unknown(self):
        # they move, but a batch is never counted whole within the wait: no batch's window is
        # taken as its own, and the waiting ends with the sweep's budget
        wait, budget = run.COUNTERS_WAIT_S, run.COUNTERS_WAIT_BUDGET_S
        try:
            run.COUNTERS_WAIT_S, run.COUNTERS_WAIT_BUDGET_S = 0.01, 0.03
            fake = FakeCounters((105, 0))
            watch = watch_of(fake)
            for _ in range(4):
                seen = watch.after(watch.before(), 20, 0)
                self.assertEqual(seen.verdict, run.CACHE_EVIDENCE_UNKNOWN)
            self.assertLess(watch.waited, 0.03 + 2 * run.COUNTERS_POLL_S)
        finally:
            run.COUNTERS_WAIT_S, run.COUNTERS_WAIT_BUDGET_S = wait, budget


class Vllm034Copies(TempDirTest):
    """vLLM 0.34.0 serves whole 64-token blocks of a prompt from its cache, and answers copies
    in one request with one copy's count while its counters count every copy served (the real
    answers in fixtures/vllm-0.34.0/copies_one_request.json and metrics_*.txt)."""

    def test_copies_of_a_prompt_shorter_than_a_block_are_computed(self):
        config = StubConfig(version="0.34.0", invariant=True, prompt_tokens_details=True)
        with StubServer(config) as stub:
            r = short_sweep(stub, "--sizes", "1,4", "--repeat", 2, "--expect", "invariant",
                            "--save", self.path("s.json"))
        self.assertEqual(r.code, 0, r)
        doc = self.load("s.json")
        self.assertEqual(doc["summary"]["verdict"], "invariant")
        self.assertEqual({s["verdict"] for s in counters_of(doc, 4)}, {run.CACHE_NEITHER})

    def test_copies_of_a_long_prompt_are_served_beyond_their_count(self):
        config = StubConfig(version="0.34.0", invariant=True, prompt_tokens_details=True)
        with StubServer(config) as stub:
            # 300 of the practice engine's tokens (a word each; its /tokenize counts bytes)
            r = short_sweep(stub, "--sizes", "1,4", "--prompt", " ".join(["word"] * 299),
                            "--save", self.path("s.json"))
        doc = self.load("s.json")
        seen = counters_of(doc, 4)[0]
        self.assertEqual(seen["verdict"], run.CACHE_COUNTED_AND_SERVED, seen)
        self.assertEqual(seen["counted"] % 64, 0)  # one copy's whole blocks
        self.assertEqual(seen["served"], 3 * seen["counted"])  # the other three copies
        # three copies served exactly their whole blocks: the fourth was computed cold, and
        # every copy equals batch 1, so the cold one does too
        self.assertEqual(doc["summary"]["verdict"], run.INVARIANT, r)
        self.assertIn("the server's counters: %d prompt tokens served from the cache, the answers "
                      "counted %d" % (seen["served"], seen["counted"]), r.stdout)
        self.assertIn("one copy of each request computed cold", r.stdout)


class CountersNotBelievedBlindly(TempDirTest):
    """What a hostile or flaky server's counters do, and what the lab makes of it: a failed
    read is one batch not known, impossible counts are not evidence, and nothing either way
    is taken for cold."""

    def test_one_failed_read_leaves_served_copies_served(self):
        # flag on, copies of one request share the cache, the answers count nothing (no
        # --enable-prompt-tokens-details): only the counters see the copies served. The 4th
        # read (before batch 2) answers 503 once; the counters are read on
        config = StubConfig(invariant=True, metrics_faults=(4,))
        with StubServer(config) as stub:
            r = short_sweep(stub, "--sizes", "1,2,8", "--repeat", 2, "--save", self.path("s.json"))
        doc = self.load("s.json")
        self.assertNotEqual(doc["summary"]["verdict"], run.INVARIANT, r)
        self.assertTrue(doc["summary"]["verdict"].startswith("nothing compared"), r)
        self.assertNotIn("read no more", r.stdout)

    def test_a_failed_first_read_is_no_server_without_counters(self):
        # the answers count 0 and the cache serves every request: the one read before the
        # sweep fails once, and the counters are read all the same
        config = StubConfig(invariant=True, prompt_tokens_details=True, uncounted_cache_hits=True,
                            cache_serves="all", metrics_faults=(1,), scheduler_window=0.05)
        with StubServer(config) as stub:
            r = short_sweep(stub, "--sizes", "1,2,3", "--traffic", "concurrent",
                            "--repeat", 2, "--expect", "invariant", "--save", self.path("s.json"))
        self.assertEqual(r.code, 1, r)
        self.assertTrue(self.load("s.json")["summary"]["verdict"].startswith("nothing compared"))

    def test_counters_stopped_by_failed_reads_are_read_at_the_end_all_the_same(self):
        config = StubConfig(invariant=True, prompt_tokens_details=True, uncounted_cache_hits=True,
                            cache_serves="all", metrics_faults=(2, 3, 4), scheduler_window=0.05)
        with StubServer(config) as stub:
            r = short_sweep(stub, "--sizes", "1,2,3,8", "--traffic", "concurrent",
                            "--repeat", 2, "--expect", "invariant", "--save", self.path("s.json"))
        self.assertEqual(r.code, 1, r)
        self.assertTrue(self.load("s.json")["summary"]["verdict"].startswith("nothing compared"))
        self.assertIn("read at the sweep's end", r.stdout)

    def test_a_hiccup_beside_a_cache_path_that_differs_blames_nothing_on_batching(self):
        config = StubConfig(invariant=True, cache_path_differs=True, metrics_faults=(4,))
        with StubServer(config) as stub:
            r = short_sweep(stub, "--sizes", "1,2,8", "--repeat", 2, "--save", self.path("s.json"))
        verdict = self.load("s.json")["summary"]["verdict"]
        self.assertNotIn(verdict, (run.LOGPROBS_MOVED, run.TOKENS_DIVERGED), r)

    def test_hits_above_lookups_are_not_believed(self):
        # every prefill counted with 100,000 hits more than the cache served: no cache serves
        # more tokens than it looks up, so the counters cannot say
        config = StubConfig(prompt_tokens_details=True, hits_beyond=100000, scheduler_window=0.05)
        with StubServer(config) as stub:
            r = short_sweep(stub, "--sizes", "1,2,4,9", "--traffic", "concurrent",
                            "--save", self.path("s.json"))
        # a server whose counters say what no cache can is believed in nothing: its answers'
        # counts of 0 prove nothing either
        doc = self.load("s.json")
        self.assertTrue(doc["summary"]["verdict"].startswith("nothing compared"), r)
        self.assertIn("which no cache can", r.stdout)

    def test_counters_going_backwards_are_not_evidence(self):
        seen = run.cache_evidence(run.CacheCounters(500, 100, "x"),
                                  run.CacheCounters(520, 90, "x"), [0], 20)
        self.assertEqual(seen.verdict, run.CACHE_EVIDENCE_UNKNOWN)
        self.assertEqual(run.cache_states([0], 0, seen, False)[0][0].count_alone, True)

    def test_counts_of_every_rank_summed_are_not_evidence(self):
        # two ranks each counting the batch's 20 lookups and 20 hits: summed, they look up 40
        seen = run.cache_evidence(run.CacheCounters(0, 0, "x"), run.CacheCounters(40, 40, "x"),
                                  [None], 20)
        self.assertEqual(seen.verdict, run.CACHE_EVIDENCE_UNKNOWN)
        self.assertIn("2 times", seen.why)

    def test_neither_counts_nor_counters_is_not_cold(self):
        states, _ = run.cache_states([None, None], None, None, False)
        self.assertEqual([s.cold() for s in states], [None, None])
        with StubServer(StubConfig(invariant=True, no_metrics=True)) as stub:
            r = short_sweep(stub, "--sizes", "1,4", "--traffic", "concurrent", "--json")
        self.assertEqual(r.json()["summary"]["verdict"], run.CACHE_UNSAID, r)

    def test_the_prefill_checks_requests_are_watched(self):
        # SGLang counts the prefill check's requests in its counters: sent outside the watch,
        # they would fall in the next batch's window as other clients' lookups
        config = StubConfig(engine="sglang", enable_metrics=True, invariant=True)
        with StubServer(config) as stub:
            r = short_sweep(stub, "--sizes", "1,2,4", "--prefill-check", "--repeat", 2)
        self.assertEqual(r.code, 0, r)
        self.assertNotIn("could not say", r.stdout)
        self.assertNotIn("other requests reached the server", r.stdout)

    def test_a_lag_seen_only_at_the_end_still_doubts_counts_of_0(self):
        # every prefill counted 3 s late: no batch's window can say; at the sweep's end the
        # counters show the cache serving what the answers never counted
        config = StubConfig(invariant=True, prompt_tokens_details=True, uncounted_cache_hits=True,
                            cache_serves="all", counters_lag=3.0)
        wait, budget = run.COUNTERS_WAIT_S, run.COUNTERS_WAIT_BUDGET_S
        try:
            run.COUNTERS_WAIT_S, run.COUNTERS_WAIT_BUDGET_S = 0.05, 0.2
            with StubServer(config) as stub:
                r = short_sweep(stub, "--sizes", "1,2", "--traffic", "concurrent",
                                "--save", self.path("s.json"))
        finally:
            run.COUNTERS_WAIT_S, run.COUNTERS_WAIT_BUDGET_S = wait, budget
        verdict = self.load("s.json")["summary"]["verdict"]
        self.assertTrue(verdict.startswith("nothing compared"), r)
        self.assertIn("read at the sweep's end", r.stdout)


LONG_PROMPT = " ".join(["Explain why sums of floats depend on their order."] * 10)  # 81 tokens


class OneColdCopy(TempDirTest):
    """vLLM 0.34.0: of n copies of a prompt longer than one 64-token block in one request, the
    cache serves n - 1 their longest cached prefix; the counters say so exactly, so one copy
    was computed cold, which one not known (the real 8 copies: 7 x 256 hits)."""

    def test_every_copy_equal_to_batch_1_compares_the_cold_one(self):
        config = StubConfig(invariant=True, version="0.34.0", prompt_tokens_details=True)
        with StubServer(config) as stub:
            r = short_sweep(stub, "--sizes", "1,2,8", "--prompt", LONG_PROMPT, "--repeat", 2,
                            "--save", self.path("s.json"))
        doc = self.load("s.json")
        self.assertEqual(doc["summary"]["verdict"], run.INVARIANT, r)
        runs = [row for size in doc["prompts"][0]["sizes"] if size["batch_size"] > 1
                for row in size["runs"]]
        self.assertTrue(all(row["cold_copies"] == 1 for row in runs), runs)
        self.assertIn("one copy of each request computed cold, which one not known: compared, "
                      "and held", r.stdout)
        self.assertNotIn("nothing compared", r.stdout.split("summary:")[1])

    def test_copies_that_moved_leave_which_one_was_cold_unknown(self):
        config = StubConfig(version="0.34.0", prompt_tokens_details=True)
        with StubServer(config) as stub:
            r = short_sweep(stub, "--sizes", "1,2,8", "--prompt", LONG_PROMPT, "--repeat", 2,
                            "--save", self.path("s.json"))
        verdict = self.load("s.json")["summary"]["verdict"]
        self.assertNotIn(verdict, (run.TOKENS_DIVERGED, run.LOGPROBS_MOVED), r)
        self.assertIn("where copies differ, not compared", r.stdout)

    def test_the_block_is_read_from_the_real_0_34_0_metrics(self):
        with open(os.path.join(HERE, "fixtures", "vllm-0.34.0", "metrics_cache_config.txt"),
                  encoding="utf-8") as f:
            text = f.read()
        with mock.patch.object(run, "metrics_text", lambda client: text):
            found = run.ADAPTERS["vllm"].prefix_cache_counters(None)
        self.assertEqual((found.queried, found.served, found.block), (0, 0, 64))


if __name__ == "__main__":
    unittest.main()
