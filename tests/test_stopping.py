# SPDX-License-Identifier: Apache-2.0
"""Stopping: Ctrl-C, SIGTERM, SIGHUP, a closed pipe and the lab's own faults end a run with
their own exit codes, one line, and everything measured saved."""

import inspect
import io
import os
import re
import signal
import subprocess
import sys
import unittest
from unittest import mock

from support import ROOT, StubConfig, StubServer, TempDirTest, free_port, run, run_lab


class NothingMeasuredLost(TempDirTest):
    """A stop signal at the seams: while a check sends its own requests after batch 1 came
    back, and the moment the last batch is in (the final save, the --json output)."""

    def signalled_at(self, target, name, *args):
        """run.py in this process, sending itself SIGTERM when target.name is first called."""
        real, sent = getattr(target, name), []

        def signal_first(*a, **kw):
            if not sent:
                sent.append(True)
                os.kill(os.getpid(), signal.SIGTERM)
            return real(*a, **kw)

        with mock.patch.object(target, name, signal_first):
            return run_lab(*args)

    def signalled_after(self, target, name, *args):
        """run.py in this process, sending itself SIGTERM as target.name returns."""
        real = getattr(target, name)

        def then_signal(*a, **kw):
            found = real(*a, **kw)
            os.kill(os.getpid(), signal.SIGTERM)
            return found

        with mock.patch.object(target, name, then_signal):
            return run_lab(*args)

    def signalled_at_call(self, target, name, k, *args):
        """run.py in this process, sending itself SIGTERM as target.name is called the k-th
        time (counting from 1), before that call runs."""
        real, calls = getattr(target, name), []

        def signal_kth(*a, **kw):
            calls.append(True)
            if len(calls) == k:
                os.kill(os.getpid(), signal.SIGTERM)
            return real(*a, **kw)

        with mock.patch.object(target, name, signal_kth):
            return run_lab(*args)

    def test_a_signal_while_the_last_batch_is_in_flight_ends_143_with_it_saved(self):
        # copies: each batch is one request (Executor.one); the fourth, the last batch's, gets
        # the signal as it goes out, and its answer comes well within the signal's grace (a
        # liveness bound here): the sweep ends having measured everything, and says how
        for extra in ((), ("--json",)):
            with self.subTest(extra=extra), StubServer(StubConfig(step_delay=0.01)) as stub, \
                    mock.patch.object(run, "STOP_GRACE_S", 60.0):
                r = self.signalled_at_call(
                    run.Executor, "one", 4, "--mode", "sweep", "--url", stub.url,
                    "--traffic", "copies", "--sizes", "1,2", "--repeat", 2,
                    "--max-tokens", 8, "--expect", "invariant", "--save", self.path("s.json"),
                    *extra)
                self.assertEqual(len(stub.generation_bodies()), 4)
            self.assertEqual(r.code, 143, r)
            self.assertIn("stopping after the current request", r.stderr)
            self.assertIn("run.py: SIGTERM: every request answered; ending as the signal asked",
                          r.stderr)
            self.assertNotIn("expect invariant", r.stdout)  # no verdict of --expect is read
            self.assertNotIn("Traceback", r.stderr)
            doc = self.load("s.json")
            self.assertEqual(doc["summary"]["state"], "complete")  # everything was measured
            self.assertEqual(doc["summary"]["total_completions"], 6)
            self.assertEqual([s["batch_size"] for s in doc["prompts"][0]["sizes"]], [1, 2])
            if extra:
                self.assertEqual(r.json()["summary"]["total_completions"], 6)

    def test_a_signal_while_the_last_cost_trial_is_in_flight_ends_143_with_the_cell(self):
        # one request a trial on each arm, no warm-up: the fourth is the last trial's
        with StubServer(StubConfig(step_delay=0.01)) as off, \
                StubServer(StubConfig(invariant=True, step_delay=0.01)) as on, \
                mock.patch.object(run, "STOP_GRACE_S", 60.0):
            r = self.signalled_at_call(
                run.Executor, "one", 4, "--mode", "cost", "--url", off.url, "--invariant",
                on.url, "--batch", 2, "--trials", 2, "--warmup", 0, "--max-tokens", 4,
                "--save", self.path("c.json"))
            sent = len(off.generation_bodies()) + len(on.generation_bodies())
        self.assertEqual(sent, 4)
        self.assertEqual(r.code, 143, r)
        self.assertNotIn("Traceback", r.stderr)
        cells = self.load("c.json")["cells"]
        self.assertEqual([(c["state"], c["trials"]) for c in cells], [("complete", 2)])

    def test_a_signal_during_a_checks_requests_keeps_batch_1(self):
        # the check's request in flight outlasts the signal's grace (set to none here)
        with StubServer(StubConfig(step_delay=0.01)) as stub, \
                mock.patch.object(run, "STOP_GRACE_S", 0.0):
            r = self.signalled_at(run.ObserverCheck, "once", "--mode", "sweep", "--url", stub.url,
                                  "--sizes", "1,2", "--repeat", 1, "--max-tokens", 8,
                                  "--observer-check", "--save", self.path("s.json"))
        self.assertEqual(r.code, 143, r)
        doc = self.load("s.json")
        self.assertEqual(doc["summary"]["state"], "terminated")
        self.assertEqual(doc["summary"]["total_completions"], 1)
        self.assertEqual([s["batch_size"] for s in doc["prompts"][0]["sizes"]], [1])

    def test_a_signal_once_the_last_batch_is_in_waits_for_the_save_and_the_output(self):
        with StubServer(StubConfig()) as stub:
            r = self.signalled_after(run, "measure_until_stopped", "--mode", "sweep", "--url", stub.url,
                                  "--sizes", "1,2", "--repeat", 1, "--max-tokens", 8,
                                  "--save", self.path("s.json"), "--json")
        self.assertEqual(r.code, 143, r)
        self.assertIn("SIGTERM: saving what was measured first", r.stderr)
        doc = self.load("s.json")
        self.assertEqual(doc["summary"]["state"], "complete")  # everything was measured
        self.assertEqual(r.json()["summary"]["total_completions"], 3)


    def test_a_signal_once_the_last_cost_trial_is_in_waits_for_the_cell(self):
        # a job scheduler's time limit the moment the last trial pair is in
        with StubServer(StubConfig()) as off, StubServer(StubConfig(invariant=True)) as on:
            r = self.signalled_after(run, "measure_until_stopped", "--mode", "cost",
                                     "--url", off.url, "--invariant", on.url, "--batch", 2,
                                     "--trials", 2, "--warmup", 0, "--max-tokens", 4,
                                     "--save", self.path("c.json"), "--json")
        self.assertEqual(r.code, 143, r)
        self.assertIn("SIGTERM: saving what was measured first", r.stderr)
        cells = self.load("c.json")["cells"]
        self.assertEqual(len(cells), 1)
        self.assertEqual(cells[0]["state"], "complete")  # every trial pair was measured
        self.assertEqual(r.json()["state"], "complete")

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

    def test_every_signal_before_the_first_request_ends_with_its_line_and_code(self):
        # waiting for a server that is not there (--wait-ready), and reading the facts of one
        # that never answers: nothing measured, the signal's own code and one line
        import socket
        import time
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections complete in the kernel; no answer ever comes
        port = silent.getsockname()[1]
        cases = [
            (signal.SIGTERM, 143, "terminated", ["--wait-ready", "60", "--url",
                                                 "http://127.0.0.1:%d" % free_port()]),
            (signal.SIGHUP, 129, "hung up", ["--url", "http://127.0.0.1:%d" % port]),
            (signal.SIGINT, 130, "interrupted", ["--url", "http://127.0.0.1:%d" % port]),
        ]
        try:
            for signum, code, line, where in cases:
                with self.subTest(signal=signum.name):
                    started = time.monotonic()
                    got, out, err = self.run_and_signal(
                        ["--mode", "sweep", "--sizes", "1,2"] + where,
                        lambda: time.monotonic() > started + 1.5, signum)
                    self.assertEqual(got, code, err)
                    self.assertIn("run.py: %s" % line, err)
                    self.assertNotIn("Traceback", err)
        finally:
            silent.close()

    def test_ctrl_c_during_warm_up_stops_after_the_current_warm_up_request(self):
        with StubServer(StubConfig(step_delay=0.05)) as off, StubServer(StubConfig(invariant=True, step_delay=0.05)) as on:
            code, out, err = self.stop_with(signal.SIGINT, [
                "--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", "1", "--trials", "3",
                "--warmup", "50", "--max-tokens", "4"], lambda: len(off.generation_bodies()) >= 1)
            sent = len(off.generation_bodies()) + len(on.generation_bodies())
        self.assertEqual(code, 130, err)
        self.assertIn("no complete trial pair", err)
        self.assertLess(sent, 10)


class Interruption(TempDirTest):
    def run_and_interrupt(self, args, progressed):
        """Start run.py, wait until its --save file shows measured progress, then press Ctrl-C."""
        return self.run_and_signal(args, progressed, signal.SIGINT)

    def test_ctrl_c_stops_after_the_current_request_saves_and_summarises(self):
        with StubServer(StubConfig(step_delay=0.02)) as stub:  # 8 tokens: 0.16 s a request
            code, out, err = self.run_and_interrupt(
                ["--mode", "sweep", "--url", stub.url, "--sizes", ",".join(str(n) for n in range(1, 40)),
                 "--max-tokens", "8", "--save", self.path("s.json")],
                lambda: len((self.saved("s.json") or {"prompts": [{"sizes": []}]})["prompts"][0]["sizes"]) >= 2)
        self.assertEqual(code, 130, err)
        self.assertIn("stopping after the current request", err)
        self.assertNotIn("Traceback", err)
        self.assertIn("summary:", out)
        self.assertIn("(interrupted)", out)
        doc = self.load("s.json")
        self.assertEqual(doc["summary"]["state"], "interrupted")
        done = [s["batch_size"] for s in doc["prompts"][0]["sizes"]]
        self.assertTrue(1 <= len(done) < 39, done)
        self.assertEqual(done, list(range(1, len(done) + 1)))

    def test_ctrl_c_in_cost_keeps_the_pairs(self):
        with StubServer(StubConfig(step_delay=0.02)) as off, \
                StubServer(StubConfig(invariant=True, step_delay=0.02)) as on:
            code, out, err = self.run_and_interrupt(
                ["--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", "2",
                 "--trials", "50", "--warmup", "0", "--max-tokens", "8", "--save", self.path("c.json")],
                lambda: (self.saved("c.json") or {"cells": [{"trials": 0}]})["cells"][0]["trials"] >= 2)
        self.assertEqual(code, 130, err)
        cell = self.load("c.json")["cells"][0]
        self.assertEqual(cell["state"], "interrupted")
        self.assertGreaterEqual(cell["trials"], 1)
        self.assertLess(cell["trials"], 50)

    def test_broken_pipe_exits_quietly(self):
        p = subprocess.Popen([sys.executable, os.path.join(ROOT, "run.py"), "--mode", "harness"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        p.stdout.close()  # the reader is gone before the first byte, as with `| head -0`
        err = p.stderr.read().decode()
        p.wait(timeout=60)
        p.stderr.close()
        self.assertEqual(p.returncode, 141)
        self.assertEqual(err, "")


class FaultsOfTheLabsOwn(TempDirTest):
    """Whatever still escapes ends the run with one line, exit 70 (never 1, the code of a
    failed --expect), and what was measured saved."""

    def test_an_exception_in_a_load_worker_thread_ends_the_run_as_in_the_main_thread(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on, \
                mock.patch.object(run.VllmAdapter, "streamed_tokens", side_effect=RuntimeError("boom")):
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--concurrency", 2,
                        "--requests", 2, "--trials", 1, "--warmup", 0, "--max-tokens", 4)
        self.assertEqual(r.code, 70, r)
        self.assertIn("internal error (RuntimeError at run.py line", r.stderr)
        self.assertIn("boom); please report it", r.stderr)
        self.assertNotIn("Traceback", r.stderr)

    def test_an_internal_error_mid_sweep_saves_what_was_measured(self):
        real = run.compare_batch
        calls = []

        def fails_second_time(*args):
            calls.append(1)
            if len(calls) == 2:
                raise ZeroDivisionError("a bug")
            return real(*args)

        with StubServer() as stub, mock.patch.object(run, "compare_batch", fails_second_time):
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2,3", "--max-tokens", 4,
                        "--repeat", 1, "--save", self.path("s.json"))
        self.assertEqual(r.code, 70, r)
        doc = self.load("s.json")
        self.assertEqual(doc["summary"]["state"], "stopped: internal error")
        self.assertEqual([s["batch_size"] for s in doc["prompts"][0]["sizes"]], [1])
        self.assertIn("sweep stopped: internal error (ZeroDivisionError", r.stderr)


    def test_the_line_named_is_the_labs_own_when_a_library_raised(self):
        """The error rose inside the standard library (statistics.median of nothing): the line
        to report is where run.py called it, not the library's line under run.py's name."""
        try:
            run.statistics.median([])  # no frame of run.py at all: no line to name
        except run.statistics.StatisticsError as err:
            message = run.internal_error(err)
        self.assertEqual(message, "internal error (StatisticsError: no median for empty data); "
                                  "please report it")
        timing = run.RequestTiming(None, 1.0, 4, None, 1)
        with mock.patch.object(run, "percentile", lambda values, share: run.statistics.median([])):
            try:
                run.LoadStats.of([[timing]], [1.0], [4])
            except run.statistics.StatisticsError as err:
                message = run.internal_error(err)
        source, first = inspect.getsourcelines(run.Spread.of)
        named = int(re.search(r"run\.py line (\d+)", message).group(1))
        self.assertIn("percentile(", source[named - first])

    def test_trials_shorter_than_the_clock_resolution_leave_no_rate_and_no_crash(self):
        timing = run.RequestTiming(0.0, 0.0, 4, 0.0, 4)
        stats = run.LoadStats.of([[timing], [timing]], [0.0, 0.0], [4, 4])
        record = run.as_record(stats)
        self.assertIsNone(record["median_tokens_per_s"])
        self.assertIsNone(record["median_requests_per_s"])
        out = io.StringIO()
        unmeasured = {name: run.Overhead(None, None, False) for name in run.LOAD_FIGURES}
        cell = run.LoadCell(1, 1, "throughput", "burst", {"off": stats, "on": stats}, unmeasured)
        cell.report("time per trial", run.Out(out, out))
        self.assertIn("flag off ? tokens/s, ? requests/s", out.getvalue())


if __name__ == "__main__":
    unittest.main()
