"""What a user expects: progress on long runs, the engine found by itself, URLs as people paste
them, and saves that stay cheap."""

import json
import os
import subprocess
import sys
import threading
import unittest
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from unittest import mock

from support import ROOT, StubConfig, StubServer, TempDirTest, run, run_lab


def progress_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("run.py: progress: ")]


class Progress(TempDirTest):
    def test_sweep_and_cost_leave_progress_lines_in_a_redirected_stderr(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            for name, args in (("sweep", ("--mode", "sweep", "--url", off.url, "--sizes", "1,2,4", "--max-tokens", "4")),
                               ("cost", ("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", "2",
                                         "--trials", "3", "--warmup", "0", "--max-tokens", "4"))):
                for extra in ((), ("--json",)):
                    with self.subTest(mode=name, extra=extra):
                        with open(self.path("err.txt"), "w") as err:
                            p = subprocess.run([sys.executable, os.path.join(ROOT, "run.py"), *args, *extra],
                                               stdout=subprocess.PIPE, stderr=err, text=True, timeout=120)
                        self.assertEqual(p.returncode, 0)
                        with open(self.path("err.txt")) as f:
                            lines = progress_lines(f.read())
                        self.assertTrue(lines)
                        self.assertIn(" done | ", lines[-1])
                        if extra:
                            json.loads(p.stdout)  # progress never reaches stdout

    def test_quiet_prints_none_and_json_still_parses(self):
        with StubServer() as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4, "--quiet", "--json")
        self.assertEqual(r.code, 0, r)
        self.assertEqual(progress_lines(r.stderr), [])
        self.assertEqual(r.json()["summary"]["state"], "complete")

    def test_lines_say_what_ran_how_far_and_how_long(self):
        with StubServer() as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2,4", "--repeat", 2, "--max-tokens", 4)
        first, last = progress_lines(r.stderr)[0], progress_lines(r.stderr)[-1]
        self.assertIn("prompt 1/1, pass 1/2, batch 1 done | 1/6 batches, 1 completions", first)
        self.assertIn("left", first)
        self.assertIn("6/6 batches, 14 completions", last)

    def test_a_live_line_on_a_terminal(self):
        class Tty:
            def __init__(self):
                self.text = ""

            def isatty(self):
                return True

            def write(self, s):
                self.text += s

            def flush(self):
                pass

        tty = Tty()
        progress = run.Progress(run.Out(Tty(), tty), 4, "batches")
        progress.running("batch 2")
        progress.finished("batch 2", 2)
        self.assertTrue(tty.text.startswith("\r\033[K") and "batch 2 | 0/4 batches" in tty.text)
        self.assertNotIn("\n", tty.text)


class EngineFoundByItself(TempDirTest):
    def test_no_engine_named(self):
        for engine, label in (("sglang", "SGLang"), ("vllm", "vLLM")):
            with self.subTest(engine=engine):
                with StubServer(StubConfig(engine=engine)) as stub:
                    r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                                "--repeat", 1, "--save", self.path(engine + ".json"))
                self.assertEqual(r.code, 0, r)
                self.assertTrue(r.stdout.startswith("server: %s " % label), r.stdout[:80])
                self.assertIn("(found by asking the server)", r.stdout.splitlines()[0])
                doc = self.load(engine + ".json")
                self.assertEqual((doc["engine"], doc["engine_detected"]), (engine, True))

    def test_cost_finds_it_on_both_arms(self):
        with StubServer(StubConfig(engine="sglang")) as off, StubServer(StubConfig(engine="sglang", invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 1, "--trials", 1,
                        "--warmup", 0, "--max-tokens", 2, "--json")
        self.assertEqual(r.code, 0, r)
        self.assertEqual(r.json()["engine"], "sglang")

    def test_arms_of_two_engines_are_refused(self):
        with StubServer() as off, StubServer(StubConfig(engine="sglang", invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url)
        self.assertEqual(r.code, 2, r)
        self.assertIn("different engines", r.stderr)

    def test_the_wrong_engine_named_gets_a_hint(self):
        for server, named, hint in (("sglang", "vllm", "answers like SGLang: pass --engine sglang"),
                                    ("vllm", "sglang", "answers like vLLM: pass --engine vllm")):
            with self.subTest(server=server, named=named):
                with StubServer(StubConfig(engine=server)) as stub:
                    r = run_lab("--mode", "sweep", "--engine", named, "--url", stub.url, "--sizes", "1")
                    self.assertEqual(r.code, 3, r)
                    self.assertIn(hint, r.stderr)
                    self.assertEqual(len(r.stderr.strip().splitlines()), 1)
                    self.assertEqual(stub.generation_bodies(), [])

    def test_a_server_that_is_neither(self):
        class NotFound(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
        thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        try:
            r = run_lab("--mode", "sweep", "--url", "http://127.0.0.1:%d" % httpd.server_address[1], "--sizes", "1")
        finally:
            httpd.shutdown()
            httpd.server_close()
        self.assertEqual(r.code, 3, r)
        self.assertIn("cannot tell which engine answers", r.stderr)
        self.assertIn("name it with --engine", r.stderr)


class Urls(unittest.TestCase):
    def test_as_people_paste_them(self):
        cases = {"http://127.0.0.1:8000/v1": "http://127.0.0.1:8000",
                 "http://127.0.0.1:8000/v1/": "http://127.0.0.1:8000",
                 "http://0.0.0.0:8000": "http://127.0.0.1:8000",
                 "http://[::]:8000/v1": "http://[::1]:8000",
                 "https://gpu.example/llm/v1": "https://gpu.example/llm",
                 "http://localhost:30000/": "http://localhost:30000"}
        for given, wanted in cases.items():
            with self.subTest(url=given):
                self.assertEqual(run.check_url(given, "--url"), wanted)

    def test_a_v1_url_and_the_address_vllm_logs_work(self):
        with StubServer() as stub:
            port = stub.url.rsplit(":", 1)[1]
            for url in ("http://127.0.0.1:%s/v1" % port, "http://0.0.0.0:%s" % port):
                with self.subTest(url=url):
                    r = run_lab("--mode", "sweep", "--url", url, "--sizes", "1,2", "--max-tokens", 4, "--repeat", 1)
                    self.assertEqual(r.code, 0, r)


class CheapSaves(TempDirTest):
    def test_a_fast_run_writes_the_file_once_during_the_run_and_once_at_the_end(self):
        writes = []
        real = run.write_json_atomic
        with mock.patch.object(run, "write_json_atomic", side_effect=lambda p, d, *pieces: (writes.append(d["summary"]["state"]), real(p, d, *pieces))):
            with StubServer() as stub:
                r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2,3,4,5,6,7,8", "--max-tokens", 2,
                            "--repeat", 2, "--save", self.path("s.json"))
        self.assertEqual(r.code, 0, r)
        self.assertEqual(writes, ["running", "complete"])
        self.assertEqual(len(self.load("s.json")["prompts"][0]["sizes"]), 8)

    def test_the_schedule(self):
        clock = [100.0]

        def save(number, seconds):
            def write(path):
                built.append(number)
                clock[0] += seconds
            return write

        with mock.patch.object(run.time, "monotonic", lambda: clock[0]):
            saves = run.ThrottledSave(self.path("x.json"))
            built = []
            saves.offer(save(1, 0.5))                               # first: written, took 0.5 s
            self.assertEqual(saves.next_due, 100.5 + 2.0)           # 0.5 s is a fifth of 2.5 s
            clock[0] = 101.0
            saves.offer(save(2, 0.1))                               # not due: not even built
            self.assertEqual(built, [1])
            clock[0] = 102.5
            saves.offer(save(3, 0.01))                              # due; quick, so the interval rules
            self.assertEqual((built, saves.next_due), ([1, 3], 102.51 + 1.0))
        self.assertEqual(run.ThrottledSave(None).offer(lambda path: 1 / 0), None)  # no --save: nothing built

    def test_saved_json_is_one_compact_line(self):
        run.write_json_atomic(self.path("c.json"), {"a": [1, 2], "b": {"c": None}})
        with open(self.path("c.json")) as f:
            self.assertEqual(f.read(), '{"a":[1,2],"b":{"c":null}}\n')


class LiveTable(TempDirTest):
    def test_the_header_and_the_first_row_are_out_before_the_sweep_ends(self):
        # A slow practice engine (10 ms a step), stopped once its first size is done: stdout,
        # a pipe, already holds the header and that size's row.
        with StubServer(StubConfig(step_delay=0.01)) as stub:
            p = subprocess.Popen([sys.executable, os.path.join(ROOT, "run.py"), "--mode", "sweep", "--url", stub.url,
                                  "--sizes", "1,2,3,4,5,6,7,8", "--max-tokens", "40", "--repeat", "1"],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            lines = []
            while True:  # read until the first row; the sweep is still running then
                line = p.stdout.readline()
                self.assertNotEqual(line, "", "stdout ended before the first row: %r" % lines)
                lines.append(line)
                if line.split()[:1] == ["1"]:
                    break
            self.assertIsNone(p.poll(), "the sweep had ended: the test proves nothing")
            p.terminate()
            rest, _ = p.communicate(timeout=60)
        head = "".join(lines)
        self.assertTrue(head.startswith("server: vLLM"), head)
        self.assertIn("params: 40 tokens", head)
        self.assertIn("known hazards", head)
        self.assertIn("prefix cache bypass", head)
        self.assertNotIn("summary:", head)
        self.assertIn("summary:", rest)  # the stop still prints what was measured

    def test_json_is_still_one_document(self):
        with StubServer(StubConfig()) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4, "--json")
        self.assertEqual(r.code, 0, r)
        self.assertEqual(r.json()["summary"]["state"], "complete")


class PassLines(unittest.TestCase):
    def test_a_held_expectation_says_so(self):
        with StubServer(StubConfig(invariant=True)) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2,9", "--max-tokens", 8,
                        "--repeat", 2, "--expect", "invariant")
        self.assertEqual(r.code, 0, r)
        self.assertEqual(r.stdout.strip().splitlines()[-1], "expect invariant: held (1 unique of 24, max ULP 0)")
        with StubServer(StubConfig()) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,9", "--max-tokens", 8, "--repeat", 1,
                        "--expect", "variant")
        self.assertEqual(r.code, 0, r)
        self.assertIn("expect variant: held (tokens diverged: 2 unique of 10, max ULP", r.stdout)

    def test_no_line_without_an_expectation(self):
        with StubServer(StubConfig(invariant=True)) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4)
        self.assertNotIn("expect", r.stdout)


class Durations(unittest.TestCase):
    def test_over_a_minute_in_minutes_and_seconds(self):
        for seconds, text in ((0.4, "0s"), (42.4, "42s"), (59.6, "1m 00s"), (185, "3m 05s"),
                              (3612.4, "1h 00m 12s")):
            with self.subTest(seconds=seconds):
                self.assertEqual(run.fmt_duration(seconds), text)


class Colour(unittest.TestCase):
    class Tty:
        def __init__(self):
            self.text = []

        def isatty(self):
            return True

        def write(self, text):
            self.text.append(text)

        def flush(self):
            pass

    def colour(self, env, choice="auto"):
        with mock.patch.dict(os.environ, env, clear=True):
            out = run.Out(self.Tty(), self.Tty())
        out.use_colour(choice)
        return out.colour

    def test_no_color_counts_only_when_not_empty(self):
        self.assertTrue(self.colour({}))
        self.assertTrue(self.colour({"NO_COLOR": ""}))
        self.assertFalse(self.colour({"NO_COLOR": "1"}))

    def test_the_option_decides_over_both(self):
        self.assertTrue(self.colour({"NO_COLOR": "1"}, "always"))
        self.assertFalse(self.colour({}, "never"))

    def test_never_on_a_pipe_unless_always(self):
        with StubServer(StubConfig(invariant=True)) as stub:
            plain = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4)
            bold = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                           "--color", "always")
        self.assertNotIn("\033[", plain.stdout)
        self.assertIn("\033[1msummary:", bold.stdout)


class Provenance(TempDirTest):
    def test_saved_results_say_how_they_were_made_without_the_key(self):
        with StubServer(StubConfig()) as off, StubServer(StubConfig(invariant=True)) as on:
            sweep = run_lab("--mode", "sweep", "--url", off.url, "--sizes", "1,2", "--max-tokens", 4,
                            "--api-key", "sk-secret-1", "--save", self.path("s.json"))
            cost = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 1,
                           "--trials", 1, "--warmup", 0, "--max-tokens", 2, "--api-key=sk-secret-2",
                           "--save", self.path("c.json"))
        self.assertEqual((sweep.code, cost.code), (0, 0), (sweep, cost))
        for lab in (self.load("s.json")["lab"], self.load("c.json")["cells"][0]["lab"]):
            with self.subTest(command=lab["command"][:3]):
                self.assertEqual(lab["version"], run.LAB_VERSION)
                self.assertEqual(lab["command"][0], "run.py")
                self.assertIn("--save", lab["command"])
                self.assertNotIn("sk-secret", json.dumps(lab))
                self.assertTrue(lab["started"] <= lab["ended"])
                self.assertTrue(lab["host"])
        self.assertIn("[api key]", self.load("s.json")["lab"]["command"])

    def test_version(self):
        p = subprocess.run([sys.executable, os.path.join(ROOT, "run.py"), "--version"], capture_output=True,
                           text=True, timeout=60)
        self.assertEqual((p.returncode, p.stdout.strip()), (0, "run.py (batch-invariance lab) %s" % run.LAB_VERSION))


if __name__ == "__main__":
    unittest.main()
