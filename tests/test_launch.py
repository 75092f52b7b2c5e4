"""Launching both arms and waiting for them: --wait-ready, and examples/experiment.sh run end
to end through the real launch scripts, with stand-ins for `vllm serve` and
`sglang.launch_server` (tests/standin/) that start up, fail and exit as the real engines did
on a GPU."""

import json
import os
import re
import resource
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import unittest

from support import ROOT, TempDirTest, free_port, run, run_lab, wait_for

STUB = [sys.executable, os.path.join(ROOT, "tests", "stub_server.py")]
STANDIN = os.path.join(ROOT, "tests", "standin")


def listening(port):
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# the line that says a sweep step ended: "experiment: step 3 of 8: flag-on sweep, ... : exit 0"
SWEEP_END = re.compile(r"^experiment: step \d+ of \d+: flag-(off|on) sweep, [^:]*: exit -?\d+")


def errors(stderr):
    return [line for line in stderr.splitlines() if not line.startswith("run.py: progress: ")]


class WaitReady(unittest.TestCase):
    def test_a_server_that_starts_late_is_waited_for(self):
        # The server starts listening 2 s after the lab starts asking: only waiting gets an answer.
        port = free_port()
        late = subprocess.Popen(["bash", "-c", 'sleep 2 && exec "$@"', "late"] + STUB + ["--port", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            r = run_lab("--mode", "sweep", "--url", "http://127.0.0.1:%d" % port, "--wait-ready", 30,
                        "--sizes", "1,2", "--max-tokens", 4, "--repeat", 1)
            self.assertEqual(r.code, 0, r)
            self.assertIn("waiting up to 30s for the server", r.stderr)
        finally:
            late.terminate()
            late.wait(timeout=10)

    def test_nothing_there_is_one_line_and_exit_3(self):
        r = run_lab("--mode", "sweep", "--url", "http://127.0.0.1:%d" % free_port(), "--wait-ready", 2,
                    "--sizes", "1")
        self.assertEqual(r.code, 3, r)
        self.assertEqual(len(errors(r.stderr)), 1, r.stderr)
        self.assertIn("was not ready within 2s (--wait-ready)", r.stderr)

    def test_quiet_waits_silently(self):
        r = run_lab("--mode", "cost", "--url", "http://127.0.0.1:%d" % free_port(), "--invariant",
                    "http://127.0.0.1:%d" % free_port(), "--wait-ready", 0.6, "--quiet")
        self.assertEqual(r.code, 3, r)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
        self.assertIn("the flag-off arm (--url)", r.stderr)


class Experiment(TempDirTest):
    """examples/experiment.sh with the stand-in engines behind the real launch scripts. Every
    wait is a liveness bound far above what the run needs (a run takes seconds)."""

    engine = "vllm"

    def start(self, out="out", file_size=None, **variables):
        """Run the experiment in a session of its own; the stand-ins load for a moment. In a
        variable, {off} and {on} stand for the arms' ports. file_size: the largest file the
        experiment and everything it starts may write (a full disk: every write past it
        fails)."""
        self.ports = free_port(), free_port()
        env = dict(
            os.environ,
            PATH=os.path.join(STANDIN, "bin") + os.pathsep + os.environ["PATH"],
            PYTHONPATH=os.path.join(STANDIN, "py"),
            STANDIN_DEVICE_DIR=self.tmp,
            STANDIN_LOAD_S="0.2",
            MODEL="stub/tiny-f32",
            GPUS="0",
            TP="1",
            WAIT="300",
            SERVE_OFF="env PORT=%d bash %s off" % (self.ports[0], self.script()),
            SERVE_ON="env PORT=%d bash %s on" % (self.ports[1], self.script()),
            OFF_URL="http://127.0.0.1:%d" % self.ports[0],
            ON_URL="http://127.0.0.1:%d" % self.ports[1],
            SWEEP_ARGS="--sizes 1,2,9,17 --max-tokens 12 --repeat 2",
            # six trial pairs: the fewest with which run.py's cost mode gives an interval
            COST_ARGS="--batch 2 --trials 6 --warmup 0 --max-tokens 4",
            COPIES="off",  # the copies sweeps run where a test looks at them (COPIES="on")
        )
        for name in ("VLLM_BATCH_INVARIANT", "CUDA_VISIBLE_DEVICES", "MEM", "STANDIN_EXIT_AFTER"):
            env.pop(name, None)
        env.update(
            {
                name: value.format(off=self.ports[0], on=self.ports[1])
                for name, value in variables.items() if value is not None
            }
        )
        for name in [name for name, value in variables.items() if value is None]:
            env.pop(name, None)  # None: the variable not set at all (its default)
        return subprocess.Popen(
            ["bash", os.path.join(ROOT, "examples", "experiment.sh"), self.engine, self.path(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=None if file_size is None else lambda: resource.setrlimit(
                resource.RLIMIT_FSIZE, (file_size, file_size)),
        )

    def script(self):
        return os.path.join(ROOT, "examples", "%s_serve.sh" % self.engine)

    def finish(self, p):
        out, err = p.communicate(timeout=240)
        return p.returncode, out, err

    def runs(self, out="out"):
        return sorted(os.listdir(self.path(out))) if os.path.isdir(self.path(out)) else []

    def run_path(self, *names, out="out", run=-1):
        return os.path.join(self.path(out), self.runs(out)[run], *names)

    def load_run(self, *names, run=-1):
        with open(self.run_path(*names, run=run), encoding="utf-8") as f:
            return json.load(f) if names[-1].endswith(".json") else f.read()

    def times(self, arm, tp=1, run=-1):
        """(loading started, ready) of one arm, as its stand-in logged them."""
        log = self.load_run("tp%d" % tp, "server_%s.log" % arm, run=run)
        stamps = [float(m) for m in re.findall(r"\(at ([0-9.]+)\)", log)]
        self.assertEqual(len(stamps), 2, log)
        return stamps

    def assert_no_server_left(self):
        self.assertTrue(
            wait_for(lambda: not any(listening(p) for p in self.ports), 20), "a server is still up"
        )


class ExperimentRuns(Experiment):
    def test_one_device_the_second_arm_starts_once_the_first_is_ready(self):
        # with keys given both ways: a short one (a digit of every date and figure) and a long
        # one in an abbreviated option; neither rewrites the report, neither is in it
        long_key = "zq7-secretvalue-991"
        code, out, err = self.finish(self.start(
            COPIES="on", OPENAI_API_KEY="2",
            SWEEP_ARGS="--sizes 1,2,9,17 --max-tokens 12 --repeat 2 --api " + long_key))
        # the stand-ins' cache blocks (16 tokens, said in /metrics) are shorter than the
        # prompt (20): its copies would share the cache, so the copies sweeps are left out,
        # and the concurrent sweeps, which compared, decide: complete
        self.assertEqual(code, 0, err)
        self.assertNotIn(long_key, out + err)
        self.assertIn("--api '[api key]'", out)
        self.assertNotIn("[api key]", out.replace("--api '[api key]'", ""))
        self.assertIn("Started 2", out)  # a date, whole
        off_loading, off_ready = self.times("off")
        on_loading, on_ready = self.times("on")
        self.assertGreaterEqual(on_loading, off_ready)
        self.assertIn("the arms share device(s) 0", err)
        report = self.load_run("REPORT.md")
        self.assertEqual(out, report)  # printed as well as written
        self.assertEqual(report.splitlines()[0], "# Batch-invariance experiment, vllm: "
                         "complete, every step ran and every --expect held")
        for key in ("off", "on"):
            self.assertIn("- flag-%s sweep, copies in one request (TP 1) left out: the prompt "
                          "(20 tokens as the arm counts it) is not shorter than one of the "
                          "arm's 16-token cache blocks" % key, report)
            self.assertFalse(os.path.exists(self.run_path("tp1", "copies_%s.json" % key)))
        for words in (
            "| flag off | vllm |",
            "| flag on | vllm |",
            "| flag off, concurrent requests | tokens diverged |",
            "| flag on, concurrent requests | invariant | 1 of 58 |",
            "decode and prefill agree",
            "| TP=1 | ",
            "| TP=k | missing (your real TP degree) | missing |",
            "## Environment",
            "| lab | run.py %s |" % run.lab_code(),
            "| engine (as the arms report it) | vllm ",
            "## How the arms were started",
            # every variable the launch script sets: a copy of the line starts the same
            # server, /server_info on (VLLM_SERVER_DEV_MODE=1), so the lab reads the flag
            "VLLM_BATCH_INVARIANT=1 VLLM_SERVER_DEV_MODE=1 vllm serve stub/tiny-f32 --port %d"
            % self.ports[1],
            "## Parameters",
            "run.py --mode cost",
        ):
            self.assertIn(words, report)
        self.assertIn("tokens diverged**, 2 unique of 58", report)
        concurrent = self.load_run("tp1", "sweep_off.json")["summary"]["prefix_cache_bypass"]
        self.assertEqual(concurrent["status"], "held")
        self.assertEqual(self.load_run("tp1", "sweep_on.json")["summary"]["verdict"], "invariant")
        self.assert_no_server_left()

    def test_copies_sweeps_run_only_where_their_copies_compare_cold_prefills(self):
        """vLLM's copies of one request share its prefix cache whatever the key, in whole
        blocks. Where the arms say a block longer than the prompt (64 tokens, as 0.34.0's),
        the copies sweeps run and compare cold prefills; where they say no block size (as the
        practice engine of an earlier release), they run, and a flag-on copies sweep that the
        cache served compared nothing: named in the report, but the concurrent sweeps, which
        compared, decide, and the run is complete."""
        stub = "python3 %s --port {port} --prompt-tokens-details" % (
            os.path.join(ROOT, "tests", "stub_server.py"))
        for block, finding in (
                (" --block-size 64", "- flag-on sweep, copies in one request (TP 1): its copies "
                 "compare cold prefills: the prompt (20 tokens as the arm counts it) is shorter "
                 "than one of the arm's 64-token cache blocks"),
                ("", "- Not counted in the verdict: flag-on sweep, copies in one request (TP 1): "
                 "nothing compared: the cache served every request above batch 1 (the cache "
                 "served the copies; the concurrent sweeps, which compared, decide).")):
            with self.subTest(block=block):
                code, out, err = self.finish(self.start(
                    COPIES="on", SERVE_OFF=stub.format(port="{off}") + block,
                    SERVE_ON=stub.format(port="{on}") + block + " --invariant --prefill-agrees"))
                self.assertEqual(code, 0, err)
                report = self.load_run("REPORT.md")
                self.assertEqual(report.splitlines()[0], "# Batch-invariance experiment, vllm: "
                                 "complete, every step ran and every --expect held")
                self.assertIn(finding, report)
                on_copies = self.load_run("tp1", "copies_on.json")["summary"]
                self.assertEqual(on_copies["verdict"], "invariant" if block
                                 else run.NOTHING_COMPARED + ": the cache served every request "
                                 "above batch 1")

    def test_the_readmes_one_gpu_command_dry_run_ends_complete(self):
        """The README's one GPU command, as it stands there, against the stand-in engines
        (their copies share the cache: 16-token blocks, said in /metrics, and a 20-token
        prompt): the copies sweeps are left out, each with its line in REPORT.md, and the run
        ends complete, exit 0. Only its steps are made smaller (SWEEP_ARGS, COST_ARGS), and
        its ports free ones."""
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            line = next(l for l in f if l.startswith("GPUS=0 TP=1 ") and "vllm" in l)
        words = shlex.split(line)
        variables = dict(w.split("=", 1) for w in words[:words.index("examples/experiment.sh")])
        self.assertEqual(words[-2:], ["vllm", "results/"])
        code, out, err = self.finish(self.start(
            OFF_URL="", ON_URL="", SERVE_OFF="", SERVE_ON="", COPIES=None, OFF_PORT="{off}",
            ON_PORT="{on}", **variables))
        self.assertEqual(code, 0, err)
        report = self.load_run("REPORT.md")
        self.assertEqual(report.splitlines()[0], "# Batch-invariance experiment, vllm: "
                         "complete, every step ran and every --expect held")
        for key in ("off", "on"):
            self.assertIn("- flag-%s sweep, copies in one request (TP 1) left out: " % key,
                          report)
        self.assertIn("vllm serve %s --port" % variables["MODEL"], report)
        self.assert_no_server_left()

    def test_a_flag_on_arm_that_moved_in_any_shape_is_not_complete(self):
        """The flag-on copies sweep carries no --expect and exits 0; its saved verdict says
        the arm moved (a cache hit computed another way), so the run is not "complete", and
        every check each sweep ran is in the findings and the sweep table."""
        stub = "python3 %s --port {port} --prompt-tokens-details --cache-path-differs" % (
            os.path.join(ROOT, "tests", "stub_server.py"))
        code, out, err = self.finish(self.start(
            COPIES="on", SERVE_OFF=stub.format(port="{off}"),
            SERVE_ON=stub.format(port="{on}") + " --invariant"))
        self.assertEqual(code, 1, err)
        report = self.load_run("REPORT.md")
        first = report.splitlines()[0]
        self.assertIn("NOT AS EXPECTED (exit 1, an --expect did not hold)", first)
        self.assertIn("the flag-on arm moved, copies in one request (TP 1)", first)
        self.assertNotIn("complete", first)
        on_copies = self.load_run("tp1", "copies_on.json")["summary"]
        self.assertGreater(on_copies["max_ulp"], 0)
        finding = next(line for line in report.splitlines()
                       if line.startswith("- TP 1, flag on, copies in one request:"))
        self.assertNotIn("first moved: nowhere", finding)
        # the prefill check of each concurrent sweep, in its finding and its table row
        for key in ("off", "on"):
            verdict = self.load_run("tp1", "sweep_%s.json" % key)["summary"]["prefill_verdict"]
            finding = next(line for line in report.splitlines()
                           if line.startswith("- TP 1, flag %s, concurrent requests:" % key))
            self.assertIn("; prefill: %s" % verdict, finding)
            row = next(line for line in report.splitlines()
                       if line.startswith("| flag %s, concurrent requests |" % key))
            self.assertIn("prefill: %s" % verdict, row)
        self.assertIn("expect invariant: held", report)  # run.py's own --expect line

    def test_a_flag_on_check_that_moved_is_not_as_expected(self):
        """The flag-on sweep's batches agree (its --expect invariant holds, exit 0), but a
        check it ran moved: the observer check (the practice engine computes a request that
        asks for no logprobs another way) or the prefill check (its decode differs from its
        prefill). The saved check verdict makes the run not as expected, exit 1."""
        stub = "python3 %s --port {port} --prompt-tokens-details" % (
            os.path.join(ROOT, "tests", "stub_server.py"))
        for check, fault, verdict, sweep_args in (
                ("observer", "--prefill-agrees --logprobs-path-differs",
                 "the text changed when logprobs top-0, top-5, top-20 were asked for",
                 " --observer-check"),
                ("prefill", "", "decode and prefill differ", "")):
            with self.subTest(check=check):
                code, out, err = self.finish(self.start(
                    SERVE_OFF=stub.format(port="{off}"),
                    SERVE_ON=stub.format(port="{on}") + " --invariant " + fault,
                    SWEEP_ARGS="--sizes 1,2,9,17 --max-tokens 12 --repeat 2" + sweep_args))
                self.assertEqual(code, 1, err)
                on = self.load_run("tp1", "sweep_on.json")["summary"]
                self.assertEqual(on["verdict"], "invariant")  # the sweep itself held ...
                self.assertIn("expect invariant: held", self.load_run("tp1", "sweep_on.txt"))
                self.assertEqual(on["%s_verdict" % check], verdict)  # ... its check did not
                first = self.load_run("REPORT.md").splitlines()[0]
                self.assertIn("NOT AS EXPECTED (exit 1, an --expect did not hold)", first)
                self.assertIn("the flag-on arm's %s check moved, concurrent requests (TP 1): %s"
                              % (check, verdict), first)
                self.assertNotIn("complete", first)
                self.assertTrue(out.startswith(first + "\n"), out)  # printed as written

    def test_the_flag_off_arm_is_swept_while_the_flag_on_arm_loads(self):
        """One device: the flag-on arm loads only once the flag-off arm is ready, and the
        flag-off arm's sweeps run meanwhile; each step says when it starts and what it
        measures, and the report says when each arm was ready and each step ran."""
        code, out, err = self.finish(self.start(STANDIN_LOAD_S="1"))
        self.assertEqual(code, 0, err)
        said = err.splitlines()
        first, on_ready = self.first_step_and_on_ready(said)
        self.assertLess(first, on_ready, err)
        self.assertRegex(said[first], r"^experiment: step 1 of \d+: flag-off sweep, concurrent "
                         r"requests \(TP 1\): unique completions and ULPs across batch sizes, "
                         r"flag off, concurrent requests \(expect variant\)$")
        self.assertRegex(err, r"step 1 of \d+: flag-off sweep, concurrent requests \(TP 1\): "
                              r"exit 0, ran, and any --expect held, \d+ s")
        self.assertRegex(err, r"step \d+ of \d+: cost, cold \(TP 1\): the flag's overhead, "
                              r"cold workload, both arms alone")
        cost = next(i for i, line in enumerate(said) if ": cost, cold (TP 1): the" in line)
        sweep_ends = [i for i, line in enumerate(said) if SWEEP_END.match(line)]
        self.assertTrue(sweep_ends, err)
        self.assertTrue(all(i < cost for i in sweep_ends), err)  # the cost runs once every
        # sweep has ended (a picture drawn of a sweep afterwards is no sweep)
        report = self.load_run("REPORT.md")
        self.assertIn("## Where the time went", report)
        self.assertRegex(report, r"The whole run took \d+ s; the arms' start-up \d+ s of it")
        self.assertRegex(report, r"\| 1 \| off \| \+\d+:\d\d \| \+\d+:\d\d \| \d+ s \|")
        self.assertRegex(report, r"\| 1 \| on \| \+\d+:\d\d \| \+\d+:\d\d \| \d+ s \|")
        self.assertIn("| # | TP | step | started | took | exit | meaning | output |", report)
        self.assertRegex(report, r"\| 1 \| 1 \| flag-off sweep, concurrent requests \| "
                                 r"\+\d+:\d\d \| \d+ s \| 0 \|")

    def test_a_closed_output_pipe_silences_the_lines_not_the_run(self):
        """`experiment.sh ... 2>&1 | head`: once the reader has gone, the run goes on and
        writes its report, with no traceback."""
        p = self.start()
        p.stdout.close()
        p.stderr.close()
        self.assertEqual(p.wait(timeout=240), 0)
        self.assertTrue(self.load_run("REPORT.md").startswith(
            "# Batch-invariance experiment, vllm: complete"))
        self.assert_no_server_left()

    def test_overlap_off_sweeps_no_arm_before_both_are_ready(self):
        code, out, err = self.finish(self.start(OVERLAP="off"))
        self.assertEqual(code, 0, err)
        first, on_ready = self.first_step_and_on_ready(err.splitlines())
        self.assertGreater(first, on_ready, err)

    @staticmethod
    def first_step_and_on_ready(said):
        """Where, among the lines the experiment said, its first step started and the
        flag-on arm was ready."""
        first = next(i for i, line in enumerate(said) if "step 1 of" in line)
        on_ready = next(i for i, line in enumerate(said) if "the flag-on arm is ready" in line)
        return first, on_ready

    def test_separate_devices_start_together(self):
        code, out, err = self.finish(self.start(GPUS="0,1", STANDIN_LOAD_S="1"))
        self.assertEqual(code, 0, err)
        off_loading, off_ready = self.times("off")
        on_loading, on_ready = self.times("on")
        self.assertLess(on_loading, off_ready)
        self.assertNotIn("share device", err)

    def test_tp_1_and_2_fill_the_four_cells_of_one_cost_file(self):
        code, out, err = self.finish(self.start(GPUS="0,1", TP="1,2"))
        self.assertEqual(code, 0, err)
        cells = self.load_run("cost.json")["cells"]
        self.assertEqual(
            sorted((c["tp"], c["workload"]) for c in cells),
            [(1, "cold"), (1, "shared-prefix"), (2, "cold"), (2, "shared-prefix")],
        )
        self.assertEqual(self.load_run("tp2", "sweep_on.json")["server"]["tp"], 2)
        report = self.load_run("REPORT.md")
        self.assertIn("## TP 1", report)
        self.assertIn("## TP 2", report)
        self.assertIn("| TP=2 | ", report)
        self.assertNotIn("missing", report.split("## Environment")[0])
        # batch 1 of the flag-on arm at TP 2 against TP 1's: the practice engine does not shard
        versus = self.load_run("tp2", "tp2_vs_tp1.json")
        self.assertEqual(versus["summary"]["verdict"], "invariant")
        self.assertIn("TP invariance of batch 1 (flag on, `tp2_vs_tp1.json`): invariant, max ULP 0.", report)
        self.assertRegex(report, r"\| \d+ \| 2 \| TP 2 against TP 1, batch 1, flag on \| "
                                 r"\+\d+:\d\d \| \d+ s \| 0 \|")

    def test_a_degree_the_devices_cannot_hold_is_skipped_with_a_line(self):
        code, out, err = self.finish(self.start(GPUS="0", TP="1,2"))
        self.assertEqual(code, 5, err)  # every step ran, but the report is not whole
        self.assertIn("TP 2 skipped: GPUS=0 holds fewer than 2 device(s)", err)
        first = self.load_run("REPORT.md").splitlines()[0]
        self.assertIn("INCOMPLETE (exit 5, a TP degree was skipped)", first)
        self.assertIn("TP 2 skipped", first)
        self.assertEqual({c["tp"] for c in self.load_run("cost.json")["cells"]}, {1})
        self.assertFalse(os.path.exists(self.run_path("tp2")))

    def test_two_runs_into_one_folder_both_succeed(self):
        for _ in range(2):
            code, out, err = self.finish(
                self.start(SWEEP_ARGS="--sizes 1,2 --max-tokens 8 --repeat 2")
            )
            self.assertEqual(code, 0, err)
        self.assertEqual(len(self.runs()), 2)
        for number in (0, 1):
            self.assertEqual(
                self.load_run("tp1", "sweep_on.json", run=number)["summary"]["state"], "complete"
            )

    def test_the_first_failing_steps_code_is_the_experiments(self):
        # A flag-off arm that is really flag on: its sweep finds nothing, so --expect variant
        # fails.
        code, out, err = self.finish(
            self.start(
                SERVE_OFF="env PORT={off} bash %s on" % self.script(),
                COST_ARGS="--batch 1 --trials 6 --warmup 0 --max-tokens 2 --allow-mismatch",
            )
        )
        self.assertEqual(code, 1, err)
        self.assertIn("flag-off sweep, concurrent requests (TP 1): exit 1", err)
        self.assertIn("expectation failed: --expect variant, but nothing moved", err)
        self.assertIn("flag-on sweep, concurrent requests (TP 1): exit 0", err)
        first = self.load_run("REPORT.md").splitlines()[0]
        # the cost cells refuse two flag-on arms: not every step ran, so the run is incomplete
        self.assertIn("INCOMPLETE (exit 1, an --expect did not hold", first)
        self.assertIn("flag-off sweep, concurrent requests (TP 1): an --expect did not hold "
                      "(expectation failed: --expect variant, but nothing moved)", first)

    def test_a_flag_on_result_that_compared_nothing_is_inconclusive(self):
        """Every step ran and nothing moved, but a flag-on result compared nothing: the
        prefill check the server could not serve (HTTP 500), or a sweep whose --expect
        invariant failed only because it compared nothing (the cache served every request,
        seen only by counters that lag past the first wait). Neither is held, and neither is
        a move: INCONCLUSIVE, exit 6, naming the step and the check."""
        stub = "python3 %s --port {port} --prompt-tokens-details" % (
            os.path.join(ROOT, "tests", "stub_server.py"))
        for fault, code, words in (
                ("--prefill-agrees --fault 2=http500", 6,
                 "INCONCLUSIVE (exit 6, every step ran, but a flag-on result compared nothing): "
                 "compared nothing: flag-on sweep, concurrent requests (TP 1), prefill check: "
                 "not measured: the server could not serve it (HTTP 500"),
                ("--prefill-agrees --uncounted-cache-hits --cache-serves all --counters-lag 3",
                 6, "INCONCLUSIVE (exit 6, every step ran, but a flag-on result compared "
                 "nothing): compared nothing: flag-on sweep, concurrent requests (TP 1): an "
                 "--expect did not hold (expectation failed: --expect invariant, but the "
                 "result is: nothing compared")):
            with self.subTest(fault=fault):
                code_found, out, err = self.finish(self.start(
                    SERVE_OFF=stub.format(port="{off}"),
                    SERVE_ON=stub.format(port="{on}") + " --invariant " + fault))
                self.assertEqual(code_found, code, err)
                first = self.load_run("REPORT.md").splitlines()[0]
                self.assertIn(words, first)
                self.assertNotIn("complete", first)
                self.assertTrue(out.startswith(first + "\n"), out)

    def test_tp_against_tp_with_servers_that_report_another_tp_compared_nothing_across_tp(
            self):
        """TP=1,2 with arms that report TP 1 at both degrees: batch 1 at "TP 2" against TP 1
        is TP 1 against TP 1, so the report says it compared nothing across TP (as run.py
        saved each server's TP), never "invariant"."""
        stub = "python3 %s --port {port}" % os.path.join(ROOT, "tests", "stub_server.py")
        code, out, err = self.finish(self.start(
            GPUS="0,1,2,3", TP="1,2", SERVE_OFF=stub.format(port="{off}"),
            SERVE_ON=stub.format(port="{on}") + " --invariant --prefill-agrees"))
        self.assertNotEqual(code, 0, err)
        self.assertEqual(self.load_run("tp2", "tp2_vs_tp1.json")["server"]["tp"], 1)
        report = self.load_run("REPORT.md")
        self.assertIn("TP invariance of batch 1 (flag on, `tp2_vs_tp1.json`): compared nothing "
                      "across TP (TP 2 asked, the server reports TP 1); batch 1 against batch "
                      "1: invariant, max ULP 0.", report)
        self.assertIn("compared nothing: TP against TP, batch 1, flag on (`tp2_vs_tp1.json`), "
                      "across TP: TP 2 asked, the server reports TP 1", report.splitlines()[0])


class ExperimentFailures(Experiment):
    def test_an_arm_that_exits_at_start_up_ends_the_experiment_at_once(self):
        # Another process is loading on device 1, where the flag-on arm loads: vLLM's
        # memory profiling fails there, as it did on the real GPU.
        with open(os.path.join(self.tmp, "standin-gpu1.loading"), "w") as f:
            f.write(str(os.getpid()))
        code, out, err = self.finish(self.start(GPUS="0,1"))
        self.assertEqual(code, 4, err)
        line = [l for l in err.splitlines() if "exited with status" in l]
        self.assertEqual(len(line), 1, err)
        self.assertIn("the flag-on arm", line[0])
        self.assertIn("exited with status 1", line[0])
        self.assertIn("No available memory for the cache blocks", line[0])
        report = self.load_run("REPORT.md")
        self.assertIn("INCOMPLETE (exit 4", report.splitlines()[0])
        self.assertIn("No available memory for the cache blocks", report.splitlines()[0])
        # the flag-off arm, on its own device, may be swept before the flag-on arm fails: a
        # step that started was stopped by the arm's exit, and none ran to its end
        steps = [row for row in report.splitlines() if re.match(r"\| \d+ \| \d+ \| ", row)]
        self.assertTrue(all("stopped: an arm exited" in row for row in steps), report)
        self.assert_no_server_left()

    def test_an_arm_that_exits_mid_run_stops_the_step_at_once(self):
        code, out, err = self.finish(self.start(STANDIN_EXIT_AFTER="on:2"))
        self.assertEqual(code, 4, err)
        self.assertIn(
            "the flag-on arm (http://127.0.0.1:%d) exited with status 1" % self.ports[1], err
        )
        self.assertIn("illegal memory access", err)
        report = self.load_run("REPORT.md")
        self.assertRegex(report, r"\| \d+ \| 1 \| flag-on sweep, concurrent requests \| .*\| "
                                 r"stopped: an arm exited \|")
        self.assertNotIn("cost, cold", report)  # nothing ran after it
        # the steps the arm's exit stopped are said once, after the arm, in the first line:
        # no step's own "stopped:" left hanging there
        first = report.splitlines()[0]
        self.assertRegex(first, r"illegal memory access was encountered; the steps? it stopped: "
                                r"(flag-off sweep, concurrent requests \(TP 1\), )?flag-on sweep, "
                                r"concurrent requests \(TP 1\)$")
        self.assertNotIn("stopped: an arm exited", first)
        self.assert_no_server_left()

    def test_a_launch_command_that_does_not_exist_is_one_line_and_exit_4(self):
        code, out, err = self.finish(self.start(SERVE_OFF="no-such-engine-command --port {off}"))
        self.assertEqual(code, 4, err)
        self.assertNotIn("Traceback", err)
        self.assertIn("the flag-off arm could not be started (no-such-engine-command", err)
        report = self.load_run("REPORT.md")
        self.assertIn("INCOMPLETE (exit 4", report.splitlines()[0])
        # no engine anywhere: said so, not called a dry run; no empty table, no empty heading
        self.assertNotIn("dry run", report)
        self.assertIn("| engine installed | none found by the experiment's Python", report)
        self.assertIn("No cost cell was measured in this run", report)
        self.assertIn("No sweep was saved at TP 1", report)
        self.assertNotIn("### Sweeps", report)
        self.assertNotRegex(report, r"(?m)^-, ")  # a heading of labels no cell had
        # only what ran: no launch line for the arm that never started (copied, it would
        # start another model than asked), no pointer to a log nothing wrote, no empty table
        self.assertIn("flag off: its command could not be started:\n\n```\n"
                      "no-such-engine-command --port %d\n```" % self.ports[0], report)
        self.assertIn("flag on: not started (the run ended before its turn).", report)
        self.assertNotIn("vllm_serve.sh", report)
        self.assertNotIn("server_off.log", report)
        self.assertNotIn("server_on.log", report)
        self.assertIn("No arm's log at TP 1: no arm was started.", report)
        self.assertTrue(report.endswith("## Steps\n\nNo step ran.\n"), report)
        # MODEL is the flag-on arm's alone (its command is the launch script, which reads
        # it), and that arm never started: no model served is named
        self.assertNotIn("(not used: SERVE_OFF and SERVE_ON started the arms)", report)
        self.assertIn("not known: MODEL is only the flag-on arm's (its launch script reads it)",
                      report)

    def test_the_model_named_is_the_one_the_arms_served(self):
        """MODEL beside SERVE_OFF and SERVE_ON of one's own starts nothing: the report names
        the model the arms report serving, never MODEL."""
        stub = "python3 %s --port {port} --model stub/served-f32" % (
            os.path.join(ROOT, "tests", "stub_server.py"))
        code, out, err = self.finish(self.start(
            MODEL="org/not-served", SERVE_OFF=stub.format(port="{off}"),
            SERVE_ON=stub.format(port="{on}") + " --invariant --prefill-agrees"))
        self.assertEqual(code, 0, err)
        report = self.load_run("REPORT.md")
        self.assertIn("| model (as the arms report it) | stub/served-f32 |", report)
        self.assertNotIn("| model | org/not-served |", report)
        self.assertEqual(report.count("org/not-served"), 1, report)  # the variable, as given

    def test_model_is_named_where_the_launch_script_started_the_arms(self):
        """SERVE_OFF and SERVE_ON that run the launch script (as these tests' do): it reads
        MODEL, so MODEL is not said to be unused."""
        code, out, err = self.finish(self.start())
        self.assertEqual(code, 0, err)
        report = self.load_run("REPORT.md")
        self.assertNotIn("not used: SERVE_OFF and SERVE_ON started the arms", report)
        self.assertNotIn("MODEL started no arm", report)

    def test_no_engine_installed_is_named_as_the_cause(self):
        ports = free_port(), free_port()
        code, out, err = self.finish(self.start(
            OFF_URL="", ON_URL="", SERVE_OFF="", SERVE_ON="", OFF_PORT=str(ports[0]),
            ON_PORT=str(ports[1]), PATH=os.environ["PATH"]))  # no stand-in: no vllm at all
        self.assertEqual(code, 4, err)
        first = self.load_run("REPORT.md").splitlines()[0]
        self.assertRegex(first, r"exited with status 127; the cause in \S+: .*vllm: not found$")
        self.assertIn("| engine installed | none found", self.load_run("REPORT.md"))

    def test_an_arm_that_died_at_start_up_is_quoted_by_its_root_cause(self):
        """A real vLLM 0.34.0 arm's log (tests/fixtures/engine-logs/): the cause is a missing
        module, 50 lines above the log's last line, which only points back to it."""
        log = os.path.join(ROOT, "tests", "fixtures", "engine-logs",
                           "vllm-0.34.0-missing-module.log")
        code, out, err = self.finish(self.start(
            SERVE_OFF="bash -c 'cat \"$0\"; exit 1' %s --port {off}" % log))
        self.assertEqual(code, 4, err)
        said = [line for line in err.splitlines() if "exited with status 1" in line]
        self.assertEqual(len(said), 1, err)
        self.assertIn("the cause in", said[0])
        self.assertTrue(said[0].endswith(": ModuleNotFoundError: No module named 'cutlass'"),
                        said[0])
        first = self.load_run("REPORT.md").splitlines()[0]
        self.assertIn("ModuleNotFoundError: No module named 'cutlass'", first)
        self.assertNotIn("See root cause above", first)

    def test_ctrl_c_is_said_once_in_the_first_line(self):
        p = self.start(STANDIN_STEP_DELAY="0.05",
                       SWEEP_ARGS="--sizes 1,2,3,4,5,6,7,8 --max-tokens 40 --repeat 2")
        self.assertTrue(wait_for(lambda: self.runs() and os.path.exists(
            self.run_path("tp1", "sweep_off.json")), 120), "the sweep never saved")
        os.kill(p.pid, signal.SIGINT)  # as the terminal's Ctrl-C reaches the experiment
        code, out, err = self.finish(p)
        self.assertEqual(code, 130, err)
        first = self.load_run("REPORT.md").splitlines()[0]
        self.assertIn("INCOMPLETE (exit 130, stopped by Ctrl-C (SIGINT); each step saved what "
                      "it had measured)", first)
        self.assertNotIn("--save", first)  # run.py's own hint: no option of the experiment's
        self.assertEqual(first.count("Ctrl-C"), 1, first)
        self.assert_no_server_left()

    def test_a_late_term_names_where_it_stopped(self):
        """SIGTERM once the flag-off arm's sweep has ended, while the flag-on arm is still
        starting (it loads for ever): no step was running, and the first line says what was,
        and the last step that ended, not "NOT AS EXPECTED ... see the steps below"."""
        stub = "python3 %s --port {port}" % os.path.join(ROOT, "tests", "stub_server.py")
        p = self.start(SERVE_OFF=stub.format(port="{off}"),
                       SERVE_ON=stub.format(port="{on}") + " --invariant --load-seconds 600")
        for line in p.stderr:  # said once the step has ended
            # the steps' count: 4, or 6 with the pictures where matplotlib is installed
            ended = re.match(r"experiment: step 1 of (\d+): flag-off", line)
            if SWEEP_END.match(line) and ended:
                break
        else:
            self.fail("the flag-off sweep never ended")
        os.kill(p.pid, signal.SIGTERM)
        code, out, err = self.finish(p)
        self.assertEqual(code, 143, err)
        first = self.load_run("REPORT.md").splitlines()[0]
        self.assertIn("INCOMPLETE (exit 143, stopped by SIGTERM; each step saved what it had "
                      "measured): no step was running when it came: the flag-on arm was "
                      "starting (TP 1), after step 1 of %s (flag-off sweep, concurrent requests "
                      "(TP 1))" % ended.group(1), first)
        self.assertNotIn("see the steps below", first)
        self.assert_no_server_left()

    def test_a_full_disk_is_named_as_the_disk_never_as_the_server(self):
        """An output folder that can take no more (every file the run writes stops at 4 KB,
        as on a full disk): neither the steps' saves nor REPORT.md fit. The first line names
        the folder's disk, never "the server or network failed"; the report is printed, and no
        line points to a REPORT.md that is not there."""
        # no git under the limit: asked which commit the lab is (`git describe --dirty`), git
        # rewrites the checkout's index, and killed at the limit it would leave its lock
        code, out, err = self.finish(self.start(
            file_size=4096, GIT_DIR=os.devnull,
            SWEEP_ARGS="--sizes 1,2 --max-tokens 4 --repeat 2"))
        self.assertEqual(code, 74, err)
        self.assertNotIn("Traceback", err)
        first = out.splitlines()[0]
        self.assertIn("INCOMPLETE (exit 74, the output folder could not take what the run "
                      "wrote (a full disk, or a folder that may not be written): no server "
                      "failed): %s could not be written (File too large): the disk or the "
                      "folder, not a server" % self.run_path("REPORT.md"), first)
        self.assertIn("flag-off sweep, concurrent requests (TP 1): the output folder could not "
                      "take its results: the disk, not the server (run.py: --save: cannot "
                      "write", first)
        self.assertNotIn("the server or network failed", out)
        self.assertFalse(os.path.exists(self.run_path("REPORT.md")))
        self.assertNotIn("report: ", err)
        self.assertTrue(err.rstrip().endswith("REPORT.md could not be written (File too "
                                              "large): the report above is the only one"), err)
        self.assert_no_server_left()

    def stop_as_the_arms_stop(self, signum, **variables):
        """Run the experiment, and send signum once it says it is stopping the arms of TP 1
        (the flag-on arm takes its whole grace: it ignores TERM); (exit code, what it said
        up to then, the rest of stderr)."""
        stub = "%s --port {port}" % " ".join(STUB)
        p = self.start(SERVE_OFF=stub.format(port="{off}"),
                       SERVE_ON="sh -c 'trap \"\" TERM; exec %s --invariant --prefill-agrees'"
                       % stub.format(port="{on}"),
                       SWEEP_ARGS="--sizes 1,2 --max-tokens 4 --repeat 2", **variables)
        said = []
        for line in p.stderr:
            said.append(line)
            if line.startswith("experiment: stopping the arms"):
                break
        else:
            self.fail("no line said the arms were stopping: %s" % "".join(said))
        self.assertEqual(said[-1], "experiment: stopping the arms of TP 1, every step of it "
                         "ended: the flag-off arm and the flag-on arm (each within 10 s)\n")
        os.kill(p.pid, signum)
        code, out, err = self.finish(p)
        return code, "".join(said), err

    def test_a_stop_while_the_arms_stop_after_the_last_step_leaves_the_run_complete(self):
        """SIGTERM once every step has ended, while the arms stop: the run is whole, and says
        so; the experiment said what it was stopping before it did."""
        code, said, err = self.stop_as_the_arms_stop(signal.SIGTERM)
        self.assertEqual(code, 0, said + err)
        report = self.load_run("REPORT.md")
        self.assertEqual(report.splitlines()[0], "# Batch-invariance experiment, vllm: "
                         "complete, every step ran and every --expect held")
        self.assertIn("SIGTERM came while the arms stopped after the last step: every step "
                      "had ended, so the run is whole", report)
        self.assert_no_server_left()

    def test_a_stop_while_the_arms_stop_before_another_degree_stops_the_run_there(self):
        """Ctrl-C while the arms of TP 1 stop, TP 2 still to come: the run stops there, its
        first line saying what it was doing."""
        code, said, err = self.stop_as_the_arms_stop(signal.SIGINT, GPUS="0,1,2,3", TP="1,2")
        self.assertEqual(code, 130, said + err)
        first = self.load_run("REPORT.md").splitlines()[0]
        self.assertRegex(first, r"INCOMPLETE \(exit 130, stopped by Ctrl-C \(SIGINT\); each "
                                r"step saved what it had measured\): no step was running when "
                                r"it came: the arms were stopping after every step of TP 1, "
                                r"after step 4 of \d+ \(cost, shared-prefix \(TP 1\)\)$")
        self.assertFalse(os.path.exists(self.run_path("tp2")))
        self.assert_no_server_left()

    def test_a_report_the_terminal_cannot_encode_is_printed_with_replacements(self):
        """PYTHONIOENCODING=latin-1 (an ISO-8859-1 locale) and a model named in another
        script: the report is printed, those characters replaced, and a line says so."""
        code, out, err = self.finish(self.start(MODEL="stub/模型-f32", PYTHONIOENCODING="latin-1"))
        self.assertEqual(code, 0, err)
        self.assertTrue(out.startswith("# Batch-invariance experiment, vllm: complete"), out)
        self.assertIn("stub/??-f32", out)
        self.assertIn("cannot show every character of the report", err)
        self.assertIn("stub/模型-f32", self.load_run("REPORT.md"))

    def test_the_arms_ports_follow_off_port_and_on_port_into_the_launch_scripts(self):
        ports = free_port(), free_port()
        code, out, err = self.finish(self.start(
            OFF_URL="", ON_URL="", SERVE_OFF="", SERVE_ON="",
            OFF_PORT=str(ports[0]), ON_PORT=str(ports[1])))
        self.assertEqual(code, 0, err)
        self.assertIn("ready at http://localhost:%d" % ports[0], err)
        self.assertIn("vllm serve stub/tiny-f32 --port %d" % ports[1], self.load_run("REPORT.md"))

    def test_a_busy_port_is_refused_before_anything_starts(self):
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            code, out, err = self.finish(self.start(OFF_URL="http://127.0.0.1:%d" % port))
        self.assertEqual(code, 2, err)
        self.assertIn("port %d (the flag-off arm" % port, err)
        self.assertIn("move the arm with OFF_PORT=N", err)
        self.assertEqual(self.runs(), [])  # no run folder, no server started

    def test_malformed_variables_are_refused_before_anything_starts(self):
        for variables, words in (
            ({"TP": "1,x"}, "TP=1,x"),
            ({"TP": "0"}, "TP=0"),
            ({"GPUS": "0,,1"}, "empty entry"),
            ({"WAIT": "soon"}, "WAIT=soon"),
            ({"MEM": "half"}, "MEM=half"),
            # the experiment owns its steps: what it sets itself is refused, in any spelling
            ({"SWEEP_ARGS": "--traffic copies"}, "SWEEP_ARGS: --traffic is the experiment's own"),
            ({"SWEEP_ARGS": "--expect invariant"}, "SWEEP_ARGS: --expect is"),
            ({"SWEEP_ARGS": "--exp=variant"}, "--exp=variant (--expect)"),
            ({"COST_ARGS": "--workload cold"}, "COST_ARGS: --workload is"),
            ({"COST_ARGS": "--save x.json"}, "COST_ARGS: --save is"),
            ({"SWEEP_ARGS": "--url http://x:1"}, "SWEEP_ARGS: --url is"),
            # the sweeps bypass the prefix cache: kept, they would compare nothing
            ({"SWEEP_ARGS": "--prefix-cache keep"}, "SWEEP_ARGS: --prefix-cache is the "
             "experiment's own"),
            ({"OFF_URL": "http://127.0.0.1:{on}"}, "would both listen at"),
            ({"GPUS": "0,0"}, "names device 0 twice"),
            # by what run.py's parser makes of a word: an alias, and the options with which
            # run.py exits 0 having measured nothing
            ({"SWEEP_ARGS": "--base-url http://127.0.0.1:{off}"},
             "SWEEP_ARGS: --base-url (--url) is the experiment's own"),
            ({"SWEEP_ARGS": "--help"}, "SWEEP_ARGS: --help makes run.py print and exit"),
            ({"SWEEP_ARGS": "--vers"}, "SWEEP_ARGS: --vers (--version) makes run.py print"),
            ({"COST_ARGS": "-h"}, "COST_ARGS: -h (--help) makes run.py print and exit"),
            # each step's options through run.py's own configuration
            ({"SWEEP_ARGS": "--request-rate 5", "COPIES": "on"},
             "run.py refuses it in the flag-off sweep, copies in one request: --request-rate "
             "goes with --traffic concurrent"),
            ({"SWEEP_ARGS": "--trials 3"}, "--trials belongs to --mode cost"),
            ({"COST_ARGS": "--sizes 1,2"},
             "COST_ARGS: run.py refuses it in the cold cost cell: --sizes belongs to --mode "
             "sweep"),
            # addresses as run.py checks them, one machine in two spellings, ports against
            # the serve commands, devices as CUDA reads them
            ({"OFF_URL": "127.0.0.1:{off}"}, "OFF_URL: '127.0.0.1:"),
            ({"OFF_URL": "http://localhost:{off}", "ON_URL": "http://127.0.0.1:{off}"},
             "(http://127.0.0.1:{off} is the same address)"),
            ({"OFF_URL": "", "OFF_PORT": "{on}",
              "SERVE_OFF": "python3 tests/stub_server.py --port {off}"},
             "OFF_PORT={on}, but SERVE_OFF listens on --port {off}"),
            ({"OFF_URL": "http://localhost:{on}",
              "SERVE_OFF": "python3 tests/stub_server.py --port={off}"},
             "OFF_URL=http://localhost:{on} asks at port {on} of this machine, but the arm "
             "listens on {off}"),
            ({"GPUS": "0,00"}, "names device 0 twice ('0' and '00' are one to CUDA)"),
            # what no arm could ever answer at: the arms serve plain HTTP, /health at the root
            ({"OFF_URL": "https://127.0.0.1:{off}"},
             "OFF_URL=https://127.0.0.1:{off}: https:// (the engines the experiment starts "
             "serve plain HTTP"),
            ({"ON_URL": "http://127.0.0.1:{on}/v1"},
             "ON_URL=http://127.0.0.1:{on}/v1: a path after the port, /v1 (the experiment asks "
             "for the arm's /health at its root, and run.py adds /v1 itself); give "
             "http://127.0.0.1:{on}"),
            ({"ON_URL": "https://127.0.0.1:{on}/v1/"}, "https:// (the engines the experiment "
             "starts serve plain HTTP: they have no certificate); and a path after the port"),
            # a cost cell that could give no interval, in any spelling run.py takes
            ({"COST_ARGS": "--trials 2"}, "COST_ARGS: --trials 2 can give no interval in the "
             "cold cost cell: run.py's cost mode needs at least 6 trial pairs"),
            ({"COST_ARGS": "--tri=5 --batch 2"}, "COST_ARGS: --trials 5 can give no interval"),
        ):
            with self.subTest(variables=variables):
                code, out, err = self.finish(self.start(**variables))
                self.assertEqual(code, 2, err)
                self.assertIn(words.format(off=self.ports[0], on=self.ports[1]), err)
                self.assertEqual(len(errors(err)), 1, err)  # one line, no traceback
                self.assertEqual(self.runs(), [])

    def test_term_during_a_sweep_stops_everything_within_seconds(self):
        p = self.start(
            STANDIN_STEP_DELAY="0.05",
            SWEEP_ARGS="--sizes 1,2,3,4,5,6,7,8 --max-tokens 40 --repeat 2",
        )
        self.assertTrue(
            wait_for(
                lambda: self.runs() and os.path.exists(self.run_path("tp1", "sweep_off.json")), 120
            ),
            "the sweep never saved",
        )
        os.kill(p.pid, signal.SIGTERM)  # the experiment's own process, as a job scheduler stops it
        code, out, err = self.finish(p)
        self.assertEqual(code, 143, err)
        self.assertEqual(self.load_run("tp1", "sweep_off.json")["summary"]["state"], "terminated")
        self.assertIn("INCOMPLETE (exit 143", self.load_run("REPORT.md").splitlines()[0])
        self.assertIn("stopped by SIGTERM", self.load_run("REPORT.md").splitlines()[0])
        self.assert_no_server_left()
        for port in self.ports:
            self.assertEqual(
                subprocess.run(["pgrep", "-f", "--port %d" % port], capture_output=True).stdout,
                b"",
            )


class EveryOptionTheExperimentRefuses(TempDirTest):
    """Every option the experiment refuses in SWEEP_ARGS or COST_ARGS (its own, by run.py's
    dest, and those with which run.py measures nothing) is refused before any arm starts:
    exit 2, one line, no run folder, no serve command run."""

    def test_each_refused_option_is_refused_before_any_arm_starts(self):
        import contextlib
        import io
        sys.path.insert(0, os.path.join(ROOT, "examples"))
        import experiment
        parser = run.build_parser()
        marker = self.path("an-arm-started")
        serve = "python3 -c 'open(%r, \"w\")' --port {port}" % marker
        refused = [(name, dest) for name, dests in experiment.OWNED_DESTS.items()
                   for dest in dests + experiment.ENDING_DESTS]
        self.assertIn(("SWEEP_ARGS", "prefix_cache"), refused)
        for name, dest in refused:
            action = next(a for a in parser._actions if a.dest == dest)
            option = next(o for o in action.option_strings if o.startswith("--"))
            words = [option] + (["x"] if action.nargs != 0 else [])
            with self.subTest(variable=name, option=option):
                env = {"PATH": os.environ["PATH"], name: " ".join(words),
                       "SERVE_OFF": serve.format(port=free_port()),
                       "SERVE_ON": serve.format(port=free_port())}
                said = io.StringIO()
                with contextlib.redirect_stderr(said):
                    code = experiment.main(["vllm", self.path("out")], env)
                self.assertEqual(code, 2, said.getvalue())
                lines = said.getvalue().splitlines()
                self.assertEqual(len(lines), 1, lines)
                self.assertTrue(lines[0].startswith("experiment: %s: %s " % (name, option)),
                                lines)
                self.assertFalse(os.path.exists(self.path("out")))
                self.assertFalse(os.path.exists(marker))


class ByHandScripts(unittest.TestCase):
    def test_cost_cells_under_load(self):
        """CONCURRENCY=N examples/cost_cells.sh TP times load cells: run.py takes a batch or
        a concurrency, so the script passes one of them."""
        with tempfile.TemporaryDirectory() as tmp:
            off, on = free_port(), free_port()
            stubs = [subprocess.Popen(STUB + ["--port", str(port)] + extra,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for port, extra in ((off, []), (on, ["--invariant"]))]
            try:
                env = dict(os.environ, CONCURRENCY="2", OFF="http://127.0.0.1:%d" % off,
                           ON="http://127.0.0.1:%d" % on, SAVE=os.path.join(tmp, "cost.json"))
                p = subprocess.run(
                    ["bash", os.path.join(ROOT, "examples", "cost_cells.sh"), "1",
                     "--wait-ready", "60", "--trials", "2", "--warmup", "0", "--max-tokens", "4",
                     "--requests", "4", "--quiet"],
                    env=env, capture_output=True, text=True, timeout=240)
            finally:
                for stub in stubs:
                    stub.terminate()
                    stub.wait(timeout=30)
            self.assertEqual(p.returncode, 0, p.stderr)
            with open(os.path.join(tmp, "cost.json"), encoding="utf-8") as f:
                cells = json.load(f)["cells"]
        self.assertEqual(sorted((c["workload"], c["concurrency"]) for c in cells),
                         [("cold", 2), ("shared-prefix", 2)])


class LaunchScriptsShareMemory(unittest.TestCase):
    """Two arms on one device each take a share of its memory (an engine's default share
    leaves no room for the other arm): whenever placement.sh puts them together, the launch
    scripts pass the share; a device named twice is refused."""

    FLAGS = {"vllm": "--gpu-memory-utilization", "sglang": "--mem-fraction-static"}

    def launch(self, engine, arm, **variables):
        """The engine command a launch script runs, from a stand-in that prints it."""
        with tempfile.TemporaryDirectory() as tmp:
            echo = "import sys; print(' '.join(sys.argv[1:]))\n"
            os.makedirs(os.path.join(tmp, "sglang"))
            for name in ("__init__.py", "launch_server.py"):
                with open(os.path.join(tmp, "sglang", name), "w") as f:
                    f.write(echo if name == "launch_server.py" else "")
            with open(os.path.join(tmp, "vllm"), "w") as f:
                f.write("#!/bin/sh\necho \"$@\"\n")
            os.chmod(os.path.join(tmp, "vllm"), 0o755)
            env = dict(os.environ, PATH=tmp + os.pathsep + os.environ["PATH"], PYTHONPATH=tmp,
                       **variables)
            for name in ("MEM", "CUDA_VISIBLE_DEVICES"):
                env.pop(name, None)
            return subprocess.run(
                ["bash", os.path.join(ROOT, "examples", "%s_serve.sh" % engine), arm],
                env=env, capture_output=True, text=True, timeout=60)

    def test_the_share_whenever_the_arms_share_a_device(self):
        for engine, flag in self.FLAGS.items():
            for gpus, tp, shared in (("0", "1", True), ("0,1,2", "2", True), ("0,1", "1", False),
                                     ("0,1,2,3", "2", False)):
                for arm in ("off", "on"):
                    with self.subTest(engine=engine, GPUS=gpus, TP=tp, arm=arm):
                        p = self.launch(engine, arm, GPUS=gpus, TP=tp)
                        self.assertEqual(p.returncode, 0, p.stderr)
                        self.assertEqual("%s 0.45" % flag in p.stdout, shared, p.stdout)

    def test_a_device_named_twice_as_cuda_reads_it_is_refused(self):
        for engine in self.FLAGS:
            with self.subTest(engine=engine):
                p = self.launch(engine, "on", GPUS="0,00")
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn("GPUS=0,00 names device 0 twice", p.stderr)
                self.assertEqual(p.stdout, "")  # no engine started


class SglangExperiment(Experiment):
    engine = "sglang"

    def test_the_sglang_experiment_runs_with_the_radix_cache_off(self):
        code, out, err = self.finish(self.start())
        self.assertEqual(code, 0, err)
        on = self.load_run("tp1", "sweep_on.json")
        self.assertEqual(on["server"]["hazards"], [])
        self.assertIs(on["server"]["settings"]["radix cache disabled"], True)
        self.assertIn("| flag on | sglang |", self.load_run("REPORT.md"))


if __name__ == "__main__":
    unittest.main()
