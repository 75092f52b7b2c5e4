"""The recipes the lab prints and ships measure batching: the default traffic shape is
concurrent requests with a cache key each, on both engines; every sweep command printed (the
harness commands, --mode help, the launch scripts' headers, the READMEs) sends that shape
unless it names copies, the upstream tests' shape, on purpose."""

import os
import re
import shlex
import unittest

from support import ROOT, StubConfig, StubServer, TempDirTest, run, run_lab


def sweep_commands(text):
    """Every `run.py --mode sweep` command in a text, its continued lines joined, as words."""
    joined = re.sub(r"\\\n\s*", " ", text)
    found = []
    for line in joined.splitlines():
        at = line.find("run.py --mode sweep")
        if at < 0:
            continue
        command = line[at:].split("  #")[0].split(" # ")[0]
        try:
            found.append(shlex.split(command))
        except ValueError:  # a line of prose quoting a command in part
            continue
    return found


def traffic_of(words):
    """The --traffic a command sends (run.py's default where it names none)."""
    shape = run.DEFAULT_TRAFFIC
    for i, word in enumerate(words):
        if word == "--traffic" and i + 1 < len(words):
            shape = words[i + 1]
        elif word.startswith("--traffic="):
            shape = word.split("=", 1)[1]
    return shape


class TheDefaultShape(TempDirTest):
    def test_the_default_is_concurrent_requests_a_cache_key_each(self):
        self.assertEqual(run.DEFAULT_TRAFFIC, "concurrent")
        parser = run.build_parser()
        self.assertEqual(parser.parse_args(["--mode", "sweep"]).traffic, "concurrent")

    def test_the_default_sweep_measures_vllm_arms_that_report_cached_tokens(self):
        """As vllm_serve.sh starts vLLM (--enable-prompt-tokens-details): with copies in one
        request both arms fail their --expect (the cache served the copies); the default
        shape holds both, every request computed cold."""
        for invariant, expect, verdict in ((False, "variant", "tokens diverged"),
                                           (True, "invariant", "invariant")):
            with self.subTest(invariant=invariant):
                name = "s-%s.json" % invariant
                # a window wide enough that a size's requests meet in one step under load
                with StubServer(StubConfig(invariant=invariant, prompt_tokens_details=True,
                                           scheduler_window=0.2)) as stub:
                    r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2,5,9",
                                "--max-tokens", 24, "--repeat", 2, "--expect", expect,
                                "--save", self.path(name))
                    copies = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2,5,9",
                                     "--max-tokens", 24, "--repeat", 2, "--expect", expect,
                                     "--traffic", "copies")
                self.assertEqual(r.code, 0, r)
                doc = self.load(name)
                self.assertEqual(doc["params"]["traffic"], "concurrent")
                self.assertEqual(doc["summary"]["verdict"], verdict)
                self.assertEqual(doc["summary"]["prefix_cache_bypass"]["status"], "held")
                self.assertEqual(copies.code, 1, copies)  # the shape the default replaced


class PrintedRecipes(unittest.TestCase):
    def assert_measures(self, where, text):
        commands = sweep_commands(text)
        self.assertTrue(commands, "%s prints no sweep command" % where)
        for words in commands:
            with self.subTest(where=where, command=" ".join(words)):
                # copies only where named, and then with no --expect invariant: on vLLM the
                # copies of one request share the prefix cache, so nothing is compared
                shape = traffic_of(words)
                self.assertIn(shape, ("concurrent", "copies", "mixed"))
                if shape == "copies":
                    self.assertIn("copies", words)
                    self.assertNotIn("invariant", words)

    def test_harness_and_guide(self):
        for engine in ("vllm", "sglang"):
            r = run_lab("--mode", "harness", "--engine", engine)
            self.assertEqual(r.code, 0, r)
            self.assert_measures("--mode harness --engine %s" % engine, r.stdout)
        r = run_lab("--mode", "help")
        self.assertEqual(r.code, 0, r)
        self.assert_measures("--mode help", r.stdout)
        self.assertIn("--traffic concurrent (default)", r.stdout)

    def test_harness_vllm_servers_report_cached_tokens(self):
        """The harness's vllm serve lines let the lab prove the bypass held."""
        out = run_lab("--mode", "harness", "--engine", "vllm").stdout
        serves = re.sub(r"\\\n\s*", " ", out)
        lines = [line for line in serves.splitlines() if " vllm serve " in line
                 and "VLLM_SERVER_DEV_MODE=1" in line]
        self.assertEqual(len(lines), 2, out)
        for line in lines:
            self.assertIn("--enable-prompt-tokens-details", line)

    def test_launch_scripts_and_readmes(self):
        for page in ("README.md", os.path.join("examples", "README.md"),
                     os.path.join("examples", "vllm_serve.sh"),
                     os.path.join("examples", "sglang_serve.sh")):
            with open(os.path.join(ROOT, page), encoding="utf-8") as f:
                self.assert_measures(page, f.read())


if __name__ == "__main__":
    unittest.main()
