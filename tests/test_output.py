"""What the lab prints: progress on long runs, the live table, the lines an --expect
leaves, durations, colour (none on a dumb terminal), and output that cannot be written."""

import io
import json
import os
import re
import subprocess
import sys
import unittest
from unittest import mock

from support import (ROOT, RUN_PY, StubConfig, StubServer, TempDirTest, finish, run, run_lab,
                     start_lab)


def progress_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("run.py: progress: ")]


class OutputThatCannotBeWritten(TempDirTest):
    """stdout or stderr full or closed: one line where one can be written, exit 74 (or 141 for
    a closed pipe), and what was measured saved."""

    def test_stdout_on_a_full_disk(self):
        with StubServer() as stub, open("/dev/full", "w") as full:
            p = start_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                          "--repeat", 1, stdout=full)
            _, err = finish(p, 60)
        self.assertEqual(p.returncode, 74, err)
        self.assertEqual(err.strip().splitlines(),
                         ["run.py: cannot write to stdout (No space left on device); the run ended there"])

    def test_stderr_on_a_full_disk_mid_run_saves_what_was_measured(self):
        save = self.path("s.json")
        with StubServer() as stub, open("/dev/full", "w") as full:
            p = subprocess.Popen([sys.executable, RUN_PY, "--mode", "sweep", "--url", stub.url, "--sizes",
                                  "1,2", "--max-tokens", "4", "--repeat", "1", "--save", save],
                                 stdout=subprocess.PIPE, stderr=full, text=True)
            out, _ = finish(p, 60)
        self.assertEqual(p.returncode, 74, out)
        self.assertEqual(self.load("s.json")["summary"]["state"], "stopped: output failed")
        self.assertIn("unique completions", out)

    def test_stdout_closed_mid_run_saves_what_was_measured(self):
        save = self.path("s.json")
        with StubServer(StubConfig(step_delay=0.01)) as stub:
            p = start_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2,3,4,5,6", "--max-tokens",
                          4, "--repeat", 1, "--save", save)
            next(line for line in p.stdout if re.match(r" +1 ", line))  # batch 1's row is out
            p.stdout.close()  # as `| head` does
            with p.stderr:
                err = p.stderr.read()
            p.wait(timeout=60)
        self.assertEqual(p.returncode, 141, err)
        self.assertEqual(self.load("s.json")["summary"]["state"], "stopped: output failed")
        self.assertNotIn("Traceback", err)

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
        self.assertNotIn("left", first)  # one batch is too little to tell the time left by
        self.assertIn("6/6 batches, 14 completions", last)

    def test_the_time_left_is_not_told_by_the_first_step_alone(self):
        # The real 0.34.0 sweep: 48 batches, the first done 3 s in (connections, warm-up), the
        # step over in 29 s; the lab said "~2m 17s left" after its first batch.
        now = [0.0]
        lines = []
        out = run.Out()
        out.say = lambda text, **kw: lines.append(text)
        out.progress_on = False
        progress = run.Progress(out, 48, "batches", clock=lambda: now[0])
        for done in range(1, 49):
            now[0] = 3.0 + (done - 1) * 26.0 / 47  # the first at 3 s, then evenly to 29 s
            progress.finished("batch %d" % done, 1)
            left = progress.left_s(now[0])
            if done < 5:  # fewer than 3 steps, or less than a tenth of the work
                self.assertIsNone(left, done)
            elif done < 48:
                self.assertAlmostEqual(left, 29.0 - now[0], places=6)
        self.assertNotIn("left", lines[0])

    def test_steps_weighed_by_their_work(self):
        # batch sizes 1..8 once each: batch n takes n seconds; with the work given, the pace is
        # per completion, so the estimate after a few sizes is the true time left
        now = [0.0]
        sizes = list(range(1, 9))
        progress = run.Progress(run.Out(), len(sizes), "batches", quiet=True, work=sum(sizes),
                                clock=lambda: now[0])
        for i, n in enumerate(sizes):
            now[0] += n
            progress.finished("batch %d" % n, n)
            left = progress.left_s(now[0])
            if i + 1 >= 3 and i + 1 < len(sizes):
                self.assertAlmostEqual(left, sum(sizes[i + 1:]), places=6)
        unweighed = run.Progress(run.Out(), len(sizes), "batches", quiet=True,
                                 clock=lambda: now[0])
        now[0] = 0.0
        for n in sizes[:4]:
            now[0] += n
            unweighed.finished("batch %d" % n, n)
        self.assertLess(unweighed.left_s(now[0]), sum(sizes[4:]))  # steps alike: too little

    def test_a_sweeps_steps_weigh_their_batch_sizes(self):
        # each step of a real sweep takes, on an emulated clock, as many seconds as the
        # completions it brought back (the first 10 more: the start-up); from the third step
        # on, the time left is the true remainder: a batch of 4 weighs four of batch 1
        made = []

        class Emulated(run.Progress):
            def __init__(self, *args, **kwargs):
                self.now, self.left = 0.0, []
                super().__init__(*args, clock=lambda: self.now, **kwargs)
                made.append(self)

            def finished(self, what, completions):
                self.now += completions + (10.0 if not self.done else 0.0)
                super().finished(what, completions)
                self.left.append(self.left_s(self.now))

        for traffic, per_pass in (("concurrent", [1, 2, 4]), ("mixed", [1, 1, 1])):
            with self.subTest(traffic=traffic), StubServer() as stub, \
                    mock.patch.object(run, "Progress", Emulated):
                r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2,4",
                            "--repeat", 2, "--max-tokens", 4, "--traffic", traffic, "--quiet")
            self.assertEqual(r.code, 0, r)
            progress = made.pop()
            steps = per_pass * 2
            self.assertEqual(progress.work, sum(steps))
            self.assertEqual(progress.completions, progress.work)
            self.assertEqual(progress.left[:2], [None, None])
            for i, left in enumerate(progress.left[2:-1], start=2):
                self.assertAlmostEqual(left, sum(steps[i + 1:]), places=6)

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

class AStopSignalDuringAProgressLine(unittest.TestCase):
    class Tty:
        def __init__(self):
            self.text = ""

        def isatty(self):
            return True

        def write(self, s):
            self.text += s

        def flush(self):
            pass

    def test_its_line_starts_on_a_line_of_its_own(self):
        import signal
        err = self.Tty()
        with mock.patch.dict(os.environ, {"TERM": "xterm"}):
            out = run.Out(self.Tty(), err)
        progress = run.Progress(out, 4, "batches")
        progress.running("batch 2")
        interrupt = run.DeferredInterrupt(out)
        with mock.patch.object(run.STOP, "ask"):
            interrupt._handler(signal.SIGINT, None)
        shown = err.text.split("\r\033[K")[-1]
        self.assertRegex(shown, r"^batch 2 \| [^\n]*\nrun\.py: SIGINT: stopping after the "
                                r"current request")
        out.warn("later")  # no progress line showing: no empty line
        self.assertTrue(err.text.endswith("abort it)\nrun.py: warning: later\n"), err.text)


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
        with StubServer(StubConfig(prefix_caching=False, invariant=True)) as stub:
            r = run_lab("--mode", "sweep", "--traffic", "copies", "--url", stub.url, "--sizes", "1,2,9", "--max-tokens", 8,
                        "--repeat", 2, "--expect", "invariant")
        self.assertEqual(r.code, 0, r)
        self.assertEqual(r.stdout.strip().splitlines()[-1], "expect invariant: held (1 unique of 24, max ULP 0)")
        with StubServer(StubConfig(prefix_caching=False)) as stub:
            r = run_lab("--mode", "sweep", "--traffic", "copies", "--url", stub.url, "--sizes", "1,9", "--max-tokens", 8, "--repeat", 1,
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


class StdoutClosedBeforeTheStart(unittest.TestCase):
    def test_stdout_closed_before_the_start(self):
        for argv in (["--version"], ["--mode", "harness"]):
            with self.subTest(argv=argv):
                p = subprocess.run([sys.executable, RUN_PY] + argv, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                   preexec_fn=lambda: os.close(1))
                self.assertNotIn("Traceback", p.stderr)
                self.assertIn(p.returncode, (0, run.EXIT_OUTPUT))


class ADumbTerminal(unittest.TestCase):
    def test_term_dumb_gets_no_escape_codes(self):
        class Tty(io.StringIO):
            def isatty(self):
                return True

        for term, escapes in (("xterm", True), ("dumb", False)):
            with self.subTest(term=term), mock.patch.dict(os.environ, {"TERM": term}):
                os.environ.pop("NO_COLOR", None)
                out, err = Tty(), Tty()
                printer = run.Out(out, err)
                printer.bold("summary")
                printer.progress("working")
                self.assertEqual("\033" in out.getvalue() + err.getvalue(), escapes)


if __name__ == "__main__":
    unittest.main()
