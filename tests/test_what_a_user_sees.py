"""What a user meets first: the code a result came from (--version, the saved `lab` record),
the names `vllm bench serve` users know, the figures it prints under load, a hint with each
error a newcomer makes, a terminal that takes no escape codes, the experiment's own help
and its progress, and a practice engine whose --slowdown is the overhead a cost run sees."""

import contextlib
import hashlib
import importlib.util
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

from support import (ROOT, StubConfig, StubServer, TempDirTest, free_port, one_error_line, run,
                     run_lab)

sys.path.insert(0, os.path.join(ROOT, "examples"))
import experiment  # noqa: E402

RUN_PY = os.path.join(ROOT, "run.py")


def git(folder, *args):
    return subprocess.run(["git", "-C", folder, "-c", "user.name=lab", "-c", "user.email=lab@x",
                           *args], capture_output=True, text=True, check=True).stdout.strip()


def version_of(path):
    p = subprocess.run([sys.executable, path, "--version"], capture_output=True, text=True,
                       timeout=60)
    return p.returncode, p.stdout.strip()


@unittest.skipIf(shutil.which("git") is None, "no git on this machine")
class TheCodeIsNamed(TempDirTest):
    def test_a_checkout_is_named_by_its_commit_and_said_dirty_when_changed(self):
        shutil.copy(RUN_PY, self.path("run.py"))
        git(self.tmp, "init", "-q")
        git(self.tmp, "add", "run.py")
        git(self.tmp, "commit", "-q", "-m", "lab")
        commit = git(self.tmp, "rev-parse", "--short", "HEAD")
        named = "run.py (batch-invariance lab) %s, git %s" % (run.LAB_VERSION, commit)
        self.assertEqual(version_of(self.path("run.py")), (0, named))
        with open(self.path("run.py"), "a", encoding="utf-8") as f:
            f.write("\n# a local change\n")
        with open(self.path("run.py"), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:12]
        self.assertEqual(version_of(self.path("run.py"))[1],
                         "%s-dirty, run.py sha256 %s" % (named, digest))

    def test_two_clones_of_one_commit_with_other_edits_read_differently(self):
        os.mkdir(self.path("a"))
        shutil.copy(RUN_PY, os.path.join(self.path("a"), "run.py"))
        git(self.path("a"), "init", "-q")
        git(self.path("a"), "add", "run.py")
        git(self.path("a"), "commit", "-q", "-m", "lab")
        git(self.tmp, "clone", "-q", self.path("a"), self.path("b"))
        names = []
        for clone, edit in (("a", "# one change\n"), ("b", "# another change\n")):
            with open(os.path.join(self.path(clone), "run.py"), "a", encoding="utf-8") as f:
                f.write(edit)
            names.append(version_of(os.path.join(self.path(clone), "run.py"))[1])
        self.assertNotEqual(names[0], names[1])
        self.assertTrue(all("-dirty, run.py sha256 " in name for name in names), names)

    def test_a_copy_outside_a_checkout_is_named_by_the_hash_of_its_bytes(self):
        shutil.copy(RUN_PY, self.path("run.py"))
        with open(self.path("run.py"), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:12]
        self.assertEqual(version_of(self.path("run.py")),
                         (0, "run.py (batch-invariance lab) %s, run.py sha256 %s"
                          % (run.LAB_VERSION, digest)))

    def test_a_copy_dropped_into_another_checkout_is_not_named_by_that_checkout(self):
        git(self.tmp, "init", "-q")
        with open(self.path("other.txt"), "w", encoding="utf-8") as f:
            f.write("another project\n")
        git(self.tmp, "add", "other.txt")
        git(self.tmp, "commit", "-q", "-m", "other")
        shutil.copy(RUN_PY, self.path("run.py"))  # untracked there
        self.assertIn("run.py sha256 ", version_of(self.path("run.py"))[1])

    def test_every_saved_result_names_the_code(self):
        with StubServer() as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1", "--max-tokens", 2,
                        "--repeat", 1, "--save", self.path("s.json"))
        self.assertEqual(r.code, 0, r.stderr)
        self.assertEqual(self.load("s.json")["lab"]["code"], run.lab_code())


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
        self.assertAlmostEqual(stats.ttft.p90_s, 0.09)
        self.assertAlmostEqual(stats.ttft.p99_s, 0.10)
        self.assertAlmostEqual(stats.itl.mean_s, 0.02)
        self.assertAlmostEqual(stats.itl.p99_s, 0.03)
        record = run.as_record(stats)
        self.assertEqual(sorted(record["itl"]), ["mean_s", "median_s", "p90_s", "p99_s"])
        self.assertNotIn("itl_s", record["requests"][0][0])  # gaps summed up, not saved one by one

    def test_a_load_run_prints_the_four_figures_of_each(self):
        with StubServer(StubConfig(step_delay=0.002)) as off, \
                StubServer(StubConfig(invariant=True, step_delay=0.002)) as on:
            r = run_lab("--mode", "cost", "--base-url", off.url, "--invariant", on.url,
                        "--max-concurrency", 2, "--num-prompts", 4, "--trials", 2, "--warmup", 0,
                        "--max-tokens", 6)
        self.assertEqual(r.code, 0, r.stderr)
        self.assertRegex(r.stdout, r"mean/median/p90/p99 ms: TTFT [0-9.]+/[0-9.]+/[0-9.]+/"
                                   r"[0-9.]+, TPOT [0-9./]+, ITL [0-9./]+, E2E [0-9./]+")


class ErrorsWithTheirHint(TempDirTest):
    def test_connection_refused_suggests_wait_ready(self):
        url = "http://127.0.0.1:%d" % free_port()
        r = run_lab("--mode", "sweep", "--url", url, "--sizes", "1")
        one_error_line(self, r, 3, "connection refused")
        self.assertIn("--wait-ready SECONDS waits for it", r.stderr)

    def test_a_url_without_a_scheme_suggests_http(self):
        r = run_lab("--mode", "sweep", "--url", "localhost:8000")
        one_error_line(self, r, 2, "give http://localhost:8000")

    def test_https_against_plain_http_suggests_http(self):
        with StubServer() as stub:
            url = stub.url.replace("http://", "https://")
            r = run_lab("--mode", "sweep", "--url", url, "--sizes", "1")
        one_error_line(self, r, 3, "TLS with %s failed" % url)
        self.assertIn("try %s" % stub.url, r.stderr)

    def test_401_names_the_key_options(self):
        with StubServer(StubConfig(faults={1: "keyinbody"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1", "--max-tokens", 2,
                        "--repeat", 1, env={k: v for k, v in os.environ.items()
                                            if k != "OPENAI_API_KEY"})
        self.assertEqual(r.code, 3, r.stderr)
        self.assertIn("HTTP 401", r.stderr)
        self.assertIn("give it with --api-key or $OPENAI_API_KEY", r.stderr)
        with StubServer(StubConfig(faults={1: "keyinbody"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1", "--max-tokens", 2,
                        "--repeat", 1, "--api-key", "sk-a-key-of-some-length")
        self.assertIn("the server refused the key given", r.stderr)

    def test_a_mode_given_as_a_word_suggests_the_option(self):
        r = run_lab("sweep", "--url", "http://localhost:8000")
        one_error_line(self, r, 2, "a mode is chosen with --mode: run.py --mode sweep")


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


class TheExperimentSays(TempDirTest):
    def test_help_exits_0_and_names_every_variable_with_its_default(self):
        p = subprocess.run(["bash", os.path.join(ROOT, "examples", "experiment.sh"), "--help"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        for variable in ("GPUS=0", "TP=1", "WAIT=900", "COPIES=on", "OVERLAP=on", "SERVE_OFF",
                         "SERVE_ON", "OFF_PORT", "ON_PORT", "OFF_URL", "ON_URL", "MODEL",
                         "BACKEND", "MAX_MODEL_LEN", "RADIX_CACHE", "EXTRA_ARGS", "SWEEP_ARGS",
                         "COST_ARGS", "MEM"):
            self.assertIn(variable, p.stdout)

    def test_a_running_step_says_its_newest_progress_line(self):
        err_path = self.path("step.err")
        with open(err_path, "w", encoding="utf-8") as f:
            f.write("run.py: progress: batch 2 done | 1/4 batches\n"
                    "run.py: warning: something\n"
                    "run.py: progress: batch 4 done | 2/4 batches\n"
                    "run.py: progress: batch 8 do")  # still being written: not said yet
        step = experiment.Step("flag-off sweep", 1, number=3)
        job = experiment.Job(step, [], self.path("step.txt"))
        said = io.StringIO()
        with contextlib.redirect_stderr(said):
            experiment.Experiment.relay_progress(None, job)  # said_at 0: due
            experiment.Experiment.relay_progress(None, job)  # not due again yet
        self.assertEqual(said.getvalue(), "experiment:   step 3: batch 4 done | 2/4 batches\n")

    def test_the_environment_names_torch_and_the_engine_installed(self):
        """One probe of the experiment's Python: torch with its CUDA, and the engines as
        installed (a package's metadata is enough)."""
        os.makedirs(self.path("site/torch"))
        with open(self.path("site/torch/__init__.py"), "w", encoding="utf-8") as f:
            f.write('__version__ = "2.14.0"\nclass version:\n    cuda = "13.0"\n')
        os.makedirs(self.path("site/vllm-0.33.0.dist-info"))
        with open(self.path("site/vllm-0.33.0.dist-info/METADATA"), "w", encoding="utf-8") as f:
            f.write("Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n")
        found = dict(experiment.environment(dict(os.environ, PYTHONPATH=self.path("site"))))
        self.assertEqual(found["torch"], "2.14.0 (CUDA 13.0)")
        self.assertEqual(found["vllm installed"], "0.33.0")
        if importlib.util.find_spec("torch") is None:  # a machine without torch of its own
            bare = dict(experiment.environment(dict(os.environ, PYTHONPATH=self.path("none"))))
            self.assertEqual(bare["torch"], "not importable by the experiment's Python")

    def test_ctrl_c_is_said_as_ctrl_c(self):
        self.assertEqual(str(experiment.Stopped(signal.SIGINT)), "Ctrl-C (SIGINT)")
        self.assertEqual(str(experiment.Stopped(signal.SIGTERM)), "SIGTERM")


class TheSlowdownIsTheOverhead(TempDirTest):
    def test_a_cost_run_against_the_practice_arms_sees_the_stated_slowdown(self):
        """All of the flag-on arm's own time is slowed, its batching window included: the
        overhead is the stated 25 %, less the lab's own share of each request (the same on
        both arms, under a millisecond here)."""
        window = dict(step_delay=0.002, scheduler_window=0.05)
        with StubServer(StubConfig(**window)) as off, \
                StubServer(StubConfig(invariant=True, slowdown=1.25, **window)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 4,
                        "--trials", 6, "--warmup", 1, "--max-tokens", 16, "--json")
        self.assertEqual(r.code, 0, r.stderr)
        overhead = r.json()["overhead_pct"]
        self.assertGreater(overhead, 23.0)  # a window left unslowed gave +9.4 %
        self.assertLess(overhead, 25.5)


if __name__ == "__main__":
    unittest.main()
