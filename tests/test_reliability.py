"""Reliability, second round: no input, answer, signal or disk crashes the lab, loses a
measurement or leaks a secret. One class per kind of fault; each test asserts the exit code,
the one stderr line (no traceback), what was saved and, where it applies, that no request
was sent."""

import json
import math
import os
import random
import signal
import stat
import subprocess
import sys
import time
import unittest
from unittest import mock

from stub_server import BadRequest, EngineState, models_list, sglang_generate, sglang_server_info, vllm_completions, vllm_server_info
from support import ROOT, Result, StubConfig, StubServer, TempDirTest, free_port, run, run_lab, wait_for


FUZZ_RUNS = 300  # sweeps against randomly damaged answers (about 5 s)


def one_error_line(test, r, code, message):
    """Exit code, and exactly one line on stderr besides progress, holding message."""
    test.assertEqual(r.code, code, r)
    lines = [line for line in r.stderr.splitlines() if line.strip()
             and not line.startswith(("run.py: progress: ", "run.py: saved "))]
    test.assertEqual(len(lines), 1, r.stderr)
    test.assertIn(message, lines[0])
    test.assertNotIn("Traceback", r.stderr)


class NumbersThatAreNotNumbers(TempDirTest):
    def test_every_numeric_option_takes_only_a_finite_value_in_range(self):
        with StubServer() as stub:
            cases = [("--timeout", "nan"), ("--timeout", "inf"), ("--timeout", "-1"), ("--temperature", "nan"),
                     ("--temperature", "１"), ("--max-tokens", "٣"), ("--max-tokens", "1e3"), ("--logprobs", "²"),
                     ("--repeat", "3.0"), ("--sizes", "1,²"), ("--sizes", "1,٣"), ("--max-batch", "0x10"),
                     ("--seed", "-1"), ("--max-response-mb", "0"), ("--wait-ready", "nan")]
            for option, value in cases:
                with self.subTest(option=option, value=value):
                    r = run_lab("--mode", "sweep", "--url", stub.url, option, value)
                    one_error_line(self, r, 2, option)
            for option, value in (("--trials", "NaN"), ("--batch", "+inf"), ("--warmup", "-1"), ("--tp", "0"),
                                  ("--prefix-tokens", "1.5")):
                with self.subTest(option=option, value=value):
                    r = run_lab("--mode", "cost", "--url", stub.url, "--invariant", "http://127.0.0.1:9", option, value)
                    one_error_line(self, r, 2, option)
            self.assertEqual(stub.requests, [])


class FilesThatAreNotFiles(TempDirTest):
    def test_devices_fifos_and_folders_are_refused_before_any_request(self):
        fifo = self.path("fifo")
        os.mkfifo(fifo)
        with StubServer() as stub:
            for option, path in (("--prompt-file", "/dev/zero"), ("--prompt-file", fifo), ("--prompt-file", self.tmp),
                                 ("--baseline", "/dev/zero"), ("--baseline", fifo), ("--save", "/dev/null")):
                with self.subTest(option=option, path=path):
                    r = run_lab("--mode", "sweep", "--url", stub.url, option, path)
                    one_error_line(self, r, 2, "is not a regular file")
            self.assertEqual(stub.requests, [])

    def test_a_file_over_the_limit_is_refused_unread(self):
        big = self.path("big.txt")
        with open(big, "wb") as f:
            f.truncate(3 << 20)  # sparse: nothing to read
        with mock.patch.object(run, "MAX_INPUT_FILE_MB", 2), mock.patch("builtins.open", side_effect=AssertionError):
            with self.assertRaises(run.UsageError) as caught:
                run.read_input_file(big, "--prompt-file")
        self.assertIn("larger than 2 MB", str(caught.exception))


def random_json(rng, depth=0):
    """Any JSON value: every type, odd numbers, odd strings, some nesting."""
    kinds = ["null", "bool", "int", "big", "float", "nan", "str", "numstr"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([0, 1, -1, 7, 64, 2 ** 31])
    if kind == "big":
        return 10 ** rng.choice([20, 300, 400])
    if kind == "float":
        return rng.choice([0.5, -3.25, 1e308, -1e-320])
    if kind == "nan":
        return rng.choice([math.nan, math.inf, -math.inf])
    if kind == "str":
        return rng.choice(["", "x", "token_id:1", "\u00e9\u2603", "a" * 300])
    if kind == "numstr":
        return rng.choice(["1", "1.5", "NaN", "-9999.0"])
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["index", "text", "data", "id", "version", "bs", "x"]): random_json(rng, depth + 1)
            for _ in range(rng.randrange(4))}


def damage(value, rng, depth=0):
    """value with one random change somewhere: a key dropped, a value replaced by any JSON."""
    if depth > 8 or rng.random() < 0.2:
        return random_json(rng)
    if isinstance(value, dict) and value:
        value = dict(value)
        key = rng.choice(sorted(value, key=str))
        if rng.random() < 0.25:
            del value[key]
        else:
            value[key] = damage(value[key], rng, depth + 1)
        return value
    if isinstance(value, list) and value:
        value = list(value)
        i = rng.randrange(len(value))
        value[i] = damage(value[i], rng, depth + 1)
        if rng.random() < 0.15:
            value.append(value[i])  # a duplicate
        return value
    return random_json(rng)


class ServerValuesAreUntrusted(unittest.TestCase):
    """Fuzz: randomly typed and damaged answers for every endpoint of both engines end in
    exit 3 or a correct result, never a traceback (in under 10 s)."""

    def answers(self, engine):
        """The engine's answers as the practice engine gives them: info by path, generations
        computed from each request's own body."""
        config = StubConfig(engine=engine)
        if engine == "vllm":
            return {"/version": {"version": "0.26.0"}, "/v1/models": models_list(config),
                    "/server_info?config_format=json": vllm_server_info(config),
                    "/v1/completions": lambda body: vllm_completions(config, body, EngineState(config))}
        return {"/server_info": sglang_server_info(config, 30000), "/v1/models": models_list(config),
                "/generate": lambda body: sglang_generate(config, body, EngineState(config)),
                "/flush_cache": "Cache flushed."}

    def test_fuzz_every_endpoint_of_both_engines(self):
        rng = random.Random(2026)
        outcomes = {"vllm": set(), "sglang": set()}
        for _ in range(FUZZ_RUNS):
            engine = rng.choice(["vllm", "sglang"])
            good = self.answers(engine)
            damaged = rng.choice(sorted(good) + [None])  # None: every answer as sent
            seed = rng.random()

            def request(client, path, body=None, as_text=False, _good=good, _damaged=damaged, _seed=seed):
                if path not in _good:
                    raise run.ServerError("HTTP 404 from %s: Not Found" % path, 404)
                try:
                    answer = _good[path](body) if callable(_good[path]) else _good[path]
                except BadRequest as err:  # what the engine would refuse, it answers with an error
                    raise run.ServerError("HTTP %d from %s: %s" % (err.status, path, err.message), err.status)
                if path == _damaged:
                    answer = damage(answer, random.Random(_seed))
                if as_text:
                    return answer if isinstance(answer, str) else json.dumps(answer)
                return json.loads(json.dumps(answer))  # what json.loads of the wire gives

            with mock.patch.object(run.HttpClient, "request", request):
                r = run_lab("--mode", "sweep", "--engine", engine, "--url", "http://127.0.0.1:9", "--sizes", "1,2",
                            "--max-tokens", 3, "--logprobs", 2, "--repeat", 1, "--quiet", "--json")
            self.assertNotIn("Traceback", r.stderr, (engine, damaged))
            self.assertIn(r.code, (0, 1, 2, 3), r)
            if r.code == 0:
                json.loads(r.stdout)  # a correct result, in standard JSON
            else:
                errors = [x for x in r.stderr.splitlines() if x.startswith("run.py: ") and "warning" not in x]
                self.assertEqual(len(errors), 1, r.stderr)
            outcomes[engine].add(r.code)
        for engine in outcomes:
            self.assertTrue({0, 3} <= outcomes[engine], outcomes)

    def test_a_damaged_answer_mid_run_says_how_far_the_run_got(self):
        with StubServer(StubConfig(faults={3: "nochoices"})) as stub:
            path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "lab-rel-%d.json" % os.getpid())
            try:
                r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2,4", "--max-tokens", 4, "--repeat", 1,
                            "--save", path)
                with open(path) as f:
                    doc = json.load(f)
            finally:
                if os.path.exists(path):
                    os.unlink(path)
        self.assertEqual(r.code, 3)
        self.assertEqual(doc["summary"]["state"], "stopped: server error")
        self.assertEqual([s["batch_size"] for s in doc["prompts"][0]["sizes"]], [1, 2])

    def test_nan_logprobs_never_count_as_equal_and_the_file_stays_standard_json(self):
        base = run.Completion("a", ["a"], [math.nan], [{}])
        other = run.Completion("a", ["a"], [math.nan], [{}])
        d = run.compare_completions(base, other)
        self.assertEqual((d.first_ulp_step, d.ulp_notes), (0, ("non-finite",)))
        self.assertEqual(json.loads(run.json_text({"x": [math.nan, math.inf]})), {"x": ["NaN", "Infinity"]})

    def test_choice_indexes_must_be_whole_and_distinct(self):
        adapter = run.ADAPTERS["vllm"]
        for indexes in ([0, 0], [None, 1], ["0", 1], [0, 2], [True, 1]):
            with self.subTest(indexes=indexes):
                answer = {"choices": [{"index": i, "text": "x", "logprobs": None} for i in indexes]}
                with self.assertRaises(run.ServerError):
                    adapter.completions(answer, 2, False)


class SavingCanFail(TempDirTest):
    def test_a_save_that_fails_after_measuring_fails_the_run_but_keeps_the_table(self):
        real = run.write_json_atomic
        calls = []

        def full_disk(path, doc, *pieces):
            calls.append(doc["summary"]["state"])
            if len(calls) > 1:
                raise run.SaveError("--save: cannot write %s (No space left on device)" % path)
            return real(path, doc, *pieces)

        with StubServer() as stub, mock.patch.object(run, "write_json_atomic", full_disk):
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2,3", "--max-tokens", 4, "--repeat", 1,
                        "--save", self.path("s.json"))
        one_error_line(self, r, 3, "No space left on device")
        self.assertIn("summary: unique completions", r.stdout)  # the table is still printed
        self.assertEqual(self.load("s.json")["summary"]["state"], "running")  # the last good file is whole

    def test_a_folder_that_cannot_be_written_is_refused_before_any_request(self):
        if os.geteuid() == 0:
            target = "/proc/lab-cannot-write-here.json"
        else:
            os.chmod(self.tmp, stat.S_IRUSR | stat.S_IXUSR)
            self.addCleanup(os.chmod, self.tmp, stat.S_IRWXU)
            target = self.path("s.json")
        with StubServer() as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--save", target)
            self.assertEqual(stub.requests, [])
        one_error_line(self, r, 2, "--save: cannot write in")

    def test_two_cost_runs_saving_to_one_file_keep_both_cells(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "run.py"), "--mode", "cost", "--url", off.url,
                                       "--invariant", on.url, "--batch", "1", "--trials", "6", "--warmup", "0",
                                       "--max-tokens", "2", "--workload", workload, "--prefix-tokens", "8",
                                       "--quiet", "--save", self.path("c.json")],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                     for workload in ("cold", "shared-prefix")]
            errors = [p.communicate(timeout=120)[1] for p in procs]
        self.assertEqual([p.returncode for p in procs], [0, 0], errors)
        self.assertEqual(sorted(c["workload"] for c in self.load("c.json")["cells"]), ["cold", "shared-prefix"])

    def test_a_finished_sweep_is_never_replaced(self):
        with StubServer() as stub:
            args = ("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 2, "--repeat", 1,
                    "--save", self.path("s.json"))
            self.assertEqual(run_lab(*args).code, 0)
            before = self.load("s.json")
            n = len(stub.requests)
            r = run_lab(*args)
            self.assertEqual(len(stub.requests), n)
        one_error_line(self, r, 2, "holds a finished sweep")
        self.assertEqual(self.load("s.json"), before)


class Signals(TempDirTest):
    def stop_with(self, signum, args, progressed):
        return self.run_and_signal(args, progressed, signum)

    def test_sigterm_and_sighup_stop_like_ctrl_c_with_their_own_codes(self):
        for signum, code, state in ((signal.SIGTERM, 143, "terminated"), (signal.SIGHUP, 129, "hung up")):
            with self.subTest(signal=signum.name), StubServer(StubConfig(step_delay=0.02)) as stub:
                name = "%s.json" % signum.name
                code_got, out, err = self.stop_with(signum, [
                    "--mode", "sweep", "--url", stub.url, "--sizes", ",".join(map(str, range(1, 40))),
                    "--max-tokens", "8", "--repeat", "1", "--save", self.path(name)],
                    lambda: len(((self.saved(name) or {}).get("prompts") or [{"sizes": []}])[0]["sizes"]) >= 1)
                self.assertEqual(code_got, code, err)
                self.assertIn("stopping after the current request", err)
                self.assertNotIn("Traceback", err)
                self.assertIn("summary:", out)
                self.assertEqual(self.load(name)["summary"]["state"], state)
                self.assertEqual([f for f in os.listdir(self.tmp) if f.startswith(".run-")], [])

    def test_ctrl_c_during_warm_up_stops_after_the_current_warm_up_request(self):
        with StubServer(StubConfig(step_delay=0.05)) as off, StubServer(StubConfig(invariant=True, step_delay=0.05)) as on:
            code, out, err = self.stop_with(signal.SIGINT, [
                "--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", "1", "--trials", "3",
                "--warmup", "50", "--max-tokens", "4"], lambda: len(off.generation_bodies()) >= 1)
            sent = len(off.generation_bodies()) + len(on.generation_bodies())
        self.assertEqual(code, 130, err)
        self.assertIn("no complete trial pair", err)
        self.assertLess(sent, 10)


class VerdictsClaimOnlyWhatWasMeasured(TempDirTest):
    def test_no_completion_compared_is_no_data_and_fails_every_expect(self):
        for expect in ("invariant", "variant"):
            with self.subTest(expect=expect), StubServer(StubConfig(faults={1: "http500"})) as stub:
                r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--expect", expect, "--repeat", 1,
                            "--save", self.path(expect + ".json"))
                self.assertNotEqual(r.code, 0)
                self.assertEqual(self.load(expect + ".json")["summary"]["verdict"], "no data")

    def test_a_single_size_cannot_be_invariant(self):
        with StubServer(StubConfig(invariant=True)) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1", "--expect", "invariant", "--json")
        self.assertEqual(r.code, 1, r)
        self.assertEqual(r.json()["summary"]["verdict"], "nothing compared")
        self.assertIn("batch 1 was the only size", r.stderr)

    def test_too_few_pairs_have_no_interval_and_are_never_significant(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 1, "--trials",
                        run.MIN_PAIRS_FOR_INTERVAL - 1, "--warmup", 0, "--max-tokens", 2)
        self.assertEqual(r.code, 0, r)
        self.assertIn("no interval: 5 trial pairs, an interval needs at least 6", r.stdout)
        stats = run.Overhead.of([1.0] * 5, [2.0] * 5)
        self.assertEqual((stats.ci95_pct, stats.significant), (None, False))
        self.assertTrue(run.Overhead.of([1.0] * 6, [2.0] * 6).significant)


class Networks(TempDirTest):
    def test_a_server_trickling_bytes_meets_a_total_deadline(self):
        with StubServer(StubConfig(faults={2: "trickle"})) as stub:
            p = subprocess.Popen([sys.executable, os.path.join(ROOT, "run.py"), "--mode", "sweep", "--url",
                                  stub.url, "--sizes", "1,2", "--timeout", "1", "--repeat", "1", "--max-tokens",
                                  "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:  # a liveness bound: the trickled body alone takes 20 s
                out, err = p.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                raise
        one_error_line(self, Result(p.returncode, out, err), 3, "within 1s (--timeout)")

    def test_a_connection_closed_mid_body_is_dropped_not_invalid_json(self):
        with StubServer(StubConfig(faults={2: "truncate"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--repeat", 1, "--max-tokens", 2)
        one_error_line(self, r, 3, "dropped")


class ProxiesForThisMachine(TempDirTest):
    def test_the_machines_own_name_bypasses_a_dead_proxy(self):
        dead = "http://127.0.0.1:%d" % free_port()
        with StubServer() as stub, mock.patch.object(run.socket, "gethostname", lambda: "gpu-box-7"), \
                mock.patch.object(run.socket, "getaddrinfo", self.resolve_to_loopback(run.socket.getaddrinfo)):
            port = stub.url.rsplit(":", 1)[1]
            env = dict(os.environ, http_proxy=dead, HTTP_PROXY=dead, no_proxy="", NO_PROXY="")
            r = run_lab("--mode", "sweep", "--url", "http://gpu-box-7:%s" % port, "--sizes", "1,2", "--repeat", 1,
                        "--max-tokens", 2, env=env)
        self.assertEqual(r.code, 0, r)

    @staticmethod
    def resolve_to_loopback(real):
        def resolve(host, *args, **kwargs):
            return real("127.0.0.1" if host == "gpu-box-7" else host, *args, **kwargs)
        return resolve


class Secrets(TempDirTest):
    def test_credentials_in_a_url_are_refused_and_never_printed(self):
        for url in ("http://alice:s3cret-pw@127.0.0.1:8000", "http://alice:s3cret-pw@127.0.0.1:80x/v1"):
            with self.subTest(url=url):
                r = run_lab("--mode", "sweep", "--url", url)
                one_error_line(self, r, 2, "password in the URL is not accepted")
                self.assertNotIn("s3cret", r.stderr + r.stdout)

    def test_a_key_the_server_echoes_is_redacted(self):
        with StubServer(StubConfig(faults={2: "echokey"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--repeat", 1, "--max-tokens", 2,
                        "--api-key", "sk-very-secret-77", "--save", self.path("s.json"))
            with open(self.path("s.json")) as f:
                saved = f.read()
        one_error_line(self, r, 3, "HTTP 401")
        self.assertIn("[api key]", r.stderr)
        self.assertNotIn("sk-very-secret-77", r.stderr + r.stdout + saved)


class CostArms(TempDirTest):
    def test_two_paths_behind_one_gateway_are_two_servers(self):
        self.assertNotEqual(run.server_address("http://gw:8000/arm-a"), run.server_address("http://gw:8000/arm-b/"))
        self.assertEqual(run.server_address("http://localhost:8000/a"), run.server_address("http://127.0.0.1:8000/a/"))

    def test_with_allow_mismatch_each_arm_is_asked_for_its_own_model(self):
        with StubServer(StubConfig(model="m/off")) as off, StubServer(StubConfig(invariant=True, model="m/on")) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 1, "--trials", 1,
                        "--warmup", 0, "--max-tokens", 2, "--allow-mismatch", "--json")
            off_models = {json.loads(b)["model"] for b in off.generation_bodies()}
            on_models = {json.loads(b)["model"] for b in on.generation_bodies()}
        self.assertEqual(r.code, 0, r)
        self.assertEqual((off_models, on_models), ({"m/off"}, {"m/on"}))


class WholeAnswerDeadline(TempDirTest):
    """One deadline covers an answer from connecting to its last byte, and a stop signal
    abandons a stuck request."""

    def test_a_status_line_trickled_a_byte_at_a_time_is_cut_at_the_timeout(self):
        with StubServer(StubConfig(faults={2: "slowstatus"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                        "--repeat", 1, "--timeout", 1)
        self.assertEqual(r.code, 3, r)
        self.assertIn("no complete answer from %s within 1s (--timeout)" % stub.url, r.stderr)

    def test_sigterm_during_a_stuck_request_saves_and_ends(self):
        # The second request's status line would take 60 s to trickle in, under the default
        # --timeout of 600 s: only abandoning it ends the run (the wait below is a liveness bound).
        with StubServer(StubConfig(faults={2: "slowstatus"})) as stub:
            save = self.path("s.json")
            p = subprocess.Popen([sys.executable, os.path.join(ROOT, "run.py"), "--mode", "sweep", "--url",
                                  stub.url, "--sizes", "1,2", "--max-tokens", "4", "--repeat", "1",
                                  "--save", save], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self.assertTrue(wait_for(lambda: len(stub.generation_bodies()) >= 2, 30), "never sent batch 2")
            p.send_signal(signal.SIGTERM)
            out, err = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 143, err)
        self.assertEqual(self.load("s.json")["summary"]["state"], "terminated")
        self.assertIn("summary:", out)


if __name__ == "__main__":
    unittest.main()
