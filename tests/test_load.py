"""--mode cost --concurrency: throughput and latency of both arms under load, streamed, with
intervals; --precision; the names and figures `vllm bench serve` users know."""

import io
import json
import unittest
from unittest import mock

from stub_server import VirtualClock
from support import Result, StubConfig, StubServer, TempDirTest, finish, run, run_lab, start_lab

STEP = 0.08   # seconds per streamed token: long enough that the engines' own arithmetic hides in it


TOKENS = 10   # per request: a trial's fixed costs (threads, connections) shrink beside its length


def load_argv(off, on):
    return ("--mode", "cost", "--url", off.url, "--invariant", on.url, "--concurrency", 8, "--requests", 8,
            "--trials", 6, "--warmup", 0, "--max-tokens", TOKENS, "--quiet", "--json")


def arms(slowdown, jitter=0.2, **extra):
    """Two practice arms streaming a token every STEP, with +-jitter seeded noise per request.
    The noise follows each engine's seed and the prompt, so a run's figures repeat; seeds 4
    and 11 are a pair whose draws are neither unusually alike nor unusually apart (without
    the machine's timing, the 1.3 arms' throughput interval would be [+23.9, +36.1] and equal
    arms' [-4.7, +4.7]), so the machine's own drift of a point or so cannot decide a test."""
    return (StubServer(StubConfig(step_delay=STEP, jitter=jitter, seed=4, **extra)),
            StubServer(StubConfig(invariant=True, step_delay=STEP, jitter=jitter, seed=11, slowdown=slowdown, **extra)))


class UnderLoad(TempDirTest):
    def test_a_known_slowdown_shows_and_equal_arms_show_none(self):
        """Two cost runs at once, each against its own pair of practice arms (they mostly
        wait on the arms' clocks): a known 30 % slowdown shows in throughput and TPOT, and
        equal arms show no significant overhead in any figure."""
        slow, equal = arms(1.3), arms(1.0)
        with slow[0], slow[1], equal[0], equal[1]:
            labs = {name: start_lab(*load_argv(off, on)) for name, (off, on) in
                    (("slow", slow), ("equal", equal))}
            outputs = {name: finish(p, timeout=120) for name, p in labs.items()}
            results = {name: Result(labs[name].returncode, *out) for name, out in outputs.items()}
            bodies = [json.loads(b) for b in slow[0].generation_bodies()]
        with self.subTest("a known slowdown"):
            r = results["slow"]
            self.assertEqual(r.code, 0, r)
            cell = r.json()
            self.assertEqual((cell["concurrency"], cell["requests"], cell["primary"]), (8, 8, "throughput"))
            for name in ("throughput", "tpot"):
                lo, hi = cell["overheads"][name]["ci95_pct"]
                self.assertTrue(lo <= 30.0 <= hi, (name, lo, hi))
            self.assertEqual(cell["ci95_pct"], cell["overheads"]["throughput"]["ci95_pct"])
            for arm in ("off", "on"):
                s = cell["load"][arm]
                self.assertGreater(s["ttft"]["median_s"], 0)
                self.assertLess(s["ttft"]["median_s"], s["latency"]["median_s"])
                self.assertEqual(len(s["requests"]), 6)
                self.assertEqual({r["tokens"] for trial in s["requests"] for r in trial}, {TOKENS})
            self.assertTrue(all(b["stream"] and len(b["prompt"]) == 1 and b["ignore_eos"] for b in bodies))
            self.assertEqual(len(bodies), 6 * 8)
        with self.subTest("equal arms"):
            r = results["equal"]
            self.assertEqual(r.code, 0, r)
            self.assertEqual({name: o["significant"] for name, o in r.json()["overheads"].items()},
                             {"throughput": False, "latency": False, "ttft": False, "tpot": False})

    def test_sglang_streams_too(self):
        off, on = arms(1.0, engine="sglang")
        with off, on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--concurrency", 2, "--trials", 1,
                        "--warmup", 0, "--max-tokens", 3, "--quiet", "--json")
            body = json.loads(off.generation_bodies()[0])
        self.assertEqual(r.code, 0, r)
        self.assertEqual((body["stream"], type(body["text"])), (True, str))
        self.assertEqual(len(r.json()["load"]["off"]["requests"][0]), 8)

    def test_the_table_and_the_saved_cell(self):
        off, on = arms(1.0)
        with off, on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--concurrency", 2, "--trials", 1,
                        "--warmup", 0, "--max-tokens", 3, "--save", self.path("c.json"))
        self.assertEqual(r.code, 0, r)
        self.assertIn("concurrency 2, 8 requests a trial", r.stdout)
        self.assertIn("TTFT", r.stdout)
        cell = self.load("c.json")["cells"][0]
        self.assertEqual(sorted(cell["overheads"]), ["latency", "throughput", "tpot", "ttft"])


class Precision(TempDirTest):
    def test_stops_once_the_interval_is_narrow_enough_and_says_so(self):
        clock = VirtualClock()
        with mock.patch.object(run, "CLOCK", clock), \
                StubServer(StubConfig(step_delay=0.005, jitter=0.05, seed=1, clock=clock)) as off, \
                StubServer(StubConfig(invariant=True, step_delay=0.005, jitter=0.05, seed=2, slowdown=1.3,
                                      clock=clock)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 2, "--trials", 60,
                        "--warmup", 0, "--max-tokens", 8, "--precision", 3)
            pairs = len(off.generation_bodies())
        self.assertEqual(r.code, 0, r)
        self.assertIn("stopped once the interval was within the asked precision", r.stdout)
        self.assertLess(pairs, 60)
        line = next(x for x in r.stdout.splitlines() if "95% interval" in x)
        lo, hi = [float(v.strip(" %]+")) for v in line.split("[")[1].split(",")]
        self.assertLessEqual((hi - lo) / 2, 3.0)

    def test_says_when_the_trials_ran_out_first(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 1, "--trials", 2,
                        "--warmup", 0, "--max-tokens", 2, "--precision", 0.001)
        self.assertIn("ran every trial (--trials) before the interval was within --precision", r.stdout)


class BadInput(TempDirTest):
    def test_refused_before_any_request(self):
        with StubServer() as stub:
            for extra, message in ((("--concurrency", "0"), "--concurrency"),
                                   (("--concurrency", "4", "--requests", "3"), "--requests: give at least"),
                                   (("--requests", "8"), "--requests goes with --concurrency"),
                                   (("--precision", "0"), "--precision"), (("--precision", "-1"), "--precision")):
                with self.subTest(args=extra):
                    r = run_lab("--mode", "cost", "--url", stub.url, "--invariant", "http://127.0.0.1:9", *extra)
                    self.assertEqual(r.code, 2, r)
                    self.assertIn(message, r.stderr)
            self.assertEqual(stub.requests, [])

    def test_a_server_that_does_not_stream(self):
        with StubServer(StubConfig(faults={1: "nostream"})) as off, StubServer(StubConfig(invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--concurrency", 1, "--trials", 2,
                        "--warmup", 0, "--max-tokens", 2)
        self.assertEqual(r.code, 3, r)
        self.assertIn("did not stream its answer", r.stderr)

    def test_a_stream_cut_in_the_middle_keeps_the_pairs_before_it(self):
        # Per arm: trial 1 sends requests 1-2, trial 2 requests 3-4; the off arm's 4th is cut.
        with StubServer(StubConfig(faults={4: "cutstream"})) as off, StubServer(StubConfig(invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--concurrency", 1, "--requests", 2,
                        "--trials", 3, "--warmup", 0, "--max-tokens", 4, "--save", self.path("c.json"))
        self.assertEqual(r.code, 3, r)
        self.assertIn("cut before it ended", r.stderr)
        cell = self.load("c.json")["cells"][0]
        self.assertEqual((cell["trials"], cell["state"]), (1, "stopped: server error"))


class StreamCounts(TempDirTest):
    """TTFT and TPOT only from streams that report progress token by token."""

    def test_a_stream_that_counts_only_at_the_end_leaves_ttft_and_tpot_unmeasured(self):
        for engine in ("vllm", "sglang"):
            every = {k: "usageatend" for k in range(1, 200)}
            off = StubServer(StubConfig(engine=engine, step_delay=0.01, faults=every))
            on = StubServer(StubConfig(engine=engine, invariant=True, step_delay=0.01, faults=every))
            with self.subTest(engine=engine), off, on:
                r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--concurrency", 4,
                            "--requests", 4, "--trials", 2, "--warmup", 0, "--max-tokens", 6, "--quiet",
                            "--json")
                self.assertEqual(r.code, 0, r)
                cell = r.json()
                for arm in ("off", "on"):
                    s = cell["load"][arm]
                    self.assertIsNone(s["ttft"])
                    self.assertIsNone(s["tpot"])
                    self.assertIn("token by token", s["unmeasured"])
                    self.assertGreater(s["latency"]["median_s"], 0)  # latency and throughput stand
                for name in ("ttft", "tpot"):
                    self.assertIsNone(cell["overheads"][name]["overhead_pct"])
                    self.assertIn("token by token", cell["overheads"][name]["unmeasured"])
                self.assertIsNotNone(cell["overheads"]["throughput"]["overhead_pct"])
                self.assertIsNotNone(cell["overheads"]["latency"]["overhead_pct"])

    def test_the_table_says_unmeasured(self):
        every = {k: "usageatend" for k in range(1, 200)}
        off = StubServer(StubConfig(step_delay=0.01, faults=every))
        on = StubServer(StubConfig(invariant=True, step_delay=0.01, faults=every))
        with off, on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--concurrency", 4,
                        "--requests", 4, "--trials", 2, "--warmup", 0, "--max-tokens", 4, "--quiet")
        self.assertEqual(r.code, 0, r)
        self.assertIn("TTFT     unmeasured: the stream does not report its progress token by token", r.stdout)
        self.assertIn("TTFT unmeasured", r.stdout)

    def test_a_stream_that_reports_more_tokens_than_asked_is_a_server_error(self):
        with StubServer(StubConfig(step_delay=0.01)) as off, \
                StubServer(StubConfig(invariant=True, step_delay=0.01, faults={3: "overshoot"})) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--concurrency", 4,
                        "--requests", 4, "--trials", 2, "--warmup", 0, "--max-tokens", 6, "--quiet")
        self.assertEqual(r.code, 3, r)
        self.assertIn("more than --max-tokens 6 allows", r.stderr)


if __name__ == "__main__":
    unittest.main()


class EventsOverSeveralDataLines(unittest.TestCase):
    """A stream whose events each span several `data:` lines (the SSE standard joins them with
    a line break) is timed as any other: one event, one count."""

    def test_a_load_trial_reads_them(self):
        import types
        from test_transport import sse_server
        events = [{"choices": [{"index": 0, "text": "a"}], "usage": {"completion_tokens": n}}
                  for n in (1, 2)]
        payload = b"".join(b"".join(b"data: " + line.encode() + b"\n"
                                    for line in json.dumps(event, indent=1).splitlines()) + b"\n"
                           for event in events) + b"data: [DONE]\n\n"
        url = sse_server(payload)
        facts = run.ServerFacts("vllm", "m", model_id="m")
        arm = types.SimpleNamespace(client=run.HttpClient(url, None, 10, 1 << 20), facts=facts,
                                    samples=[])
        trials = run.LoadTrials(1, 1, run.Arrivals(None))
        sampling = run.Sampling.of(0.0, 2, None, 0, ignore_eos=True)
        seconds, tokens, timings = trials.run(arm, ["p"], run.ADAPTERS["vllm"], sampling)
        self.assertEqual(tokens, 2)
        self.assertEqual([t.progress_events for t in timings], [2])


# The flat result names of `vllm bench serve --save-result` (vllm/benchmarks/serve.py, 0.34.0:
# lines 1319-1328 and 1426-1432; tests/README.md quotes them)
BENCH_SERVE_NAMES = (
    "duration", "completed", "request_throughput", "output_throughput", "total_token_throughput",
    "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p99_itl_ms",
    "mean_e2el_ms", "median_e2el_ms", "std_e2el_ms", "p99_e2el_ms")


class BenchServeNames(TempDirTest):
    def cost(self, *extra):
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            return run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url,
                           "--trials", 2, "--warmup", 0, "--max-tokens", 4, "--quiet", *extra)

    def test_each_arm_is_saved_under_bench_serve_names_in_milliseconds(self):
        r = self.cost("--concurrency", 2, "--requests", 3, "--result-filename",
                      self.path("cost.json"))
        self.assertEqual(r.code, 0, r)
        cell = self.load("cost.json")["cells"][0]
        for arm in ("off", "on"):
            load, samples = cell["load"][arm], cell[arm]["samples_s"]
            flat = load["bench_serve"]
            self.assertEqual([name for name in BENCH_SERVE_NAMES if name not in flat], [])
            self.assertEqual(flat["completed"], 6)
            self.assertAlmostEqual(flat["duration"], sum(samples))
            self.assertAlmostEqual(flat["request_throughput"], 6 / sum(samples))
            self.assertAlmostEqual(flat["output_throughput"], 6 * 4 / sum(samples))
            self.assertIsNone(flat["total_token_throughput"])  # no prompt count to add
            latencies = [1000 * r["latency_s"] for trial in load["requests"] for r in trial]
            self.assertAlmostEqual(flat["mean_e2el_ms"], sum(latencies) / 6)
            self.assertEqual((flat["max_concurrency"], flat["num_prompts"],
                              flat["request_rate"]), (2, 6, "inf"))
            self.assertIn("p99_s", load["ttft"])  # the lab's own nested figures stay

    def test_percentile_options_choose_the_figures_as_in_bench_serve(self):
        r = self.cost("--concurrency", 2, "--percentile-metrics", "ttft,e2el",
                      "--metric-percentiles", "50,99.9", "--json")
        self.assertEqual(r.code, 0, r)
        flat = r.json()["load"]["off"]["bench_serve"]
        self.assertEqual(sorted(k for k in flat if k.endswith("_ms")),
                         sorted("%s_%s_ms" % (stat, metric) for metric in ("ttft", "e2el")
                                for stat in ("mean", "median", "std", "p50", "p99.9")))

    def test_the_percentile_is_numpys_linear_one(self):
        timings = [run.RequestTiming(t, 2 * t, 2, t, 2, [t]) for t in (0.001, 0.002, 0.004, 0.010)]
        flat = run.BenchServeResult(("ttft",), (50.0, 90.0)).figures([timings], [1.0])
        # np.percentile([1, 2, 4, 10], 50) == 3.0, and at 90: 4 + 0.7 * 6 == 8.2
        self.assertAlmostEqual(flat["p50_ttft_ms"], 3.0)
        self.assertAlmostEqual(flat["p90_ttft_ms"], 8.2)
        self.assertAlmostEqual(flat["mean_ttft_ms"], 4.25)

    def test_save_and_result_filename_naming_two_files_are_refused(self):
        for given in (("--save", "a.json", "--result-filename", "b.json"),
                      ("--result-f=b.json", "--save", "a.json")):
            with self.subTest(options=given):
                r = run_lab("--mode", "cost", "--url", "http://127.0.0.1:9", "--invariant",
                            "http://127.0.0.1:10", *given)
                self.assertEqual(r.code, 2, r)
                self.assertRegex(r.stderr, r"the result is already to be saved in [ab]\.json; "
                                 r"a run saves to one file")

    def test_an_empty_save_path_is_refused_not_taken_for_no_save(self):
        for given in (("--save", ""), ("--result-filename=",), ("--mode", "sweep", "--save=")):
            with self.subTest(options=given):
                r = run_lab("--mode", "cost", "--url", "http://127.0.0.1:9", "--invariant",
                            "http://127.0.0.1:10", *given) if "sweep" not in given else \
                    run_lab("--url", "http://127.0.0.1:9", *given)
                self.assertEqual(r.code, 2, r)
                self.assertIn("an empty path; give the file to save the result in", r.stderr)

    def test_percentile_options_given_empty_are_refused_not_taken_for_the_default(self):
        for given, said in (("--metric-percentiles=", "'' is not a percentile"),
                            ("--percentile-metrics=", "--percentile-metrics: give some of")):
            with self.subTest(option=given):
                r = run_lab("--mode", "cost", "--url", "http://127.0.0.1:9", "--invariant",
                            "http://127.0.0.1:10", "--concurrency", 2, given)
                self.assertEqual(r.code, 2, r)
                self.assertIn(said, r.stderr)

    def test_an_abbreviated_bench_serve_option_gets_its_hint(self):
        for given, said in (("--save-res", "the lab saves with --save FILE"),
                            ("--result-d=/tmp", "give the folder in --save's path"),
                            ("--random-output-len=64", "--max-tokens N: every completion"),
                            ("--ignore-eos", "asks every completion for --max-tokens tokens"),
                            ("--burstiness=0.5", "--request-rate R sends Poisson arrivals")):
            with self.subTest(option=given):
                r = run_lab("--mode", "cost", "--url", "http://127.0.0.1:9", "--invariant",
                            "http://127.0.0.1:10", given)
                self.assertEqual(r.code, 2, r)
                self.assertIn(said, r.stderr)

    def test_bench_serves_request_rate_inf_says_a_burst_is_the_default(self):
        for rate in ("inf", "Infinity"):
            with self.subTest(rate=rate):
                r = run_lab("--mode", "cost", "--url", "http://127.0.0.1:9", "--invariant",
                            "http://127.0.0.1:10", "--concurrency", 2, "--request-rate", rate)
                self.assertEqual(r.code, 2, r)
                self.assertIn("bench serve's --request-rate inf, is what --concurrency does "
                              "without --request-rate: leave it out", r.stderr)

    def test_a_key_given_to_an_option_the_lab_does_not_know_is_not_printed(self):
        secret = "sk-hostile-0123456789"
        known = {"OPENAI_API_KEY": secret}  # the key the lab holds, typed where it means nothing
        for given, env in ((("--apikey", secret), {}), (("--api_key=" + secret,), {}),
                           (("--token", secret), {}), (("--a=" + secret,), {}),
                           ((secret,), known), (("--save-result", secret), known)):
            with self.subTest(options=given):
                r = run_lab("--mode", "cost", "--url", "http://127.0.0.1:9", "--invariant",
                            "http://127.0.0.1:10", *given, env=env)
                self.assertEqual(r.code, 2, r)
                self.assertRegex(r.stderr, "unrecognized arguments|ambiguous option")
                self.assertNotIn(secret, r.stderr + r.stdout)

    def test_an_option_whose_name_only_holds_token_is_echoed_as_given(self):
        for given, shown in ((("--tokenizer", "foo"), "--tokenizer foo"),
                             (("--max-tokenz=9",), "--max-tokenz=9"),
                             (("--hf-token", "hf_secret"), "--hf-token [api key]"),
                             (("--auth_token=s3cret",), "--auth_token=[api key]"),
                             (("--secret-key", "s3cret"), "--secret-key [api key]")):
            with self.subTest(options=given):
                r = run_lab("--mode", "cost", "--url", "http://127.0.0.1:9", "--invariant",
                            "http://127.0.0.1:10", *given)
                self.assertEqual(r.code, 2, r)
                self.assertIn("unrecognized arguments: %s" % shown, r.stderr)

    def test_six_more_bench_serve_spellings_get_their_hint(self):
        for given, said in (("--num-warmups=3", "--warmup N: discarded requests per arm"),
                            ("--host=10.0.0.1", "give the server as --url http://HOST:PORT"),
                            ("--port=8001", "give the server as --url http://HOST:PORT"),
                            ("--backend=vllm", "the lab asks the server which engine it is"),
                            ("--disable-tqdm", "--quiet: no progress lines"),
                            ("--endpoint=/v1/completions",
                             "the lab sends each engine's own generation request")):
            with self.subTest(option=given):
                r = run_lab("--mode", "cost", "--url", "http://127.0.0.1:9", "--invariant",
                            "http://127.0.0.1:10", given)
                self.assertEqual(r.code, 2, r)
                self.assertIn(said, r.stderr)
                self.assertEqual(len(r.stderr.splitlines()), 1, r.stderr)

    def test_cost_mode_takes_seed_and_draws_the_arrivals_from_it(self):
        cfg = run.configure(["--mode", "cost", "--url", "http://127.0.0.1:9", "--invariant",
                             "http://127.0.0.1:10", "--concurrency", "2", "--request-rate",
                             "5", "--seed", "7"])
        self.assertEqual(cfg.cost.trial.seed, 7)
        drawn = []

        class Drawn(Exception):
            pass

        def schedule(arrivals, n, seed):
            drawn.append(seed)
            raise Drawn()

        arm = mock.Mock(samples=[0.1, 0.2])
        with mock.patch.object(run.Arrivals, "schedule", schedule):
            with self.assertRaises(Drawn):
                cfg.cost.trial.run(arm, ["a", "b"], run.ADAPTERS["vllm"], cfg.sampling)
        self.assertEqual(drawn, [7 + 2])  # the third trial's arrivals
        self.assertIn("--request-rate's arrivals are drawn from",
                      " ".join(run.build_parser().format_help().split()))

    def test_options_that_mean_nothing_here_are_refused_with_a_hint(self):
        cases = {
            ("--save-result",): "the lab saves with --save FILE, or --result-filename FILE",
            ("--concurrency", 2, "--percentile-metrics", "client_queue_time"):
                "--percentile-metrics: client_queue_time is not measured here",
            ("--batch", 2, "--metric-percentiles", "50"):
                "--metric-percentiles goes with --concurrency",
            ("--concurrency", 2, "--metric-percentiles", "101"):
                "--metric-percentiles: '101' is not a percentile from 0 to 100"}
        for extra, said in cases.items():
            with self.subTest(options=extra):
                r = run_lab("--mode", "cost", "--url", "http://127.0.0.1:9", "--invariant",
                            "http://127.0.0.1:10", *extra)
                self.assertEqual(r.code, 2, r)
                self.assertIn(said, r.stderr)


class TheNamesUsersKnow(unittest.TestCase):
    def test_bench_serve_spellings_are_the_labs_options(self):
        parser = run.build_parser()
        ours = parser.parse_args(["--mode", "cost", "--url", "http://h:1", "--concurrency", "8",
                                  "--requests", "40"])
        theirs = parser.parse_args(["--mode", "cost", "--base-url", "http://h:1",
                                    "--max-concurrency", "8", "--num-prompts", "40"])
        for name in ("url", "concurrency", "requests"):
            self.assertEqual(getattr(theirs, name), getattr(ours, name))
        text = parser.format_help()
        for option in ("--base-url", "--max-concurrency", "--num-prompts"):
            self.assertIn(option, text)

    def test_load_figures_are_mean_median_p90_p99_with_itl(self):
        timings = [run.RequestTiming(0.010 * k, 0.1 * k, 5, 0.02, 5, [0.02, 0.02, 0.03, 0.01])
                   for k in range(1, 11)]
        stats = run.LoadStats.of([timings], [1.0], [50])
        self.assertAlmostEqual(stats.ttft.mean_s, 0.055)
        self.assertAlmostEqual(stats.ttft.median_s, 0.055)
        # numpy's linear percentile, as bench serve's saved figures (one function for both)
        self.assertAlmostEqual(stats.ttft.p90_s, 0.091)
        self.assertAlmostEqual(stats.ttft.p99_s, 0.0991)
        self.assertAlmostEqual(stats.itl.mean_s, 0.02)
        self.assertAlmostEqual(stats.itl.p99_s, 0.03)
        record = run.as_record(stats)
        self.assertEqual(sorted(record["itl"]), ["mean_s", "median_s", "p90_s", "p99_s"])
        self.assertNotIn("itl_s", record["requests"][0][0])  # gaps summed up, not saved one by one

    def test_what_a_load_report_prints_is_what_it_saves(self):
        # uneven latencies, where a nearest-rank p99 and an interpolated one part
        timings = [[run.RequestTiming(0.001 * k * k, 0.01 * k * k, 5, 0.002 * k, 5,
                                      [0.002 * k] * 4) for k in range(1, 12)],
                   [run.RequestTiming(0.003 * k, 0.02 * k, 5, 0.001 * k, 5, [0.001 * k] * 4)
                    for k in range(1, 8)]]
        samples = [0.5, 0.3]
        chosen = run.BenchServeResult(percentiles=(90.0, 99.0))
        stats = run.LoadStats.of(timings, samples, [55, 35], chosen)
        flat = stats.bench_serve
        for spread, metric in ((stats.ttft, "ttft"), (stats.tpot, "tpot"),
                               (stats.itl, "itl"), (stats.latency, "e2el")):
            with self.subTest(metric=metric):
                self.assertEqual(1000 * spread.p90_s, flat["p90_%s_ms" % metric])
                self.assertEqual(1000 * spread.p99_s, flat["p99_%s_ms" % metric])
                self.assertEqual(1000 * spread.median_s, flat["median_%s_ms" % metric])
        cell = run.LoadCell(2, 11, "throughput", "burst", {"off": stats},
                            {f: run.Overhead(None, None, False, unmeasured="x")
                             for f in run.LOAD_FIGURES})
        printed = io.StringIO()
        cell.report("time per trial", run.Out(printed, io.StringIO()))
        text = printed.getvalue()
        self.assertIn("E2E %s" % "/".join("%.1f" % flat["%s_e2el_ms" % name]
                                          for name in ("mean", "median", "p90", "p99")), text)
        self.assertIn("TTFT %s" % "/".join("%.1f" % flat["%s_ttft_ms" % name]
                                           for name in ("mean", "median", "p90", "p99")), text)
        self.assertIn("%.2f requests/s (median trial)" % stats.median_requests_per_s, text)
        self.assertIn("all trials as one run %.1f tokens/s, %.2f requests/s"
                      % (flat["output_throughput"], flat["request_throughput"]), text)

    def test_a_load_run_prints_the_four_figures_of_each(self):
        with StubServer(StubConfig(step_delay=0.002)) as off, \
                StubServer(StubConfig(invariant=True, step_delay=0.002)) as on:
            r = run_lab("--mode", "cost", "--base-url", off.url, "--invariant", on.url,
                        "--max-concurrency", 2, "--num-prompts", 4, "--trials", 2, "--warmup", 0,
                        "--max-tokens", 6)
        self.assertEqual(r.code, 0, r.stderr)
        self.assertRegex(r.stdout, r"mean/median/p90/p99 ms: TTFT [0-9.]+/[0-9.]+/[0-9.]+/"
                                   r"[0-9.]+, TPOT [0-9./]+, ITL [0-9./]+, E2E [0-9./]+")
