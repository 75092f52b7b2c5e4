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
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import run  # noqa: E402  (run.py: what makes two cost cells the same measurement)

SWEEP_SCHEMAS = ("batch-invariance-lab/sweep/1", "batch-invariance-lab/sweep/2")
COST_SCHEMAS = ("batch-invariance-lab/cost/1",)
SUMMARY_FIELDS = ("verdict", "unique_completions", "total_completions", "max_ulp",
                  "batch1_repeatable", "first_moved", "served_sizes", "state",
                  "prefix_cache_bypass", "prefill_verdict", "prefill_max_ulp", "prefill_divergent",
                  "prefill_kl_mean")
SIZE_FIELDS = ("max_ulp", "first_token_divergence", "distinct_in_batch", "same_as_baseline")


def read(path):
    """(kind, document) of a lab result: "sweep" or "cost" (a cost cell becomes a cost file)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError("%s: %s" % (path, err)) from None
    except RecursionError:
        raise ValueError("%s is nested deeper than any lab result" % path) from None
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
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** 15:
        if abs(value) < 10 ** 308:
            return "%.4g" % value
        return "a %d-digit number" % len(str(abs(value)))
    if isinstance(value, dict):
        return ", ".join("%s %s" % (k, show(v)) for k, v in value.items())
    if isinstance(value, list):
        return ",".join(str(v) for v in value) if len(value) <= 12 else "%d values" % len(value)
    return str(value)


def delta(old, new):
    """new - old where both are numbers, else whether they differ."""
    if (old is None) != (new is None):
        return "new only" if old is None else "old only"
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (old, new))
    if numbers:
        if new == old:
            return "="
        change = new - old
        return "%+g" % change if abs(change) < 1e308 else "changed"
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
    facts.append(("known hazards", hazard_names(sa), hazard_names(sb)))
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


def hazard_names(server):
    """The known hazards a server's settings met, by name (None: the server hid its settings)."""
    hazards = server.get("hazards")
    if not isinstance(hazards, list):
        return None
    return ",".join(str(h.get("name") if isinstance(h, dict) else h) for h in hazards) or "none"


def first_prompt(doc):
    """A sweep's first prompt (the one the size table compares), as saved."""
    prompts = doc.get("prompts") or [{}]
    return prompts[0]


def cell_name(cell):
    """What tells two cells apart: everything they were measured under (run.py's own
    CellIdentity), so that a burst and a Poisson cell, or two engines' cells, stay two."""
    return run.cell_key(cell).text()


def compare_costs(a, b, out):
    ca = {cell_name(c): c for c in a.get("cells") or [] if isinstance(c, dict)}
    cb = {cell_name(c): c for c in b.get("cells") or [] if isinstance(c, dict)}
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
    except (TypeError, AttributeError, KeyError, ValueError, OverflowError,
            RecursionError) as err:  # a file of another shape
        sys.stderr.write("compare.py: %s and %s are not both as the lab writes them (%s)\n"
                         % (argv[0], argv[1], type(err).__name__))
        return 2
    try:
        sys.stdout.write(out.getvalue())
        sys.stdout.flush()
    except OSError as err:  # a full disk, a closed pipe
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # exiting flushes again
            sys.stderr.write("compare.py: cannot write the comparison: %s\n" % os.strerror(err.errno or 0))
        except OSError:
            pass
        return 74
    return 0


if __name__ == "__main__":
    sys.exit(main())
