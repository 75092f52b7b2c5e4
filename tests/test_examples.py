"""examples/: the launch scripts match the engines' documented flags, the samples are real
lab outputs, the plot scripts turn them into PNGs, compare.py and the plots refuse files
they did not write, and the experiment says its help, its progress and its environment."""

import contextlib
import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

from support import ROOT, TempDirTest, run

EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)
import experiment  # noqa: E402

try:
    import matplotlib  # noqa: F401
    HAVE_MATPLOTLIB = True
except ImportError:
    HAVE_MATPLOTLIB = False

# Flags the engines document (the lab's facts sheet), per launch script.
VLLM_FLAGS = {"--port", "--attention-backend", "--max-num-seqs", "--enable-prompt-tokens-details",
              "--tensor-parallel-size", "--gpu-memory-utilization"}
VLLM_BACKENDS = {"FLASH_ATTN", "FLEX_ATTENTION", "TRITON_ATTN", "FLASH_ATTN_MLA", "TRITON_MLA"}
SGLANG_FLAGS = {"--model-path", "--port", "--attention-backend", "--cuda-graph-max-bs-decode",
                "--tp-size", "--mem-fraction-static", "--disable-radix-cache", "--enable-deterministic-inference"}
SGLANG_BACKENDS = {"fa3", "flashinfer", "triton"}


def read(name):
    with open(os.path.join(EXAMPLES, name), encoding="utf-8") as f:
        return f.read()


def launch(script, arm, tmp, **variables):
    """Run a launch script with stand-ins for `vllm` and `sglang.launch_server` that print
    the arguments and flag variables they were started with, instead of serving."""
    bin_dir = os.path.join(tmp, "bin")
    pkg = os.path.join(tmp, "py", "sglang")
    os.makedirs(bin_dir, exist_ok=True)
    os.makedirs(pkg, exist_ok=True)
    echo = ("import json, os, sys\nprint(json.dumps({'argv': sys.argv[1:], 'env': {k: os.environ.get(k) "
            "for k in ('VLLM_BATCH_INVARIANT', 'VLLM_SERVER_DEV_MODE', 'CUDA_VISIBLE_DEVICES')}}))\n")
    with open(os.path.join(bin_dir, "vllm"), "w") as f:
        f.write("#!%s\n%s" % (sys.executable, echo))
    os.chmod(os.path.join(bin_dir, "vllm"), 0o755)
    open(os.path.join(pkg, "__init__.py"), "w").close()
    with open(os.path.join(pkg, "launch_server.py"), "w") as f:
        f.write(echo)
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"], PYTHONPATH=os.path.join(tmp, "py"))
    env.pop("VLLM_BATCH_INVARIANT", None)
    for name in ("GPUS", "TP", "MEM", "CUDA_VISIBLE_DEVICES"):
        env.pop(name, None)
    env.update(variables)
    p = subprocess.run(["bash", os.path.join(EXAMPLES, script), arm], capture_output=True, text=True,
                       env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    return dict(json.loads(p.stdout), stderr=p.stderr)


def flags(argv):
    return {a for a in argv if a.startswith("-")}


def value(argv, flag):
    return argv[argv.index(flag) + 1]


class LaunchScripts(unittest.TestCase):
    def test_vllm_arms_differ_in_the_flag_only(self):
        with tempfile.TemporaryDirectory() as tmp:
            off, on = launch("vllm_serve.sh", "off", tmp), launch("vllm_serve.sh", "on", tmp)
        self.assertEqual(off["argv"][0], "serve")
        self.assertEqual(flags(off["argv"]), VLLM_FLAGS)
        self.assertEqual((off["env"]["VLLM_BATCH_INVARIANT"], on["env"]["VLLM_BATCH_INVARIANT"]), ("0", "1"))
        self.assertEqual(off["env"]["VLLM_SERVER_DEV_MODE"], "1")
        self.assertIn(value(off["argv"], "--attention-backend"), VLLM_BACKENDS)
        self.assertEqual((value(off["argv"], "--port"), value(on["argv"], "--port")), ("8000", "8001"))
        strip = lambda argv: [a for a in argv if a not in ("8000", "8001")]
        self.assertEqual(strip(off["argv"]), strip(on["argv"]))
        self.assertEqual(value(off["argv"], "--max-num-seqs"), "32")

    def test_the_context_length_is_passed_only_when_set(self):
        with tempfile.TemporaryDirectory() as tmp:
            default, chosen = launch("vllm_serve.sh", "off", tmp), launch("vllm_serve.sh", "off", tmp,
                                                                          MAX_MODEL_LEN="4096")
        self.assertNotIn("--max-model-len", default["argv"])
        self.assertEqual(value(chosen["argv"], "--max-model-len"), "4096")

    def test_the_radix_cache_is_off_unless_kept(self):
        with tempfile.TemporaryDirectory() as tmp:
            default, kept = launch("sglang_serve.sh", "on", tmp), launch("sglang_serve.sh", "on", tmp,
                                                                         RADIX_CACHE="keep")
        self.assertIn("--disable-radix-cache", default["argv"])
        self.assertNotIn("--disable-radix-cache", kept["argv"])

    def test_sglang_arms_differ_in_the_flag_only(self):
        with tempfile.TemporaryDirectory() as tmp:
            off, on = launch("sglang_serve.sh", "off", tmp), launch("sglang_serve.sh", "on", tmp)
        self.assertEqual(flags(off["argv"]), SGLANG_FLAGS - {"--enable-deterministic-inference"})
        self.assertEqual(flags(on["argv"]), SGLANG_FLAGS)
        self.assertEqual(value(off["argv"], "--cuda-graph-max-bs-decode"), "32")
        self.assertIn(value(off["argv"], "--attention-backend"), SGLANG_BACKENDS)
        self.assertEqual((value(off["argv"], "--port"), value(on["argv"], "--port")), ("30000", "30001"))
        strip = lambda argv: [a for a in argv if a not in ("30000", "30001", "--enable-deterministic-inference")]
        self.assertEqual(strip(off["argv"]), strip(on["argv"]))

    MEMORY_FLAG = {"vllm_serve.sh": "--gpu-memory-utilization", "sglang_serve.sh": "--mem-fraction-static"}

    def test_placement_of_the_two_arms(self):
        cases = [  # (variables, off devices, on devices, memory share or None for the engine's own)
            ({}, "0", "0", "0.45"),
            ({"GPUS": "0"}, "0", "0", "0.45"),
            ({"GPUS": "0,1", "TP": "1"}, "0", "1", None),
            ({"GPUS": "0,1,2,3", "TP": "2"}, "0,1", "2,3", None),
            ({"GPUS": "0,1", "TP": "2"}, "0,1", "0,1", "0.45"),
            ({"GPUS": "0", "MEM": "0.3"}, "0", "0", "0.3"),
            ({"GPUS": "0,1", "TP": "1", "MEM": "0.3"}, "0", "1", "0.3"),
        ]
        for script, flag in self.MEMORY_FLAG.items():
            for variables, off_devices, on_devices, share in cases:
                with self.subTest(script=script, **variables), tempfile.TemporaryDirectory() as tmp:
                    off, on = launch(script, "off", tmp, **variables), launch(script, "on", tmp, **variables)
                    self.assertEqual((off["env"]["CUDA_VISIBLE_DEVICES"], on["env"]["CUDA_VISIBLE_DEVICES"]),
                                     (off_devices, on_devices))
                    for arm in (off, on):
                        self.assertEqual(value(arm["argv"], flag) if flag in arm["argv"] else None, share)
                        if off_devices == on_devices:
                            self.assertIn("share GPUs", arm["stderr"])
                            self.assertIn("noisier", arm["stderr"])
                        else:
                            self.assertNotIn("share GPUs", arm["stderr"])

    def test_fewer_devices_than_tp_is_refused(self):
        p = subprocess.run(["bash", os.path.join(EXAMPLES, "vllm_serve.sh"), "off"], capture_output=True, text=True,
                           env=dict(os.environ, GPUS="0", TP="2"))
        self.assertEqual(p.returncode, 3)
        self.assertIn("fewer than TP=2", p.stderr)

    def test_an_unknown_arm_is_refused(self):
        p = subprocess.run(["bash", os.path.join(EXAMPLES, "vllm_serve.sh"), "maybe"], capture_output=True, text=True)
        self.assertEqual(p.returncode, 2)
        self.assertIn("usage", p.stderr)

    def test_cost_cells_script_runs_both_workloads_with_the_lab(self):
        script = read("cost_cells.sh")
        self.assertIn("for WORKLOAD in cold shared-prefix", script)
        self.assertIn("--mode cost", script)
        known = set(re.findall(r"--[a-z][a-z-]*", run.build_parser().format_help()))
        used = set(re.findall(r"(--[a-z][a-z-]*)", script[script.index("\nfor "):]))
        self.assertTrue(used <= known, used - known)

    def test_scripts_are_valid_bash(self):
        for name in sorted(os.listdir(EXAMPLES)):
            if name.endswith(".sh"):
                p = subprocess.run(["bash", "-n", os.path.join(EXAMPLES, name)], capture_output=True, text=True)
                self.assertEqual(p.returncode, 0, (name, p.stderr))


class Samples(unittest.TestCase):
    def load(self, name):
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
        cells = [run.CellLabels.from_record(c) for c in doc["cells"]]
        table = "\n".join(run.cost_table_lines(cells, cells[0]))
        self.assertNotIn("missing", table)
        self.assertNotIn("One cell alone", table)

    # The flag-on stubs' known slowdowns, as examples/make_samples.sh sets them.
    KNOWN_PCT = {(1, "cold"): 3.0, (1, "shared-prefix"): 22.0, (2, "cold"): 18.0, (2, "shared-prefix"): 35.0}

    def test_each_cost_sample_interval_contains_its_known_slowdown(self):
        script = read("make_samples.sh")
        for (tp, workload), pct in self.KNOWN_PCT.items():
            self.assertIn('"%d %s %.2f"' % (tp, workload, 1 + pct / 100), script)
        for cell in self.load("sample_cost.json")["cells"]:
            with self.subTest(tp=cell["tp"], workload=cell["workload"]):
                lo, hi = cell["ci95_pct"]
                self.assertTrue(lo <= self.KNOWN_PCT[(cell["tp"], cell["workload"])] <= hi, (lo, hi))


class Compare(unittest.TestCase):
    def compare(self, *names):
        return subprocess.run([sys.executable, os.path.join(EXAMPLES, "compare.py")]
                              + [os.path.join(EXAMPLES, n) for n in names], capture_output=True, text=True,
                              timeout=60)

    def test_two_sweeps_side_by_side_with_what_changed(self):
        p = self.compare("sample_sweep_off.json", "sample_sweep_on.json")
        self.assertEqual(p.returncode, 0, p.stderr)
        lines = {line.split()[0]: line.split()[1:] for line in p.stdout.splitlines() if line.startswith("  ")}
        off, on = self.load("sample_sweep_off.json"), self.load("sample_sweep_on.json")
        self.assertEqual(lines["flag"], ["False", "True", "changed"])
        want = on["summary"]["unique_completions"] - off["summary"]["unique_completions"]
        self.assertEqual(lines["unique_completions"][-1], "%+d" % want)
        self.assertEqual(lines["verdict"], ["tokens", "diverged", "invariant", "changed"])

    def test_two_cost_files_cell_by_cell(self):
        p = self.compare("sample_cost.json", os.path.join("real", "cost_4cells.json"))
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("TP=2, shared-prefix", p.stdout)
        self.assertIn("old only", p.stdout)
        self.assertIn("new only", p.stdout)

    def test_two_of_different_kinds_are_refused(self):
        p = self.compare("sample_cost.json", "sample_sweep_on.json")
        self.assertEqual(p.returncode, 2)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)

    def load(self, name):
        return json.loads(read(name))


class ExperimentReport(unittest.TestCase):
    def test_the_report_keeps_a_burst_and_a_poisson_cell_of_one_shape_apart(self):
        # A folder reused by a run with --request-rate and one without holds both cells: the
        # report's table must show each under its own arrivals, as run.py's cell key does.
        sys.path.insert(0, EXAMPLES)
        import experiment
        cell = json.loads(read(os.path.join("..", "tests", "fixtures", "saved", "cost-load.json")))
        cell = cell["cells"][0]
        poisson = dict(cell, arrivals="poisson at 100/s", overhead_pct=55.5)
        burst = dict(cell, arrivals="burst", overhead_pct=-4.4)
        table = experiment.cost_table([poisson, burst], [1])
        # each table headed by run.py's identity of its cells, in run.py's words
        headings = [line for line in table if line.endswith(":")]
        self.assertEqual(headings, ["%s:" % run.cell_key(c).table_group().text()
                                    for c in (poisson, burst)])
        self.assertIn("poisson at 100/s", headings[0])
        self.assertNotIn("poisson", headings[1])
        poisson_table, burst_table = "\n".join(table).split(headings[1])
        self.assertIn("+55.5 %", poisson_table)
        self.assertIn("-4.4 %", burst_table)

    def test_cells_the_identity_tells_apart_get_tables_of_their_own(self):
        """Two cells that differ in a setting run.py's cell identity holds (the release, as
        the arms reported it) are two tables, whatever the experiment's own idea of a shape."""
        sys.path.insert(0, EXAMPLES)
        import experiment
        cell = json.loads(read(os.path.join("..", "tests", "fixtures", "saved", "cost.json")))
        cell = cell["cells"][0]
        newer = json.loads(json.dumps(cell))
        for arm in ("off", "on"):
            newer["servers"][arm]["version"] = "0.33.0"
        table = experiment.cost_table([cell, newer], [1])
        headings = [line for line in table if line.endswith(":")]
        self.assertEqual(len(headings), 2, table)
        self.assertEqual(headings[1], "%s:" % run.cell_key(newer).table_group().text())

    def test_no_cell_is_said_in_words_not_an_empty_heading(self):
        sys.path.insert(0, EXAMPLES)
        import experiment
        table = experiment.cost_table([], [1])
        self.assertFalse([line for line in table if line.endswith(":")], table)
        self.assertIn("No cost cell was measured in this run", "\n".join(table))


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

    def test_cost_cells_of_several_files_are_merged_later_files_winning(self):
        sys.path.insert(0, EXAMPLES)
        import plot_cost
        cells = json.loads(read("sample_cost.json"))["cells"]
        tp1 = [c for c in cells if c["tp"] == 1]
        tp2 = [c for c in cells if c["tp"] == 2]
        newer = dict(tp1[0], overhead_pct=99.0)  # the same measurement, run again
        with tempfile.TemporaryDirectory() as tmp:
            paths = [os.path.join(tmp, n) for n in ("a.json", "b.json", "cell.json")]
            for path, doc in zip(paths, ({"schema": run.COST_SCHEMA, "cells": tp1},
                                         {"schema": run.COST_SCHEMA, "cells": tp2}, newer)):
                with open(path, "w") as f:
                    json.dump(doc, f)
            said = []
            doc = plot_cost.load(paths, said.append)
        self.assertEqual(sorted((c["tp"], c["workload"]) for c in doc["cells"]),
                         [(1, "cold"), (1, "shared-prefix"), (2, "cold"), (2, "shared-prefix")])
        self.assertIn(99.0, [c["overhead_pct"] for c in doc["cells"]])
        self.assertEqual(len(said), 1)
        self.assertIn("the cell of %s replaces the one of %s (vllm 0.26.0, model stub/tiny-f32, TP=1, %s"
                      % (paths[2], paths[0], newer["workload"]), said[0])

    @unittest.skipUnless(HAVE_MATPLOTLIB, "matplotlib is not installed")
    def test_both_plots_read_what_json_prints(self):
        from support import StubConfig, StubServer, run_lab
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on, \
                tempfile.TemporaryDirectory() as tmp:
            sweep = run_lab("--mode", "sweep", "--url", off.url, "--sizes", "1,2,9", "--max-tokens", 8, "--json")
            cells = [run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 2,
                             "--trials", 2, "--warmup", 0, "--max-tokens", 4, "--workload", w, "--json")
                     for w in ("cold", "shared-prefix")]
            files = []
            for name, r in [("sweep.json", sweep), ("cold.json", cells[0]), ("shared.json", cells[1])]:
                files.append(os.path.join(tmp, name))
                with open(files[-1], "w") as f:
                    f.write(r.stdout)
            for script, inputs in (("plot_sweep.py", files[:1]), ("plot_cost.py", files[1:])):
                with self.subTest(script=script):
                    out = os.path.join(tmp, script + ".png")
                    p = self.plot(script, *inputs, "-o", out)
                    self.assertEqual(p.returncode, 0, p.stderr)
                    with open(out, "rb") as f:
                        self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

    def test_a_file_missing_what_the_picture_reads_is_refused_naming_it(self):
        """A sweep file without its prompts or with a null summary, a cost cell whose interval
        holds one value: one line naming what is wrong with the file, exit 2 (the checks need
        no matplotlib: they read the file before anything is drawn)."""
        sys.path.insert(0, EXAMPLES)
        import plot_cost
        import plot_sweep
        with tempfile.TemporaryDirectory() as tmp:
            sweep = json.loads(read("sample_sweep_on.json"))
            cost = json.loads(read("sample_cost.json"))
            cost["cells"][0]["ci95_pct"] = [1.5]
            cases = [(plot_sweep.load, dict(sweep, prompts=None), "it holds no prompts"),
                     (plot_sweep.load, {k: v for k, v in sweep.items() if k != "prompts"},
                      "it holds no prompts"),
                     (plot_sweep.load, dict(sweep, summary=None), "its summary is null"),
                     (lambda path: plot_cost.load([path]), cost,
                      "cell 1 (cold, TP 1): its ci95_pct is a list of 1 value, not an "
                      "interval [low, high] or null")]
            for i, (load, doc, words) in enumerate(cases):
                path = os.path.join(tmp, "%d.json" % i)
                with open(path, "w") as f:
                    json.dump(doc, f)
                with self.subTest(words=words):
                    with self.assertRaises(ValueError) as caught:
                        load(path)
                    self.assertIn("%s: %s" % (path, words), str(caught.exception))
                    script = "plot_cost.py" if "ci95" in words else "plot_sweep.py"
                    p = self.plot(script, path, "-o", os.path.join(tmp, "x.png"))
                    self.assertEqual(p.returncode, 2, p.stderr)
                    self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
                    if HAVE_MATPLOTLIB:
                        self.assertIn(words, p.stderr)

    def test_json_that_is_not_the_labs_is_refused_with_one_line(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "list.json")
            with open(path, "w") as f:
                f.write("[1, 2]")
            for script in ("plot_sweep.py", "plot_cost.py"):
                with self.subTest(script=script):
                    p = self.plot(script, path, "-o", os.path.join(tmp, "x.png"))
                    if not HAVE_MATPLOTLIB:
                        self.assertEqual(p.returncode, 2)
                        continue
                    self.assertEqual(p.returncode, 2, p.stderr)
                    self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
                    self.assertIn("is not a lab file", p.stderr)

    @unittest.skipUnless(HAVE_MATPLOTLIB, "matplotlib is not installed")
    def test_plots_from_the_real_runs_in_the_older_schemas(self):
        real = os.path.join(EXAMPLES, "real")
        with tempfile.TemporaryDirectory() as tmp:
            for script, files in (("plot_sweep.py", ["sweep_tp2_flag_off.json", "sweep_tp2_flag_on.json"]),
                                  ("plot_cost.py", ["cost_4cells.json"])):
                with self.subTest(script=script):
                    out = os.path.join(tmp, script + ".png")
                    p = self.plot(script, *[os.path.join(real, f) for f in files], "-o", out)
                    self.assertEqual(p.returncode, 0, p.stderr)
                    with open(out, "rb") as f:
                        self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

    @unittest.skipUnless(HAVE_MATPLOTLIB, "matplotlib is not installed")
    def test_no_label_overlaps_the_title_the_legend_or_another_label_for_any_sign(self):
        sys.path.insert(0, EXAMPLES)
        import plot_cost
        import plot_sweep
        base = json.loads(read("sample_cost.json"))
        for signs in ((1, 1, 1, 1), (-1, -1, -1, -1), (-1, 1, -1, 1), (1, -1, 1, -1)):
            with self.subTest(signs=signs):
                doc = json.loads(json.dumps(base))
                for cell, sign in zip(doc["cells"], signs):
                    value = sign * abs(cell["overhead_pct"]) * 3
                    cell["overhead_pct"], cell["ci95_pct"] = value, [value - 9.0, value + 9.0]
                    cell["significant"] = sign > 0
                fig = plot_cost.figure(doc)
                fig.canvas.draw()
                ax = fig.axes[0]
                boxes = [t.get_window_extent() for t in ax.texts if t.get_text() != "missing"]
                boxes += [ax.title.get_window_extent(), ax.get_legend().get_window_extent()]
                self.assert_apart(boxes)
                import matplotlib.pyplot as plt
                plt.close(fig)
        docs = [json.loads(read("sample_sweep_off.json")), json.loads(read("sample_sweep_on.json"))]
        fig = plot_sweep.figure(docs, ["/some/long/folder/off.json", "/another/folder/on.json"])
        fig.canvas.draw()
        legend = fig.legends[0]
        self.assertEqual([t.get_text().rsplit(" ", 1)[-1] for t in legend.get_texts()], ["(off.json)", "(on.json)"])
        self.assert_apart([fig._suptitle.get_window_extent(), legend.get_window_extent()] +
                          [ax.get_window_extent() for ax in fig.axes])

    def assert_apart(self, boxes):
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                self.assertFalse(a.overlaps(b), (a, b))

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


class ExamplesRefuseFilesTheyDidNotWrite(TempDirTest):
    def test_compare_and_the_plots_refuse_files_they_did_not_write_in_one_line(self):
        odd = self.path("odd.json")
        with open(odd, "w") as f:
            json.dump({"schema": run.SWEEP_SCHEMA, "prompts": [{"sizes": "x"}], "summary": 3}, f)
        p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "compare.py"), odd, odd],
                           capture_output=True, text=True)
        self.assertEqual(p.returncode, 2, p)
        self.assertNotIn("Traceback", p.stderr)


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

    def experiment_here(self):
        """An Experiment of this folder, as main() makes one (no arm started)."""
        settings = experiment.read_settings(["vllm", self.path("out")], {"COPIES": "off"})
        os.makedirs(self.path("run"))
        return experiment.Experiment(settings, {}, self.path("run"))

    def test_a_step_that_had_ended_when_the_stop_came_was_not_stopped(self):
        """TERM as the flag-off sweep exits: its process has ended (exit 0) before the
        experiment could stop it. It is not among the steps the signal stopped, and its own
        exit is the one said."""
        exp = self.experiment_here()
        step = experiment.Step("flag-off sweep, concurrent requests", 1)
        job = experiment.Job(step, [sys.executable, "-c", "pass"], self.path("run/s.txt"))
        with contextlib.redirect_stderr(io.StringIO()):
            exp.begin_job(job)
        job.process.wait()  # it ended by itself; finish_job had not seen it yet
        exp.stopped()
        self.assertEqual(exp.stopped_steps, [step])
        exp.stop_steps(signal.SIGTERM)
        exp.stopped_by, exp.exit_code = "SIGTERM", 143
        self.assertEqual(exp.stopped_steps, [])
        self.assertEqual((step.exit_code, step.note), (0, experiment.exit_meaning(0)))
        first = experiment.status_line(exp)
        self.assertIn("INCOMPLETE (exit 143", first)
        self.assertNotIn("the step it stopped", first)
        self.assertNotIn("flag-off sweep", first.split("no step was running")[0])

    def test_an_expect_that_failed_in_a_step_that_ran_to_its_end_is_not_as_expected(self):
        """Every step ran to its end, and the flag-on sweep's own --expect caught a move (exit
        1, its saved result complete, its saved expect not held): a negative result, NOT AS
        EXPECTED, as when only the saved verdicts catch it; never INCOMPLETE. The same
        --expect failing where nothing moved (its run-to-run control compared nothing) is
        INCONCLUSIVE; a step that did not end its run is INCOMPLETE."""
        exp = self.experiment_here()
        os.makedirs(self.path("run/tp1"))
        path = self.path("run/tp1/sweep_on.json")
        step = experiment.Step("flag-on sweep, concurrent requests", 1, exit_code=1,
                               note=experiment.exit_meaning(1), outputs=[path],
                               reason="expectation failed: --expect invariant, but ...")
        exp.steps, exp.exit_code = [step], 1
        for verdict, unique, ulp, state, word, code in (
                ("logprobs moved but tokens held", 1, 2, "complete", "NOT AS EXPECTED", 1),
                # the only --expect that failed, failed on what could not be compared
                ("invariant", 1, 0, "complete", "INCONCLUSIVE", 6),
                ("logprobs moved but tokens held", 1, 2, "terminated", "INCOMPLETE", 1)):
            with self.subTest(verdict=verdict, state=state):
                with open(path, "w") as f:
                    json.dump({"summary": {
                        "verdict": verdict, "unique_completions": unique, "max_ulp": ulp,
                        "state": state, "expect": {"asked": "invariant", "held": False,
                                                   "said": "expectation failed: ..."}}}, f)
                exp.judged, exp.uncompared, exp.unsaved, exp.exit_code = [], [], [], 1
                experiment.judge(exp)
                first = experiment.status_line(exp)
                self.assertEqual(exp.exit_code, code)
                self.assertIn(": %s (exit %d, %s): " % (word, code, experiment.exit_meaning(
                    code)), first)
                self.assertEqual(first.count("flag-on sweep, concurrent requests (TP 1)"), 1,
                                 first)

    def test_inconclusive_names_the_flag_on_sweep_first(self):
        """Both concurrent sweeps' --expect failed on what they could not compare (the cache
        served every request above batch 1): INCONCLUSIVE says "a flag-on result compared
        nothing", so the flag-on sweep is named first, the flag-off one after it."""
        exp = self.experiment_here()
        os.makedirs(self.path("run/tp1"))
        for key, asked in (("off", "variant"), ("on", "invariant")):
            path = self.path("run/tp1/sweep_%s.json" % key)
            with open(path, "w") as f:
                json.dump({"summary": {
                    "verdict": run.NOTHING_COMPARED, "unique_completions": 1, "max_ulp": 0,
                    "state": "complete", "expect": {"asked": asked, "held": False,
                                                    "said": "expectation failed: ..."}}}, f)
            step = experiment.Step(
                "flag-%s sweep, concurrent requests" % key, 1, exit_code=1,
                note=experiment.exit_meaning(1), outputs=[path],
                reason="expectation failed: --expect %s, but the result is: nothing "
                "compared" % asked)
            step.arm = key  # the arm it measures, as the experiment's own steps say
            exp.steps.append(step)
        exp.exit_code = 1
        experiment.judge(exp)
        first = experiment.status_line(exp)
        self.assertEqual(exp.exit_code, 6, first)
        named = first.split("compared nothing): ", 1)[1]
        self.assertTrue(named.startswith("compared nothing: flag-on sweep, concurrent "
                                         "requests (TP 1)"), first)
        self.assertIn("; compared nothing: flag-off sweep, concurrent requests (TP 1)", named)

    def test_the_steps_table_lists_only_the_outputs_that_exist(self):
        exp = self.experiment_here()
        cost = self.path("run/cost.json")
        step = experiment.Step("cost, cold", 1, outputs=[cost])
        self.assertEqual(experiment.saved_outputs(exp, step), "none saved")
        with open(cost, "w") as f:
            f.write("{}")
        self.assertEqual(experiment.saved_outputs(exp, step), "`cost.json`")

    def test_a_stop_signal_while_the_report_prints_waits_for_the_print(self):
        """TERM once REPORT.md is written, while the report is printed: the print goes on to
        its end, the exit code is the report's, and a line says the signal came late; a
        second one cuts the print at once with the signal's code."""
        previous = {s: signal.getsignal(s) for s in experiment.SIGNAL_EXITS}
        for signals, code in (([signal.SIGTERM], 6), ([signal.SIGTERM, signal.SIGTERM], 143)):
            with self.subTest(signals=len(signals)):
                printed = []

                def print_report(text):
                    for signum in signals:  # the signal comes mid-print
                        os.kill(os.getpid(), signum)
                    printed.append(text)

                said = io.StringIO()
                with mock.patch.object(experiment, "print_report", print_report), \
                        contextlib.redirect_stderr(said):
                    found = experiment.show_report("# report\n", 6, previous)
                self.assertEqual(found, code)
                self.assertEqual(printed, ["# report\n"] if len(signals) == 1 else [])
                self.assertIn("SIGTERM", said.getvalue())
                self.assertEqual({s: signal.getsignal(s) for s in previous}, previous)


class TheReportSaysWhichUpstreamTestsTheRunCovered(TempDirTest):
    """REPORT.md's table of the engines' own determinism tests: each test of the engine the
    run measured named with its file and line, and its shape marked covered only where a
    sweep the run saved says it ran that shape (its saved sizes, traffic, temperature and
    checks), whatever the run was asked."""

    LADDER = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 23, 24, 25, 31, 32]
    VLLM_TEST = re.compile(r"`tests/v1/determinism/test_[a-z_]+\.py:\d+`")
    SGLANG_TEST = re.compile(r"`python/sglang/test/test_deterministic(_utils)?\.py:\d+`")

    def report_of(self, engine, sweeps, folder):
        """The report of a run of ENGINE into FOLDER that saved SWEEPS ({file stem: (params,
        summary)}) at TP 1, no arm started."""
        settings = experiment.read_settings([engine, self.path("out")], {"COPIES": "off"})
        os.makedirs(self.path(folder + "/tp1"))
        exp = experiment.Experiment(settings, {}, self.path(folder))
        for stem, (params, summary) in sweeps.items():
            with open(self.path("%s/tp1/%s.json" % (folder, stem)), "w", encoding="utf-8") as f:
                json.dump({"schema": run.SWEEP_SCHEMA, "engine": engine, "params": params,
                           "summary": dict({"state": "complete"}, **summary)}, f)
        return experiment.report(exp)

    def rows(self, report):
        """The table's rows, by their first cell (the shape and the test's name)."""
        head = "## Upstream's own determinism tests, and this run"
        self.assertIn(head, report)
        section = report.split(head, 1)[1].split("\n## ", 1)[0]
        lines = [line for line in section.splitlines() if line.startswith("| ")][1:]
        self.assertTrue(lines, section)
        return {cells[0]: cells[1:] for cells in (
            [cell.strip() for cell in line.strip("|").split(" | ")] for line in lines)}

    def row(self, rows, shape):
        found = [cells for first, cells in rows.items() if first.startswith(shape + ":")]
        self.assertEqual(len(found), 1, (shape, list(rows)))
        return found[0]

    def vllm_sweeps(self, temperature):
        on = {"sizes": self.LADDER, "traffic": "concurrent", "temperature": temperature,
              "logprobs": 5, "prefill_check": True}
        off = dict(on, temperature=0.0)
        return {"sweep_on": (on, {"verdict": run.INVARIANT, "max_ulp": 0,
                                  "checks_outcome": {"prefill": run.CHECK_HELD}}),
                "sweep_off": (off, {"verdict": run.TOKENS_DIVERGED, "max_ulp": 9})}

    def test_vllm_tests_each_named_and_marked_from_the_saved_sweeps(self):
        for temperature in (0.6, 0.0):
            with self.subTest(temperature=temperature):
                rows = self.rows(self.report_of("vllm", self.vllm_sweeps(temperature),
                                                "run-%g" % temperature))
                self.assertEqual(len(rows), 7, list(rows))
                for first, (where, compares, this_run) in rows.items():
                    self.assertTrue(first.startswith("vLLM "), first)
                    self.assertRegex(where, self.VLLM_TEST)
                    self.assertIn("vLLM 0.34.0", where)
                offline = self.row(rows, "vLLM offline, batch 1 against N")
                self.assertIn("test_batch_invariance.py:173", offline[0])
                if temperature:  # batch 1 to 32, seeded sampling, as upstream's
                    self.assertEqual(offline[2], "yes: `tp1/sweep_on.json`")
                else:  # the same sweep, greedy: not upstream's shape
                    self.assertTrue(offline[2].startswith("no: "), offline)
                    self.assertIn("greedy, not seeded sampling", offline[2])
                prefill = self.row(rows, "vLLM offline, decode against prefill")
                self.assertEqual(prefill[2], "yes: `tp1/sweep_on.json`")
                online = self.row(rows, "vLLM online, batch 1 against N")
                self.assertIn("test_online_batch_invariance.py:138", online[0])
                self.assertTrue(online[2].startswith("no: "), online)
                self.assertIn("concurrent traffic, not copies", online[2])
                # the flag-off sweep was greedy; upstream's should-fail test samples
                off = self.row(rows, "vLLM offline, flag off must differ")
                self.assertIn("`tp1/sweep_off.json`", off[2])
                self.assertTrue(off[2].startswith("no: "), off)

    def test_sglang_tests_each_named_and_marked_from_the_saved_sweeps(self):
        copies = {"sizes": list(range(1, 21)), "traffic": "copies", "temperature": 0.0,
                  "logprobs": 5, "prefill_check": False}
        report = self.report_of("sglang", {"copies_on": (copies, {"verdict": run.INVARIANT,
                                                                  "max_ulp": 0})}, "run")
        rows = self.rows(report)
        self.assertEqual(len(rows), 4, list(rows))
        for first, (where, compares, this_run) in rows.items():
            self.assertTrue(first.startswith("SGLang "), first)
            self.assertRegex(where, self.SGLANG_TEST)
            self.assertIn("SGLang 0.5.23", where)
        self.assertEqual(self.row(rows, "SGLang single")[2], "yes: `tp1/copies_on.json`")
        p_vs_d = self.row(rows, "SGLang p_vs_d")
        self.assertEqual(p_vs_d[2], "no: closest `tp1/copies_on.json`: no --prefill-check")
        # a copies sweep that compared nothing covers no shape
        rows = self.rows(self.report_of("sglang", {"copies_on": (
            copies, {"verdict": run.NOTHING_COMPARED, "max_ulp": 0})}, "uncompared"))
        self.assertIn("compared nothing", self.row(rows, "SGLang single")[2])

    def test_a_check_whose_outcome_was_not_saved_is_not_known_never_not_covered(self):
        on, summary = self.vllm_sweeps(0.0)["sweep_on"]
        del summary["checks_outcome"]  # a sweep saved by a lab that saved no outcomes
        rows = self.rows(self.report_of("vllm", {"sweep_on": (on, summary)}, "older"))
        self.assertEqual(self.row(rows, "vLLM offline, decode against prefill")[2],
                         "not known: `tp1/sweep_on.json` did not save its prefill check's "
                         "outcome")


if __name__ == "__main__":
    unittest.main()


class ExampleToolsReadWhatTheLabSaves(unittest.TestCase):
    """compare.py and the plots' data readers (no drawing: with or without matplotlib) read
    the fields the lab saves today."""

    @classmethod
    def setUpClass(cls):
        sys.path.insert(0, EXAMPLES)
        import compare
        import plot_cost
        import plot_sweep
        cls.compare, cls.plot_cost, cls.plot_sweep = compare, plot_cost, plot_sweep
        with open(os.path.join(ROOT, "tests", "fixtures", "saved", "cost.json"),
                  encoding="utf-8") as f:
            cls.cell = json.load(f)["cells"][0]

    def variant(self, **change):
        cell = json.loads(json.dumps(self.cell))
        cell.update(change)
        return cell

    def compared(self, kind, a, b):
        import io
        out = io.StringIO()
        (self.compare.compare_sweeps if kind == "sweep" else self.compare.compare_costs)(a, b, out)
        return out.getvalue().splitlines()

    def sweep(self, summary=None, hazards=None, sizes=()):
        return {"schema": run.SWEEP_SCHEMA, "server": {"hazards": hazards}, "params": {},
                "summary": summary or {}, "prompts": [{"sizes": list(sizes)}]}

    def row(self, lines, name):
        return next(line for line in lines if line.strip().startswith(name + "  "))

    def test_compare_names_each_hazard_by_its_setting(self):
        hazard = {"setting": "attention backend", "why": "x", "refs": "y", "versions": "z"}
        lines = self.compared("sweep", self.sweep(hazards=[hazard]), self.sweep(hazards=[]))
        self.assertRegex(self.row(lines, "known hazards"),
                         r"known hazards\s+attention backend\s+none\s+changed")

    def test_compare_shows_the_neighbour_and_observer_checks_and_the_drift_in_nats(self):
        summary = {"max_nats": 0.031, "neighbours_verdict": "moved beside a neighbour",
                   "neighbours_lengths": [{"length": 64, "runs": 4, "equal": 0,
                                           "max_nats": 0.031}],
                   "observer_verdict": "the same text with and without logprobs",
                   "observer_settings": [{"logprobs": 20, "runs": 3, "equal": 3}]}
        lines = self.compared("sweep", self.sweep(summary), self.sweep({"max_nats": 0.0}))
        self.assertRegex(self.row(lines, "max_nats"), r"max_nats\s+0\.031\s+0\s+")
        self.assertIn("moved beside a neighbour", self.row(lines, "neighbours_verdict"))
        self.assertIn("the same text with", self.row(lines, "observer_verdict"))
        self.assertRegex(self.row(lines, "neighbours of 64 tokens equal"), r"0 of 4\s+-\s+old only")
        self.assertRegex(self.row(lines, "observer, logprobs 20 equal"), r"3 of 3\s+-")

    def test_compare_shows_the_requests_the_cache_served_at_each_size(self):
        size = {"batch_size": 4, "max_ulp": 2, "runs": [{"served": 4}, {"served": 3}]}
        cold = dict(size, runs=[{}])
        lines = self.compared("sweep", self.sweep(sizes=[size]), self.sweep(sizes=[cold]))
        self.assertRegex(self.row(lines, "batch 4 served"), r"batch 4 served\s+7\s+-")

    def test_compare_matches_a_cell_across_an_engine_upgrade(self):
        newer = self.variant(overhead_pct=12.5)
        for arm in ("off", "on"):
            newer["servers"][arm]["version"] = "0.33.0"
            newer["servers"][arm]["settings"]["engine version"] = "0.33.0"
            newer["servers"][arm]["settings"]["compilation mode"] = 0
        lines = self.compared("cost", {"cells": [self.cell]}, {"cells": [newer]})
        overheads = [line for line in lines if "overhead %" in line]
        self.assertEqual(len(overheads), 1, lines)
        self.assertNotIn("only", overheads[0])
        release = next(line for line in lines if " release " in line)
        self.assertRegex(release, r"0\.26\.0\s+0\.33\.0\s+changed")
        self.assertTrue(any("setting compilation mode" in line for line in lines), lines)

    def test_plot_sweep_reads_the_verdict_and_the_cache_served_sizes(self):
        sizes = [{"batch_size": 1, "max_ulp": 0, "first_token_divergence": None, "runs": [{}]},
                 {"batch_size": 4, "max_ulp": 9, "first_token_divergence": 3,
                  "runs": [{"served": 4}]}]
        doc = self.sweep({"verdict": run.CACHE_CONFOUNDED, "served_sizes": [4]}, sizes=sizes)
        doc.update(engine="vllm", model="m")
        self.assertEqual(self.plot_sweep.per_size(doc), [(1, 0, None, 0), (4, 9, 3, 4)])
        self.assertIn(run.CACHE_CONFOUNDED + "; the cache served requests at 4",
                      self.plot_sweep.label(doc, "/x/off.json"))

    def test_plot_sweep_names_a_check_that_moved_beside_sizes_that_held(self):
        # examples/real/neighbours-1xH200-vllm-0.33.0/neighbours_off.json: sizes held, the
        # neighbour check moved (flag off)
        doc = self.sweep({"verdict": run.INVARIANT,
                          "neighbours_verdict": "moved beside neighbours of 64 tokens"})
        doc.update(engine="vllm", model="m")
        self.assertIn(run.INVARIANT + "; neighbours check: moved beside neighbours of 64 tokens",
                      self.plot_sweep.label(doc, "/x/off.json"))

    def test_plot_cost_draws_a_burst_and_a_poisson_cell_apart_naming_the_rate(self):
        load = dict(batch=None, concurrency=4, requests=8)
        burst = self.variant(arrivals="burst", **load)
        poisson = self.variant(arrivals=run.Arrivals(100.0).describe(), **load)
        doc = self.plot_cost.load([self.write(burst), self.write(poisson)], say=lambda line: None)
        headings = [heading for heading, _, _ in self.plot_cost.tables(doc)]
        self.assertEqual(len(headings), 2, headings)
        self.assertIn("concurrency 4, 8 requests a trial, poisson at 100/s", headings[0])
        self.assertIn("concurrency 4, 8 requests a trial, burst", headings[1])

    def test_plot_cost_marks_a_flag_on_arm_measured_faster(self):
        faster = self.variant(overhead_pct=-7.3, ci95_pct=[-15.8, -5.6], significant=True)
        doc = self.plot_cost.load([self.write(faster)], say=lambda line: None)
        (_, _, slots), = self.plot_cost.tables(doc)
        bar = slots[1, "cold"]
        self.assertEqual(bar["value"], -7.3)
        self.assertTrue(bar["faster"][0].startswith("the flag-on arm measured faster"))
        slower = self.plot_cost.load([self.write(self.cell)], say=lambda line: None)
        self.assertEqual(self.plot_cost.tables(slower)[0][2][1, "cold"]["faster"], [])

    def test_plot_cost_draws_an_earlier_labs_cell_in_the_panel_of_todays(self):
        earlier = self.variant(overhead_pct=11.0)
        for arm in ("off", "on"):  # saved before the lab read these two settings
            for name in ("compilation mode", "breakable CUDA graph"):
                del earlier["servers"][arm]["settings"][name]
        today = self.variant(workload="shared-prefix", prefix_tokens=1000, overhead_pct=22.0)
        doc = self.plot_cost.load([self.write(earlier), self.write(today)], say=lambda line: None)
        (heading, _, slots), = self.plot_cost.tables(doc)
        self.assertEqual((slots[1, "cold"]["value"], slots[1, "shared-prefix"]["value"]),
                         (11.0, 22.0))
        self.assertNotIn("compilation mode", heading)

    def test_plot_cost_keeps_two_values_of_a_setting_an_earlier_labs_cell_lacks(self):
        earlier = self.variant(overhead_pct=11.0)
        for arm in ("off", "on"):
            del earlier["servers"][arm]["settings"]["compilation mode"]
        eager = self.variant(overhead_pct=22.0)
        for arm in ("off", "on"):
            eager["servers"][arm]["settings"]["compilation mode"] = 0
        said = []
        doc = self.plot_cost.load([self.write(c) for c in (earlier, eager, self.cell)],
                                  say=said.append)
        self.assertEqual(sorted(c["overhead_pct"] for c in doc["cells"]),
                         sorted([22.0, self.cell["overhead_pct"]]))
        self.assertEqual(len(said), 1, said)

    def write(self, cell):
        tmp = tempfile.mkdtemp()
        self.addCleanup(lambda: __import__("shutil").rmtree(tmp))
        path = os.path.join(tmp, "cell.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(cell, f)
        return path
