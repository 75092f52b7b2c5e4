#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Two saved lab results side by side, with what changed (benchstat's old, new, delta layout).

    python3 examples/compare.py before.json after.json     # two sweeps, or two cost files

Sweeps: the servers' settings (only those that differ), the parameters, the summary and every
batch size both measured. Cost files (or cells printed with --json): every cell either file
holds, by TP, workload and trial shape, with the overhead, its interval and the change in
points. Standard library only. Exit codes: 0 printed, 2 a file that is not a lab result, or two
of different kinds.
"""

import io
import json
import sys

SWEEP_SCHEMAS = ("batch-invariance-lab/sweep/1", "batch-invariance-lab/sweep/2")
COST_SCHEMAS = ("batch-invariance-lab/cost/1",)
SUMMARY_FIELDS = ("verdict", "unique_completions", "total_completions", "max_ulp", "batch1_repeatable",
                  "state", "prefill_verdict", "prefill_max_ulp", "prefill_divergent", "prefill_kl_mean")
SIZE_FIELDS = ("max_ulp", "first_token_divergence", "distinct_in_batch", "same_as_baseline")


def read(path):
    """(kind, document) of a lab result: "sweep" or "cost" (a cost cell becomes a cost file)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError("%s: %s" % (path, err)) from None
    if not isinstance(doc, dict):
        raise ValueError("%s is not a lab result" % path)
    if doc.get("schema") in SWEEP_SCHEMAS:
        return "sweep", doc
    if doc.get("schema") in COST_SCHEMAS:
        return "cost", doc
    if "workload" in doc and "overhead_pct" in doc:
        return "cost", {"schema": COST_SCHEMAS[0], "cells": [doc]}
    raise ValueError("%s is not a lab result (schema %r)" % (path, doc.get("schema")))


def show(value):
    if value is None:
        return "-"
    if isinstance(value, float):
        return "%.4g" % value
    if isinstance(value, list):
        return ",".join(str(v) for v in value) if len(value) <= 12 else "%d values" % len(value)
    return str(value)


def delta(old, new):
    """new - old where both are numbers, else whether they differ."""
    if (old is None) != (new is None):
        return "new only" if old is None else "old only"
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (old, new))
    if numbers:
        return "%+g" % (new - old) if new != old else "="
    return "=" if old == new else "changed"


def table(title, rows, out):
    """rows: (name, old, new); printed with a delta column."""
    if not rows:
        return
    out.write("\n%s\n" % title)
    width = max(len(r[0]) for r in rows)
    out.write("  %-*s  %-24s  %-24s  %s\n" % (width, "", "old", "new", "delta"))
    for name, old, new in rows:
        out.write("  %-*s  %-24s  %-24s  %s\n" % (width, name, show(old)[:24], show(new)[:24],
                                                  delta(old, new)))


def compare_sweeps(a, b, out):
    sa, sb = a.get("server") or {}, b.get("server") or {}
    settings_a, settings_b = sa.get("settings") or {}, sb.get("settings") or {}
    changed = [(k, settings_a.get(k), settings_b.get(k)) for k in sorted(set(settings_a) | set(settings_b))
               if settings_a.get(k) != settings_b.get(k)]
    facts = [(k, sa.get(k), sb.get(k)) for k in ("engine", "version", "model", "flag", "tp",
                                                  "attention_backend", "graph_sizes")]
    table("server (settings that differ, and the main facts)", facts + changed, out)
    pa, pb = a.get("params") or {}, b.get("params") or {}
    table("parameters", [(k, pa.get(k), pb.get(k)) for k in sorted(set(pa) | set(pb))], out)
    ma, mb = a.get("summary") or {}, b.get("summary") or {}
    table("summary", [(k, ma.get(k), mb.get(k)) for k in SUMMARY_FIELDS if k in ma or k in mb], out)
    sizes = lambda doc: {s["batch_size"]: s for s in first_prompt(doc).get("sizes") or []}
    za, zb = sizes(a), sizes(b)
    rows = [("batch %d %s" % (n, k), za[n].get(k), zb[n].get(k))
            for n in sorted(set(za) & set(zb)) for k in SIZE_FIELDS]
    table("batch sizes both measured (first prompt of each)", rows, out)
    only = sorted(set(za) ^ set(zb))
    if only:
        out.write("\nbatch sizes in one file only: %s\n" % ",".join(map(str, only)))


def first_prompt(doc):
    """A sweep's first prompt (the one the size table compares), as saved."""
    prompts = doc.get("prompts") or [{}]
    return prompts[0]


def cell_name(cell):
    """What tells two cells apart: the model among them, so that two models' cells stay two."""
    shape = ("load %s" % cell.get("concurrency")) if cell.get("concurrency") else "batch %s" % cell.get("batch")
    return "%s TP=%s %s, %s, %s tokens" % (cell.get("model"), cell.get("tp"), cell.get("workload"), shape,
                                          cell.get("max_tokens"))


def compare_costs(a, b, out):
    ca = {cell_name(c): c for c in a.get("cells") or []}
    cb = {cell_name(c): c for c in b.get("cells") or []}
    rows = []
    for name in sorted(set(ca) | set(cb)):
        old, new = ca.get(name) or {}, cb.get(name) or {}
        rows.append((name + " overhead %", old.get("overhead_pct"), new.get("overhead_pct")))
        rows.append((name + " 95% interval", old.get("ci95_pct"), new.get("ci95_pct")))
        rows.append((name + " significant", old.get("significant"), new.get("significant")))
    table("cost cells (a cell in one file only shows - on the other side)", rows, out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        sys.stderr.write("usage: python3 examples/compare.py OLD.json NEW.json\n")
        return 2
    try:
        (kind_a, a), (kind_b, b) = read(argv[0]), read(argv[1])
    except ValueError as err:
        sys.stderr.write("compare.py: %s\n" % err)
        return 2
    if kind_a != kind_b:
        sys.stderr.write("compare.py: %s holds a %s, %s a %s: compare two of a kind\n"
                         % (argv[0], kind_a, argv[1], kind_b))
        return 2
    out = io.StringIO()
    out.write("old: %s\nnew: %s\n" % (argv[0], argv[1]))
    try:
        (compare_sweeps if kind_a == "sweep" else compare_costs)(a, b, out)
    except (TypeError, AttributeError, KeyError, ValueError) as err:  # a file of another shape
        sys.stderr.write("compare.py: %s and %s are not both as the lab writes them (%s: %s)\n"
                         % (argv[0], argv[1], type(err).__name__, err))
        return 2
    sys.stdout.write(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
