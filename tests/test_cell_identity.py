"""A cost cell is identified by everything it was measured under (run.CellIdentity), in
run.py, compare.py and plot_cost.py alike: two cells that differ in any of it are kept side
by side, a cell that replaces another says so, and the TP degree asked is the one the cell
is labelled with."""

import copy
import io
import json
import os
import sys
import unittest

from support import HERE, StubConfig, StubServer, TempDirTest, run, run_lab

EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")
sys.path.insert(0, EXAMPLES)
import compare  # noqa: E402  (examples/compare.py)


def saved_cell():
    with open(os.path.join(HERE, "fixtures", "saved", "cost.json"), encoding="utf-8") as f:
        return json.load(f)["cells"][0]


def variant(cell, change):
    other = copy.deepcopy(cell)
    change(other)
    return other


def set_release(version):
    def change(cell):
        for arm in ("off", "on"):
            cell["servers"][arm]["version"] = version
    return change


def load_cell(rate, requests=8):
    def change(cell):
        cell.update(batch=None, concurrency=4, requests=requests,
                    arrivals=run.Arrivals(rate).describe() if rate else "burst")
    return change


# Each way two cells are two measurements, as one change to a saved cell
APART = {
    "engine": lambda c: c.update(engine="sglang"),
    "release": set_release("0.33.0"),
    "model": lambda c: c.update(model="other/model"),
    "tp": lambda c: c.update(tp=2),
    "workload": lambda c: c.update(workload="shared-prefix", prefix_tokens=1000),
    "max tokens": lambda c: c.update(max_tokens=c["max_tokens"] + 1),
    "batch": lambda c: c.update(batch=c["batch"] + 1),
    "mismatch": lambda c: c.update(differences=[{"setting": "dtype", "off": "a", "on": "b"}]),
}


class CellsKeptApart(unittest.TestCase):
    def test_each_label_keeps_two_cells_apart(self):
        base = saved_cell()
        for name, change in APART.items():
            with self.subTest(label=name):
                doc = run.add_cell({"schema": run.COST_SCHEMA, "cells": [base]},
                                   variant(base, change))
                self.assertEqual(len(doc["cells"]), 2)

    def test_load_cells_by_requests_and_exact_rate(self):
        base = variant(saved_cell(), load_cell(1.0000001))
        cases = {"requests": load_cell(1.0000001, requests=2),
                 "exact rate": load_cell(1.0000004),
                 "burst": load_cell(None)}
        for name, change in cases.items():
            with self.subTest(label=name):
                doc = run.add_cell({"cells": [base]}, variant(base, change))
                self.assertEqual(len(doc["cells"]), 2)

    def test_prefix_length_keeps_shared_prefix_cells_apart(self):
        base = variant(saved_cell(), APART["workload"])
        other = variant(base, lambda c: c.update(prefix_tokens=2000))
        self.assertEqual(len(run.add_cell({"cells": [base]}, other)["cells"]), 2)

    def test_the_same_measurement_replaces_the_older(self):
        base = saved_cell()
        newer = variant(base, lambda c: c.update(created="later"))
        doc = run.add_cell({"cells": [base]}, newer)
        self.assertEqual([c["created"] for c in doc["cells"]], ["later"])

    def test_the_identity_in_words_names_engine_and_release(self):
        text = run.cell_key(saved_cell()).text()
        self.assertIn("vllm 0.26.0", text)
        self.assertIn("model stub/tiny-f32", text)


def set_setting(label, off_value, on_value=None):
    """A change to a saved cell: both arms (or each) reporting another value of a setting."""
    def change(cell):
        on = off_value if on_value is None else on_value
        for arm, value in (("off", off_value), ("on", on)):
            cell["servers"][arm]["settings"][label] = value
    return change


# Each setting the lab compares between arms, as users change it to compare two cells
COMPARED = {
    "attention backend": set_setting("attention backend", "TritonAttentionBackend"),
    "dtype": set_setting("dtype", "torch.float16"),
    "quantization": set_setting("quantization", "fp8"),
    "KV-cache dtype": set_setting("KV-cache dtype", "fp8"),
    "max num seqs": set_setting("max num seqs", 128),
    "TP reported": lambda c: [c["servers"][arm].update(tp=None) for arm in ("off", "on")],
    "flag unknown": lambda c: c["servers"]["off"].update(flag=None),
}


class EverySettingComparedIsPartOfTheIdentity(unittest.TestCase):
    def test_each_compared_setting_keeps_two_cells_apart(self):
        base = saved_cell()
        for name, change in COMPARED.items():
            with self.subTest(setting=name):
                other = variant(base, change)
                self.assertNotEqual(run.cell_key(base), run.cell_key(other))
                doc = run.add_cell({"schema": run.COST_SCHEMA, "cells": [base]}, other)
                self.assertEqual(len(doc["cells"]), 2)

    def test_the_parts_that_differ_are_named(self):
        base = saved_cell()
        other = variant(base, COMPARED["attention backend"])
        self.assertEqual(run.cell_key(base).differing(run.cell_key(other)),
                         ["setting attention backend"])
        self.assertIn("attention backend TritonAttentionBackend", run.cell_key(other).text())

    def test_a_release_alone_is_matched_across_by_the_rest(self):
        base = saved_cell()
        upgraded = variant(base, set_release("0.33.0"))
        upgraded = variant(upgraded, set_setting("engine version", "0.33.0"))
        self.assertNotEqual(run.cell_key(base), run.cell_key(upgraded))
        self.assertEqual(run.cell_key(base).across_releases(),
                         run.cell_key(upgraded).across_releases())


def set_machine(**machine):
    """A change to a saved cell: both arms reporting this of their machine (label ->
    value, the labels run.MACHINE_LABELS names, spaces as underscores)."""
    def change(cell):
        for arm in ("off", "on"):
            cell["servers"][arm].setdefault("machine", {}).update(
                {label.replace("_", " "): value for label, value in machine.items()})
    return change


H100 = {"GPUs": "1 x NVIDIA H100 80GB HBM3", "GPU driver": "570.86.15",
        "CUDA (torch's build)": "12.8", "CUDA toolkit (nvcc)": "12.8.93",
        "torch": "2.14.0+cu128"}


def on_h100(cell):
    for arm in ("off", "on"):
        cell["servers"][arm]["machine"] = dict(H100)


def before_machines(cell):
    """A cell as a lab that did not read the arms' machines saved it."""
    for arm in ("off", "on"):
        cell["servers"][arm].pop("machine", None)


class EachMachineIsACellOfItsOwn(unittest.TestCase):
    def test_each_thing_an_arm_reports_of_its_machine_keeps_two_cells_apart(self):
        self.assertEqual(set(H100), set(run.MACHINE_LABELS))
        base = variant(saved_cell(), on_h100)
        for label in run.MACHINE_LABELS:
            with self.subTest(label=label):
                other = variant(base, lambda c: [c["servers"][arm]["machine"].update(
                    {label: "another"}) for arm in ("off", "on")])
                self.assertNotEqual(run.cell_key(base), run.cell_key(other))
                doc = run.add_cell({"schema": run.COST_SCHEMA, "cells": [base]}, other)
                self.assertEqual(len(doc["cells"]), 2)
                self.assertEqual(run.cell_key(base).differing(run.cell_key(other)),
                                 ["setting " + label])

    def test_a_machine_nobody_reported_is_unknown_not_different(self):
        earlier = variant(saved_cell(), before_machines)
        newer = variant(saved_cell(), lambda c: (on_h100(c), c.update(created="later")))
        doc = run.add_cell({"cells": [earlier]}, newer)
        self.assertEqual([c["created"] for c in doc["cells"]], ["later"])
        line = run.replaced_cell_line(earlier, newer, "cost.json",
                                      run.settings_read_by_all([earlier, newer]))
        self.assertIn("what differs: ", line)
        self.assertIn("GPUs unknown, now 1 x NVIDIA H100 80GB HBM3; ", line)
        self.assertIn("torch unknown, now 2.14.0+cu128", line)

    def test_two_machines_stay_two_cells_beside_an_earlier_labs_cell(self):
        earlier = variant(saved_cell(), before_machines)
        h100 = variant(saved_cell(), on_h100)
        h200 = variant(h100, set_machine(GPUs="1 x NVIDIA H200"))
        doc = run.add_cell(run.add_cell({"cells": [earlier]}, h100), h200)
        self.assertEqual(len(doc["cells"]), 2)  # the earlier cell is replaced, once
        self.assertEqual([c["servers"]["off"]["machine"]["GPUs"] for c in doc["cells"]],
                         ["1 x NVIDIA H100 80GB HBM3", "1 x NVIDIA H200"])

    def test_one_arm_that_does_not_say_leaves_that_part_unknown(self):
        base = variant(saved_cell(), on_h100)
        half = variant(base, lambda c: c["servers"]["on"]["machine"].pop("torch"))
        self.assertEqual(len(run.add_cell({"cells": [base]}, half)["cells"]), 1)


class WhatVllmReportsOfItsMachine(unittest.TestCase):
    def info(self, release, arm):
        path = os.path.join(HERE, "fixtures", release, "server_info_flag_%s.json" % arm)
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    def test_the_real_answers_system_env(self):
        vllm = run.ADAPTERS["vllm"]
        self.assertEqual(vllm.machine(self.info("vllm-0.26.0", "off")),
                         {"GPUs": "1 x NVIDIA H200", "GPU driver": "580.159.04",
                          "CUDA (torch's build)": "13.0", "torch": "2.11.0+cu130"})
        # 0.34.0's captures were cut to four fields: what they lack is unknown
        self.assertEqual(vllm.machine(self.info("vllm-0.34.0", "on")),
                         {"CUDA (torch's build)": "13.0", "torch": "2.14.0+cu130"})

    def test_nvidia_smi_lines_become_a_count_of_each_model(self):
        self.assertEqual(run.gpu_count_text("GPU 0: NVIDIA H200\nGPU 1: NVIDIA H200\n"),
                         "2 x NVIDIA H200")
        self.assertEqual(run.gpu_count_text("GPU 0: A\nGPU 1: B\nGPU 2: A"), "2 x A, 1 x B")
        self.assertEqual(run.gpu_count_text("AMD Instinct MI300X (gfx942)"),
                         "AMD Instinct MI300X (gfx942)")

    def test_sglang_reports_no_machine(self):
        path = os.path.join(HERE, "fixtures", "sglang-0.5.23", "server_info_flag_off.json")
        with open(path, encoding="utf-8") as f:
            facts = run.ADAPTERS["sglang"].facts(json.load(f), None)
        self.assertEqual(facts.machine, {})


def labels(cell):
    return run.CellLabels.from_record(cell)


class TheTableShowsThisRunsCells(unittest.TestCase):
    def test_the_shared_prefix_column_holds_this_runs_prefix_length(self):
        first = variant(saved_cell(), lambda c: c.update(workload="shared-prefix",
                                                         prefix_tokens=64, overhead_pct=98.2))
        second = variant(first, lambda c: c.update(prefix_tokens=400, overhead_pct=195.5))
        lines = run.cost_table_lines([labels(first), labels(second)], labels(second))
        self.assertIn("shared prefix of 400 tokens", lines[0])
        row = next(line for line in lines if line.strip().startswith("TP=1 "))
        self.assertIn("+195.5%", row)
        self.assertNotIn("+98.2%", row)

    def test_the_heading_names_the_setting_that_tells_two_tables_apart(self):
        flash = saved_cell()
        triton = variant(flash, lambda c: (COMPARED["attention backend"](c),
                                           c.update(overhead_pct=50.0)))
        cells = [labels(flash), labels(triton)]
        lines = run.cost_table_lines(cells, labels(triton))
        self.assertIn("attention backend TritonAttentionBackend", lines[0])
        row = next(line for line in lines if line.strip().startswith("TP=1 "))
        self.assertIn("+50.0%", row)


    def test_tp_cells_of_vllm_before_and_from_0_34_0_print_the_release_note(self):
        def at(version, tp):
            def change(cell):
                set_release(version)(cell)
                set_setting("engine version", version)(cell)
                cell.update(tp=tp)
            return change

        note = "Note: vllm TP > 1 costs measured before 0.34.0 and from it are not comparable"
        older, newer, tp1 = (variant(saved_cell(), at(v, tp)) for v, tp in
                             (("0.33.0", 2), ("0.34.0", 2), ("0.34.0", 1)))
        cells = [labels(c) for c in (older, newer, tp1)]
        for current in cells:
            with self.subTest(release=current.identity.releases, tp=current.tp):
                lines = run.cost_table_lines(cells, current)
                self.assertEqual([l for l in lines if l.startswith("Note: ")],
                                 [l for l in lines if l.startswith(note)])
                self.assertEqual(len([l for l in lines if l.startswith(note)]), 1, lines)
        # one release only, or TP 1 only across releases: no note
        for shown in ([newer, tp1], [tp1, variant(saved_cell(), at("0.33.0", 1))]):
            cells = [labels(c) for c in shown]
            lines = run.cost_table_lines(cells, cells[0])
            self.assertFalse([l for l in lines if l.startswith("Note: ")], lines)

    def test_a_cell_whose_flag_on_arm_measured_faster_is_marked(self):
        faster = variant(saved_cell(), lambda c: c.update(overhead_pct=-7.3, significant=True,
                                                          ci95_pct=[-15.8, -5.6]))
        lines = run.cost_table_lines([labels(faster)], labels(faster))
        row = next(line for line in lines if line.strip().startswith("TP=1 "))
        self.assertIn("-7.3% [-15.8, -5.6] *", row)
        self.assertIn("* the flag-on arm measured faster: check the arms' flags", lines[-2])


class OverheadNamesTheArm(unittest.TestCase):
    def test_a_flag_on_trial_of_no_tokens_is_named_as_the_flag_on_arms(self):
        overhead = run.Overhead.of([0.01, 0.01], [0.01, float("inf")])
        self.assertEqual(overhead.pct, None)
        self.assertEqual(overhead.unmeasured, "a flag-on trial reported no output tokens")

    def test_a_flag_off_trial_of_no_tokens_is_no_ratio_not_minus_100(self):
        overhead = run.Overhead.of([float("inf")], [0.01])
        self.assertIsNone(overhead.pct)
        self.assertEqual(overhead.unmeasured, "a flag-off trial reported no output tokens")

    def test_a_flag_off_trial_of_no_time_is_still_named_so(self):
        overhead = run.Overhead.of([0.0], [0.01])
        self.assertEqual(overhead.unmeasured,
                         "a flag-off trial took no time the clock could measure")


class ComparePy(unittest.TestCase):
    def names(self, cells):
        out = io.StringIO()
        compare.compare_costs({"cells": cells[:1]}, {"cells": cells[1:]}, out)
        return out.getvalue()

    def test_burst_and_poisson_and_two_engines_are_rows_of_their_own(self):
        base = variant(saved_cell(), load_cell(None))
        for name, change in (("poisson", load_cell(100.0)),
                             ("engine", APART["engine"])):
            with self.subTest(kind=name):
                text = self.names([base, variant(base, change)])
                rows = [line for line in text.splitlines() if "overhead %" in line]
                self.assertEqual(len(rows), 2, text)


class CostRuns(TempDirTest):
    def cost(self, off, on, *extra):
        return run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 1,
                       "--trials", 1, "--warmup", 0, "--max-tokens", 2, *extra)

    def test_a_replaced_cell_is_said(self):
        path = self.path("cost.json")
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            first = self.cost(off, on, "--save", path)
            second = self.cost(off, on, "--save", path)
        self.assertEqual((first.code, second.code), (0, 0), second)
        self.assertNotIn("replaces", first.stderr)
        self.assertIn("--save: this cell replaces the one saved", second.stderr)
        self.assertIn("vllm 0.26.0", second.stderr)
        self.assertEqual(len(self.load("cost.json")["cells"]), 1)

    def test_a_replaced_cell_names_what_the_two_share_and_what_differs(self):
        path = self.path("cost.json")
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            self.cost(off, on, "--save", path)
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            second = self.cost(off, on, "--save", path)
        line = next(line for line in second.stderr.splitlines() if "replaces" in line)
        self.assertIn("both measured under vllm 0.26.0, model stub/tiny-f32, TP=1", line)
        self.assertIn("attention backend FlashAttentionBackend", line)
        self.assertRegex(line, r"the same \d+ settings on each arm")
        self.assertRegex(line, r"what differs: .*flag-off URL http://127.0.0.1:\d+, now ")

    def test_two_attention_backends_are_two_cells_and_the_table_shows_this_ones(self):
        path = self.path("cost.json")
        backends = ("vllm.v1.attention.backends.flash_attn.FlashAttentionBackend",
                    "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend")
        runs = []
        for backend in backends:
            with StubServer(StubConfig(attention_backend=backend)) as off, \
                    StubServer(StubConfig(invariant=True, attention_backend=backend)) as on:
                runs.append(self.cost(off, on, "--save", path))
        self.assertEqual([r.code for r in runs], [0, 0], runs[1])
        self.assertNotIn("replaces", runs[1].stderr)
        cells = self.load("cost.json")["cells"]
        self.assertEqual([c["servers"]["off"]["attention_backend"] for c in cells],
                         ["FlashAttentionBackend", "TritonAttentionBackend"])
        heading = next(line for line in runs[1].stdout.splitlines()
                       if line.startswith("cost cells for"))
        self.assertIn("attention backend TritonAttentionBackend", heading)

    def test_cost_runs_on_two_machines_are_two_cells(self):
        path = self.path("cost.json")
        machines = ({("system_env", "nvidia_gpu_models"): "GPU 0: NVIDIA H100 80GB HBM3",
                     ("system_env", "torch_version"): "2.14.0+cu130"},
                    {("system_env", "nvidia_gpu_models"): "GPU 0: NVIDIA H200",
                     ("system_env", "torch_version"): "2.13.0+cu130"})
        runs = []
        for machine in machines:
            with StubServer(StubConfig(info_overrides=machine)) as off, \
                    StubServer(StubConfig(invariant=True, info_overrides=machine)) as on:
                runs.append(self.cost(off, on, "--save", path))
        self.assertEqual([r.code for r in runs], [0, 0], runs[1])
        self.assertNotIn("replaces", runs[1].stderr)
        cells = self.load("cost.json")["cells"]
        self.assertEqual([(c["servers"]["on"]["machine"]["GPUs"],
                           c["servers"]["on"]["machine"]["torch"]) for c in cells],
                         [("1 x NVIDIA H100 80GB HBM3", "2.14.0+cu130"),
                          ("1 x NVIDIA H200", "2.13.0+cu130")])
        self.assertRegex(runs[1].stdout, r"\nGPUs +1 x NVIDIA H200 +1 x NVIDIA H200 *\n")

    def test_a_cell_of_an_unknown_machine_replaces_neither_of_two_known_ones(self):
        # an H100 cell, an H200 cell, then one whose GPUs collect_env could not find ("N/A"):
        # it could repeat either, so it repeats neither, and all three are kept
        path = self.path("cost.json")
        runs = []
        for gpus in ("GPU 0: NVIDIA H100 80GB HBM3", "GPU 0: NVIDIA H200", "N/A"):
            machine = {("system_env", "nvidia_gpu_models"): gpus}
            with StubServer(StubConfig(info_overrides=machine)) as off, \
                    StubServer(StubConfig(invariant=True, info_overrides=machine)) as on:
                runs.append(self.cost(off, on, "--save", path))
        self.assertEqual([r.code for r in runs], [0, 0, 0], runs[2])
        self.assertNotIn("replaces", runs[2].stderr)
        cells = self.load("cost.json")["cells"]
        self.assertEqual([c["servers"]["on"]["machine"].get("GPUs") for c in cells],
                         ["1 x NVIDIA H100 80GB HBM3", "1 x NVIDIA H200", None])

    def test_arms_on_two_machines_are_refused_unless_mismatch_is_allowed(self):
        h100 = {("system_env", "nvidia_gpu_models"): "GPU 0: NVIDIA H100 80GB HBM3"}
        with StubServer() as off, StubServer(StubConfig(invariant=True,
                                                        info_overrides=h100)) as on:
            refused = self.cost(off, on)
            allowed = self.cost(off, on, "--allow-mismatch", "--json")
        self.assertEqual(refused.code, 2, refused)
        self.assertIn("the two servers differ in more than the flag (GPUs)", refused.stderr)
        self.assertEqual(allowed.code, 0, allowed)
        self.assertEqual(allowed.json()["differences"],
                         [{"setting": "GPUs", "off": "1 x NVIDIA H200",
                           "on": "1 x NVIDIA H100 80GB HBM3"}])

    def test_arms_that_do_not_say_their_flag_are_not_called_flag_off_and_on(self):
        with StubServer(StubConfig(dev_mode=False)) as off, \
                StubServer(StubConfig(invariant=True, dev_mode=False)) as on:
            r = self.cost(off, on)
        self.assertEqual(r.code, 0, r)
        self.assertIn("the flags of the flag-off arm (--url) and the flag-on arm (--invariant) "
                      "are unknown", r.stderr)
        self.assertIn("the overhead above is of the --invariant arm over the --url arm, not "
                      "verified flag-on over flag-off", r.stdout)

    def test_the_tp_asked_labels_the_cell(self):
        with StubServer(StubConfig(tp_size=2)) as off, \
                StubServer(StubConfig(invariant=True, tp_size=2)) as on:
            r = self.cost(off, on, "--tp", 2, "--json")
        self.assertEqual(r.code, 0, r)
        self.assertEqual(r.json()["tp"], 2)

    def test_a_server_reporting_another_degree_is_refused(self):
        path = self.path("cost.json")
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            self.assertEqual(self.cost(off, on, "--tp", 1, "--save", path).code, 0)
            r = self.cost(off, on, "--tp", 2, "--save", path)
        self.assertEqual(r.code, 2, r)
        self.assertIn("--tp 2, but the flag-off arm (--url) reports TP 1", r.stderr)
        self.assertEqual([c["tp"] for c in self.load("cost.json")["cells"]], [1])


if __name__ == "__main__":
    unittest.main()


class ExampleToolsReadAnyFile(TempDirTest):
    """compare.py and the plots' reader answer any file with one line, never a traceback."""

    def compare(self, *paths, stdout=None):
        import subprocess
        return subprocess.run([sys.executable, os.path.join(EXAMPLES, "compare.py"), *paths],
                              stdout=stdout or subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, timeout=60)

    def write(self, name, text):
        with open(self.path(name), "w", encoding="utf-8") as f:
            f.write(text)
        return self.path(name)

    def test_a_deeply_nested_file(self):
        deep = self.write("deep.json", "[" * 100000 + "]" * 100000)
        r = self.compare(deep, deep)
        self.assertEqual(r.returncode, 2, r)
        self.assertEqual(len(r.stderr.splitlines()), 1, r.stderr)
        sys.path.insert(0, EXAMPLES)
        import labplot
        with self.assertRaises(ValueError):
            labplot.read(deep)

    def test_a_number_beyond_any_float(self):
        sweep = {"schema": "batch-invariance-lab/sweep/2", "summary": {"max_ulp": 10 ** 400},
                 "server": {}, "params": {}, "prompts": []}
        other = dict(sweep, summary={"max_ulp": 1})
        a = self.write("a.json", json.dumps(sweep))
        b = self.write("b.json", json.dumps(other))
        r = self.compare(a, b)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("401-digit number", r.stdout)
        cell = variant(saved_cell(), lambda c: c.update(overhead_pct=10 ** 400))
        c = self.write("c.json", json.dumps({"schema": run.COST_SCHEMA, "cells": [cell]}))
        r = self.compare(c, c)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn("Traceback", r.stderr)

    @unittest.skipUnless(os.path.exists("/dev/full"), "needs /dev/full")
    def test_a_full_stdout(self):
        cell = saved_cell()
        c = self.write("c.json", json.dumps({"schema": run.COST_SCHEMA, "cells": [cell]}))
        with open("/dev/full", "w") as full:
            r = self.compare(c, c, stdout=full)
        self.assertEqual(r.returncode, 74, r.stderr)
        self.assertEqual(len(r.stderr.splitlines()), 1, r.stderr)


def without_settings(*names):
    """A change to a saved cell: saved by a lab that did not read these settings yet."""
    def change(cell):
        for arm in ("off", "on"):
            for name in names:
                cell["servers"][arm]["settings"].pop(name, None)
    return change


# examples/sample_cost.json was saved before the lab read these two (20 settings, now 22)
EARLIER_LAB = without_settings("compilation mode", "breakable CUDA graph")


class CellsOfAnEarlierLab(unittest.TestCase):
    """A setting a cell's record does not hold is unknown there, never a difference: cells
    saved by a lab that read fewer settings are one measurement with today's."""

    def test_the_same_measurement_replaces_a_cell_saved_before_a_setting_was_read(self):
        old = variant(saved_cell(), EARLIER_LAB)
        newer = variant(saved_cell(), lambda c: c.update(created="later"))
        doc = run.add_cell({"cells": [old]}, newer)
        self.assertEqual([c["created"] for c in doc["cells"]], ["later"])

    def test_the_table_shows_the_earlier_labs_cells_beside_this_runs(self):
        old = variant(saved_cell(), lambda c: (EARLIER_LAB(c), c.update(overhead_pct=11.0)))
        new = variant(saved_cell(), lambda c: c.update(workload="shared-prefix", tp=1,
                                                       prefix_tokens=1000, overhead_pct=22.0))
        cells = [old, new]
        read = run.settings_read_by_all(cells)
        lines = run.cost_table_lines([run.CellLabels.from_record(c, read) for c in cells],
                                     run.CellLabels.from_record(new, read))
        row = next(line for line in lines if line.strip().startswith("TP=1 "))
        self.assertRegex(row, r"\+11\.0% .*\+22\.0%")
        self.assertNotIn("compilation mode", lines[0])

    def test_a_compared_setting_still_keeps_cells_apart_beside_an_earlier_labs_cell(self):
        old = variant(saved_cell(), EARLIER_LAB)
        triton = variant(saved_cell(), COMPARED["attention backend"])
        self.assertEqual(len(run.add_cell({"cells": [old]}, triton)["cells"]), 2)

    def test_arms_that_hid_their_settings_do_not_merge_two_backends(self):
        def hide(cell):
            for arm in ("off", "on"):
                cell["servers"][arm].update(info_source=None, flag=None,
                                            settings={"max model length": 2048})
        hidden, flash = variant(saved_cell(), hide), saved_cell()
        triton = variant(flash, COMPARED["attention backend"])
        self.assertEqual(len(run.add_cell({"cells": [hidden, flash]}, triton)["cells"]), 3)

    def test_a_release_saved_as_no_text_is_read_without_raising(self):
        odd = variant(saved_cell(), set_release({"major": 0}))
        cells = [labels(odd), labels(saved_cell())]
        lines = run.cost_table_lines(cells, cells[1])
        self.assertIn("vllm 0.26.0", lines[0])
        self.assertIn("{'major': 0}", run.cell_key(odd).text())


class CompareAcrossAnUpgradeOfTwoBackends(unittest.TestCase):
    """compare.py matches each backend's cell before and after an engine upgrade, though
    each file holds two cells alike but for their settings."""

    def rows(self, old_cells, new_cells):
        return compare.matched_cells({"cells": old_cells}, {"cells": new_cells})

    def test_each_backend_meets_its_own_across_the_release(self):
        flash = saved_cell()
        triton = variant(flash, COMPARED["attention backend"])
        upgrade = set_release("0.33.0")
        rows = self.rows([flash, triton], [variant(triton, upgrade), variant(flash, upgrade)])
        self.assertEqual(len(rows), 2, rows)
        for _, old, new in rows:
            self.assertEqual(run.cell_key(old).settings, run.cell_key(
                variant(new, set_release("0.26.0"))).settings)

    def test_one_backend_before_meets_its_own_of_two_after(self):
        flash = saved_cell()
        upgrade = set_release("0.33.0")
        triton = variant(variant(flash, COMPARED["attention backend"]), upgrade)
        rows = self.rows([flash], [triton, variant(flash, upgrade)])
        both = [(old, new) for _, old, new in rows if old and new]
        self.assertEqual(len(both), 1, rows)
        self.assertEqual(run.cell_key(both[0][1]).parts()["setting attention backend"],
                         run.cell_key(flash).parts()["setting attention backend"])
        out = io.StringIO()
        compare.compare_costs({"cells": [flash]}, {"cells": [triton, variant(flash, upgrade)]},
                              out)
        self.assertEqual(len([line for line in out.getvalue().splitlines()
                              if "overhead %" in line and "only" not in line]), 1)


class WhatToCheckCountsTheWarmUpAsItRan(unittest.TestCase):
    def faster(self, cell):
        cell.update(warmup=2, overhead_pct=-3.0, ci95_pct=[-5.0, -2.0], significant=True)
        return run.flag_on_faster(cell)

    def test_a_load_cells_warm_up_is_whole_trials_of_its_requests(self):
        said = self.faster(variant(saved_cell(), load_cell(None)))
        self.assertEqual(said[2], "check the warm-up: 2 warm-up trial(s) of 8 requests an arm "
                                  "were discarded (--warmup); a cold arm is slower")

    def test_a_batch_cells_warm_up_is_one_request_a_trial(self):
        said = self.faster(saved_cell())
        self.assertEqual(said[2], "check the warm-up: 2 request(s) an arm were discarded "
                                  "(--warmup); a cold arm is slower")


class SGLangGraphsFollowTheDegree(unittest.TestCase):
    """SGLang sizes its decode CUDA graphs by the TP degree where it is not told (256 below
    TP 4, 512 from it, on an H200): TP=1 and TP=4 cells of one shape share one table."""

    def sglang_cell(self, tp, top, overhead):
        def change(cell):
            cell.update(engine="sglang", tp=tp, overhead_pct=overhead)
            for arm in ("off", "on"):
                cell["servers"][arm].update(tp=tp)
                cell["servers"][arm]["settings"].update(
                    {"TP size": tp, "CUDA-graph sizes": [1, 2, 4, top]})
        return variant(saved_cell(), change)

    def test_tp_1_and_tp_4_share_the_table(self):
        one, four = self.sglang_cell(1, 256, 11.0), self.sglang_cell(4, 512, 44.0)
        cells = [labels(one), labels(four)]
        lines = run.cost_table_lines(cells, cells[1])
        rows = [line for line in lines if line.strip().startswith("TP=")]
        self.assertIn("+11.0%", rows[0])
        self.assertIn("+44.0%", rows[1])

    def test_they_stay_two_cells_and_vllms_graphs_still_tell_tables_apart(self):
        one, four = self.sglang_cell(1, 256, 11.0), self.sglang_cell(4, 512, 44.0)
        self.assertEqual(len(run.add_cell({"cells": [one]}, four)["cells"]), 2)
        vllm = variant(saved_cell(), set_setting("CUDA-graph sizes", [1, 2, 4]))
        self.assertNotEqual(labels(vllm).identity.table_group(),
                            labels(saved_cell()).identity.table_group())


class WhichSettingsCountAsRead(unittest.TestCase):
    def test_a_cell_without_info_source_counts_its_settings_as_read(self):
        def older(cell):  # saved before the lab named where settings came from
            EARLIER_LAB(cell)
            for arm in ("off", "on"):
                del cell["servers"][arm]["info_source"]
        old = variant(saved_cell(), older)
        newer = variant(saved_cell(), lambda c: c.update(created="later"))
        self.assertEqual([c["created"] for c in run.add_cell({"cells": [old]}, newer)["cells"]],
                         ["later"])

    def test_a_release_that_reports_fewer_settings_never_merges_two_backends_of_another(self):
        sparse = variant(saved_cell(), set_release("0.20.0"))
        for arm in ("off", "on"):
            sparse["servers"][arm]["settings"] = {"max model length": 2048}
        flash = saved_cell()
        triton = variant(flash, COMPARED["attention backend"])
        self.assertEqual(len(run.add_cell({"cells": [sparse, flash]}, triton)["cells"]), 3)

    def test_a_cell_of_another_value_is_kept_though_an_earlier_labs_cell_lacks_the_setting(self):
        old = variant(saved_cell(), EARLIER_LAB)  # holds no compilation mode
        eager = variant(saved_cell(), lambda c: (set_setting("compilation mode", 0)(c),
                                                 c.update(created="eager")))
        newer = variant(saved_cell(), lambda c: c.update(created="later"))  # mode 3
        doc = run.add_cell({"cells": [old, eager]}, newer)
        self.assertEqual(sorted(c["created"] for c in doc["cells"]), ["eager", "later"])
