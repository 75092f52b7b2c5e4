"""Launching both arms and waiting for them: --wait-ready, and examples/experiment.sh run
end to end with the practice engine standing in for the GPU engines."""

import os
import signal
import socket
import subprocess
import sys
import time
import unittest

from support import ROOT, TempDirTest, free_port, run_lab, wait_for

STUB = [sys.executable, os.path.join(ROOT, "tests", "stub_server.py")]




def listening(port):
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def errors(stderr):
    return [line for line in stderr.splitlines() if not line.startswith("run.py: progress: ")]


class WaitReady(unittest.TestCase):
    def test_a_server_that_starts_late_is_waited_for(self):
        port = free_port()
        late = subprocess.Popen(["bash", "-c", 'sleep 3 && exec "$@"', "late"] + STUB + ["--port", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            start = time.monotonic()
            r = run_lab("--mode", "sweep", "--url", "http://127.0.0.1:%d" % port, "--wait-ready", 10,
                        "--sizes", "1,2", "--max-tokens", 4, "--repeat", 1)
            self.assertEqual(r.code, 0, r)
            self.assertGreater(time.monotonic() - start, 2.5)
            self.assertIn("waiting up to 10s for the server", r.stderr)
        finally:
            late.terminate()
            late.wait(timeout=10)

    def test_nothing_there_is_one_line_and_exit_3_in_time(self):
        port = free_port()
        start = time.monotonic()
        r = run_lab("--mode", "sweep", "--url", "http://127.0.0.1:%d" % port, "--wait-ready", 10, "--sizes", "1")
        took = time.monotonic() - start
        self.assertEqual(r.code, 3, r)
        self.assertEqual(len(errors(r.stderr)), 1, r.stderr)
        self.assertIn("was not ready within 10s (--wait-ready)", r.stderr)
        self.assertLess(took, 11.0)
        self.assertGreater(took, 9.0)

    def test_quiet_waits_silently(self):
        r = run_lab("--mode", "cost", "--url", "http://127.0.0.1:%d" % free_port(), "--invariant",
                    "http://127.0.0.1:%d" % free_port(), "--wait-ready", 0.6, "--quiet")
        self.assertEqual(r.code, 3, r)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
        self.assertIn("the flag-off arm (--url)", r.stderr)


class Experiment(TempDirTest):
    def start(self, out="out", flag_off_arm_invariant=False, **variables):
        """Run examples/experiment.sh in a session of its own, the practice engine standing in."""
        self.ports = free_port(), free_port()
        env = dict(os.environ,
                   SERVE_OFF="%s %s --port %d%s" % (sys.executable, STUB[1], self.ports[0],
                                                   " --invariant" if flag_off_arm_invariant else ""),
                   SERVE_ON="%s %s --port %d --invariant" % (sys.executable, STUB[1], self.ports[1]),
                   OFF_URL="http://127.0.0.1:%d" % self.ports[0], ON_URL="http://127.0.0.1:%d" % self.ports[1],
                   WAIT="30", SWEEP_ARGS="--sizes 1,2,9,17 --max-tokens 16 --repeat 1",
                   COST_ARGS="--batch 2 --trials 3 --warmup 0 --max-tokens 4")
        env.update(variables)
        return subprocess.Popen(["bash", os.path.join(ROOT, "examples", "experiment.sh"), "vllm", self.path(out)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)

    def assert_no_server_left(self):
        self.assertTrue(wait_for(lambda: not any(listening(p) for p in self.ports), 10), "a server is still up")

    def test_the_whole_experiment_with_the_practice_engine(self):
        p = self.start()
        out, err = p.communicate(timeout=240)
        self.assertEqual(p.returncode, 0, err)
        files = set(os.listdir(self.path("out")))
        for name in ("sweep_off.json", "sweep_on.json", "cost.json", "server_off.log", "server_on.log"):
            self.assertIn(name, files)
        try:
            import matplotlib  # noqa: F401
            self.assertTrue({"sweep.png", "cost.png"} <= files, files)
        except ImportError:
            self.assertIn("no pictures", err)
        self.assertEqual(len(self.load("out/cost.json")["cells"]), 2)
        self.assertIn("experiment: flag-on sweep: exit 0", err)
        self.assert_no_server_left()

    def test_interrupted_it_stops_both_servers(self):
        p = self.start()
        self.assertTrue(wait_for(lambda: os.path.exists(self.path("out/sweep_off.txt")), 60))
        # A stop reaches the whole group, as Ctrl-C or a job scheduler's stop does. SIGTERM, not
        # SIGINT: a shell started in the background inherits SIGINT ignored and cannot trap it.
        os.killpg(p.pid, signal.SIGTERM)
        out, err = p.communicate(timeout=120)
        self.assertNotEqual(p.returncode, 0, err)
        self.assert_no_server_left()

    def test_the_first_failing_steps_code_is_the_scripts(self):
        # A flag-off arm that is really flag on: its sweep finds nothing, so --expect variant fails.
        p = self.start(flag_off_arm_invariant=True, SWEEP_ARGS="--sizes 1,2 --max-tokens 8 --repeat 1",
                       COST_ARGS="--batch 1 --trials 1 --warmup 0 --max-tokens 2 --allow-mismatch")
        out, err = p.communicate(timeout=240)
        self.assertEqual(p.returncode, 1, err)
        self.assertIn("experiment: flag-off sweep: exit 1", err)
        self.assertIn("experiment: flag-on sweep: exit 0", err)
        self.assert_no_server_left()


if __name__ == "__main__":
    unittest.main()
