"""examples/: the launch scripts match the engines' documented flags, the samples are real
lab outputs, and the plot scripts turn them into PNGs."""

import os
import re
import subprocess
import sys
import tempfile
import unittest

from support import ROOT, run

EXAMPLES = os.path.join(ROOT, "examples")

try:
    import matplotlib  # noqa: F401
    HAVE_MATPLOTLIB = True
except ImportError:
    HAVE_MATPLOTLIB = False

# Flags and variables the engines document (the lab's FACTS sheet), per launch script family.
VLLM_FLAGS = {"--port", "--attention-backend", "--max-num-seqs", "--max-model-len", "--tensor-parallel-size"}
VLLM_ENV = {"VLLM_BATCH_INVARIANT", "VLLM_SERVER_DEV_MODE"}
VLLM_BACKENDS = {"FLASH_ATTN", "FLEX_ATTENTION", "TRITON_ATTN", "FLASH_ATTN_MLA", "TRITON_MLA"}
SGLANG_FLAGS = {"--model-path", "--port", "--attention-backend", "--cuda-graph-max-bs-decode",
                "--tp-size", "--enable-deterministic-inference"}
SGLANG_BACKENDS = {"fa3", "flashinfer", "triton"}


def read(name):
    with open(os.path.join(EXAMPLES, name), encoding="utf-8") as f:
        return f.read()


def command_flags(script):
    """Flags on the exec'd command (comments stripped)."""
    command = script[script.index("\nexec "):].replace("python3 -m sglang.launch_server", "")
    return set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", command))


def default(script, var):
    return re.search(r"^%s=\$\{%s:-([^}]*)\}" % (var, var), script, re.M).group(1)


class LaunchScripts(unittest.TestCase):
    def test_vllm_arms(self):
        off, on = read("vllm_flag_off.sh"), read("vllm_flag_on.sh")
        for script in (off, on):
            self.assertEqual(command_flags(script), VLLM_FLAGS)
            self.assertIn("export VLLM_SERVER_DEV_MODE=1", script)
            self.assertIn(default(script, "BACKEND"), VLLM_BACKENDS)
            self.assertTrue(set(re.findall(r"export (\w+)=", script)) <= VLLM_ENV)
        self.assertIn("export VLLM_BATCH_INVARIANT=0", off)
        self.assertIn("export VLLM_BATCH_INVARIANT=1", on)
        self.assertEqual(default(off, "BACKEND"), default(on, "BACKEND"))  # pinned alike
        self.assertEqual(default(off, "MODEL"), default(on, "MODEL"))
        self.assertEqual(off[off.index("\nexec "):], on[on.index("\nexec "):])  # only the flag differs

    def test_sglang_arms(self):
        off, on = read("sglang_flag_off.sh"), read("sglang_flag_on.sh")
        self.assertEqual(command_flags(off), SGLANG_FLAGS - {"--enable-deterministic-inference"})
        self.assertEqual(command_flags(on), SGLANG_FLAGS)
        for script in (off, on):
            self.assertIn("--cuda-graph-max-bs-decode 32", script)
            self.assertIn(default(script, "BACKEND"), SGLANG_BACKENDS)
        self.assertEqual(default(off, "BACKEND"), default(on, "BACKEND"))
        command_off = off[off.index("\nexec "):]
        command_on = on[on.index("\nexec "):].replace(" \\\n    --enable-deterministic-inference", "")
        self.assertEqual(command_off, command_on)

    def test_cost_cells_script_runs_both_workloads_with_the_lab(self):
        script = read("cost_cells.sh")
        self.assertIn("for WORKLOAD in cold shared-prefix", script)
        self.assertIn("--mode cost", script)
        parser = run.build_parser()
        known = {o for a in parser._actions for o in a.option_strings}
        used = set(re.findall(r"(--[a-z][a-z-]*)", script[script.index("\nfor "):]))
        self.assertTrue(used <= known, used - known)

    def test_scripts_are_valid_bash(self):
        for name in sorted(os.listdir(EXAMPLES)):
            if name.endswith(".sh"):
                p = subprocess.run(["bash", "-n", os.path.join(EXAMPLES, name)], capture_output=True, text=True)
                self.assertEqual(p.returncode, 0, (name, p.stderr))


class Samples(unittest.TestCase):
    def load(self, name):
        import json
        return json.loads(read(name))

    def test_sweep_samples_show_the_effect_and_its_absence(self):
        off, on = self.load("sample_sweep_off.json"), self.load("sample_sweep_on.json")
        for doc in (off, on):
            self.assertEqual(doc["schema"], run.SWEEP_SCHEMA)
        self.assertFalse(off["server"]["flag"])
        self.assertTrue(on["server"]["flag"])
        self.assertGreater(off["summary"]["unique_completions"], 1)
        self.assertEqual((on["summary"]["unique_completions"], on["summary"]["max_ulp"]), (1, 0))

    def test_cost_sample_fills_the_four_cells(self):
        doc = self.load("sample_cost.json")
        self.assertEqual(doc["schema"], run.COST_SCHEMA)
        self.assertEqual(sorted((c["tp"], c["workload"]) for c in doc["cells"]),
                         [(1, "cold"), (1, "shared-prefix"), (2, "cold"), (2, "shared-prefix")])
        table = "\n".join(run.cost_table_lines(doc, doc["cells"][0]))
        self.assertNotIn("missing", table)
        self.assertNotIn("One cell alone", table)


class PlotScripts(unittest.TestCase):
    def plot(self, script, *args, env=None):
        return subprocess.run([sys.executable, os.path.join(EXAMPLES, script)] + list(args),
                              capture_output=True, text=True, timeout=120, env=env)

    @unittest.skipUnless(HAVE_MATPLOTLIB, "matplotlib is not installed")
    def test_plots_from_the_samples(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "sweep.png")
            p = self.plot("plot_sweep.py", os.path.join(EXAMPLES, "sample_sweep_off.json"),
                          os.path.join(EXAMPLES, "sample_sweep_on.json"), "-o", out)
            self.assertEqual(p.returncode, 0, p.stderr)
            with open(out, "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
            out = os.path.join(tmp, "cost.png")
            p = self.plot("plot_cost.py", os.path.join(EXAMPLES, "sample_cost.json"), "-o", out)
            self.assertEqual(p.returncode, 0, p.stderr)
            with open(out, "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

    @unittest.skipUnless(HAVE_MATPLOTLIB, "matplotlib is not installed")
    def test_wrong_kind_of_file_is_refused(self):
        with tempfile.TemporaryDirectory() as tmp:
            p = self.plot("plot_sweep.py", os.path.join(EXAMPLES, "sample_cost.json"), "-o",
                          os.path.join(tmp, "x.png"))
        self.assertEqual(p.returncode, 2)
        self.assertIn("not a sweep file", p.stderr)

    def test_missing_matplotlib_exits_2_with_the_install_hint(self):
        with tempfile.TemporaryDirectory() as tmp:
            os.mkdir(os.path.join(tmp, "matplotlib"))
            with open(os.path.join(tmp, "matplotlib", "__init__.py"), "w") as f:
                f.write("raise ImportError('hidden for this test')\n")
            env = dict(os.environ, PYTHONPATH=tmp)
            for script, data in (("plot_sweep.py", "sample_sweep_off.json"), ("plot_cost.py", "sample_cost.json")):
                p = self.plot(script, os.path.join(EXAMPLES, data), "-o", os.path.join(tmp, "x.png"), env=env)
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn("pip install matplotlib", p.stderr)


if __name__ == "__main__":
    unittest.main()
