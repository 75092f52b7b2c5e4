"""Results you can paste: --format markdown and --format csv print a sweep's table or a cost
run's cells, read back here by Python's csv module and by a plain Markdown table parser and
held against the saved file; the default sweep table fits 100 columns, the wide one is behind
--wide; --label and --metadata are saved with the result and shown by compare.py and the
plots."""

import csv
import io
import os
import subprocess
import sys

from support import ROOT, StubConfig, StubServer, TempDirTest, one_error_line, run_lab

EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)
import labplot  # noqa: E402
import plot_cost  # noqa: E402
import plot_sweep  # noqa: E402


def markdown_tables(text):
    """Every pipe table of a Markdown text as a list of dicts (header -> cell): a cell ends at
    an unescaped "|", and a backslash takes the next character as it is."""
    tables, rows = [], []
    for line in text.splitlines() + [""]:
        if not line.startswith("|"):
            if rows:
                header = rows[0]
                tables.append([dict(zip(header, r)) for r in rows[2:]])
                rows = []
            continue
        cells, cell, escaped = [], "", False
        for c in line.strip()[1:]:
            if escaped:
                cell, escaped = cell + c, False
            elif c == "\\":
                escaped = True
            elif c == "|":
                cells.append(cell.strip())
                cell = ""
            else:
                cell += c
        rows.append(cells)
    return tables


def sweep(stub, tmp, *extra):
    return run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2,17", "--repeat", 2,
                   "--max-tokens", 12, "--save", os.path.join(tmp, "s.json"), *extra)


class SweepExports(TempDirTest):
    def check_against_saved(self, rows):
        sizes = self.load("s.json")["prompts"][0]["sizes"]
        self.assertEqual([int(r["batch"]) for r in rows], [s["batch_size"] for s in sizes])
        for row, size in zip(rows, sizes):
            self.assertEqual(int(row["same_as_baseline"]), size["same_as_baseline"])
            self.assertEqual(int(row["max_ulp"]), size["max_ulp"])
            self.assertEqual(float(row["max_nats"]), size["max_nats"])  # exact, as saved
            self.assertEqual(int(row["runs_matched"]), size["runs_matched"])
            rate = size.get("diverged")
            if rate is None:  # batch 1, the baseline
                self.assertEqual(row["moved"], "")
                continue
            self.assertEqual((int(row["moved"]), int(row["compared"])),
                             (rate["moved"], rate["compared"]))
            self.assertAlmostEqual(float(row["moved_high_pct"]), 100 * rate["high"], places=5)
            self.assertEqual(row["interval_wide"], "true" if rate["wide"] else "false")

    def test_csv_reads_back_as_saved(self):
        with StubServer(StubConfig()) as stub:
            r = sweep(stub, self.tmp, "--format", "csv")
        self.assertEqual(r.code, 0, r)
        rows = list(csv.DictReader(io.StringIO(r.stdout)))
        self.assertEqual(len(rows), 3)
        self.check_against_saved(rows)
        self.assertIn("summary: ", r.stderr)  # the rest of the report, apart from the table
        self.assertNotIn("server: ", r.stdout)

    def test_markdown_reads_back_as_saved(self):
        with StubServer(StubConfig()) as stub:
            r = sweep(stub, self.tmp, "--format", "markdown", "--label", "a|b label")
        self.assertEqual(r.code, 0, r)
        tables = markdown_tables(r.stdout)
        self.assertEqual(len(tables), 1, r.stdout)
        self.check_against_saved(tables[0])
        self.assertIn("**a|b label**", r.stdout)
        self.assertIn("summary: ", r.stdout)

    def test_a_pipe_or_a_line_break_in_a_cell_stays_in_its_cell(self):
        import run
        text = run.export_text(["a", "b"], [["x|y\\z", "1\n2"]], "markdown")
        self.assertEqual(markdown_tables(text), [[{"a": "x|y\\z", "b": "1 2"}]])
        back = list(csv.reader(io.StringIO(run.export_text(["a"], [['x,"y"\nz']], "csv"))))
        self.assertEqual(back, [["a"], ['x,"y"\nz']])

    def test_the_default_table_fits_100_columns_and_the_wide_one_is_asked_for(self):
        with StubServer(StubConfig()) as stub:
            narrow = sweep(stub, self.tmp, "--traffic", "copies")
            wide = sweep(stub, self.tmp, "--traffic", "copies", "--wide")
        for r in (narrow, wide):
            self.assertEqual(r.code, 0, r)

        def table_lines(text):
            lines = text.splitlines()
            start = next(i for i, l in enumerate(lines) if l.startswith("  batch  bucket"))
            end = next(i for i, l in enumerate(lines) if l.startswith("  unique completions"))
            return lines[start:end]
        lines = table_lines(narrow.stdout)
        rows = [line for line in lines if not line.startswith(" " * 9)]  # notes: a line each
        self.assertTrue(all(len(line) <= 100 for line in rows), rows)
        self.assertGreater(len(rows), 3)
        self.assertIn("moved, 95% CI", lines[0])
        self.assertNotIn("tie margin", lines[0])
        self.assertTrue(any("cache" in line for line in lines[1:]))  # the notes, below a row
        wide_lines = table_lines(wide.stdout)
        self.assertIn("tie margin", wide_lines[0])
        self.assertGreater(max(map(len, wide_lines)), 100)

    def test_json_and_a_format_are_one_or_the_other(self):
        r = run_lab("--mode", "sweep", "--json", "--format", "csv")
        one_error_line(self, r, 2, "--json")


class Labels(TempDirTest):
    def test_a_sweep_saves_its_label_and_compare_and_the_plot_show_them(self):
        with StubServer(StubConfig()) as stub:
            r = sweep(stub, self.tmp, "--label", "H100 night run", "--metadata", "gpu=H100",
                      "--metadata", "driver=580.1")
        self.assertEqual(r.code, 0, r)
        doc = self.load("s.json")
        self.assertEqual(doc["label"], "H100 night run")
        self.assertEqual(doc["metadata"], {"gpu": "H100", "driver": "580.1"})
        self.assertIn("result: H100 night run; gpu=H100, driver=580.1", r.stdout)
        out = subprocess.run([sys.executable, os.path.join(EXAMPLES, "compare.py"),
                              self.path("s.json"), self.path("s.json")],
                             capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("H100 night run", out.stdout)
        self.assertIn("gpu H100", out.stdout)
        self.assertIn("H100 night run [gpu=H100, driver=580.1]",
                      plot_sweep.label(doc, self.path("s.json")))

    def test_a_cost_cell_saves_its_label_and_the_exports_and_plot_show_it(self):
        with StubServer(StubConfig()) as off, StubServer(StubConfig(invariant=True)) as on:
            args = ["--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 2,
                    "--trials", 2, "--warmup", 0, "--max-tokens", 2,
                    "--save", self.path("c.json")]
            first = run_lab(*args, "--label", "before", "--metadata", "gpu=H100")
            second = run_lab(*args, "--workload", "shared-prefix", "--prefix-tokens", 20,
                             "--format", "csv")
            md = run_lab(*args, "--format", "markdown", "--label", "after")
        for r in (first, second, md):
            self.assertEqual(r.code, 0, r)
        self.assertIn("result: before; gpu=H100", first.stdout)
        cells = self.load("c.json")["cells"]
        rows = list(csv.DictReader(io.StringIO(second.stdout)))
        self.assertEqual(len(rows), 2)  # the file's cells, the earlier one too
        by_workload = {row["workload"]: row for row in rows}
        self.assertEqual(by_workload["cold"]["label"], "before")
        self.assertEqual(by_workload["cold"]["metadata"], "gpu=H100")
        self.assertEqual(by_workload["shared-prefix"]["label"], "")
        (table,) = markdown_tables(md.stdout)
        self.assertEqual({row["workload"] for row in table}, {"cold", "shared-prefix"})
        cold = next(c for c in cells if c["workload"] == "cold")
        self.assertEqual(cold["label"], "after")  # the same measurement again: replaced
        row = next(r for r in table if r["workload"] == "cold")
        self.assertEqual(float(row["overhead_pct"]), cold["overhead_pct"])
        headings = [h for h, _, _ in plot_cost.tables({"cells": cells})]
        self.assertTrue(any("after" in h for h in headings), headings)
        self.assertEqual(labplot.named({"label": "x", "metadata": {"k": "v"}}), "x [k=v]")

    def test_bad_metadata_is_one_line_and_exit_2(self):
        for args, words in ((("--metadata", "novalue"), "KEY=VALUE"),
                            (("--metadata", "a=1", "--metadata", "a=2"), "twice"),
                            (("--label", "two\nlines"), "--label")):
            with self.subTest(args=args):
                r = run_lab("--mode", "sweep", *args)
                one_error_line(self, r, 2, words)


if __name__ == "__main__":
    import unittest
    unittest.main()
