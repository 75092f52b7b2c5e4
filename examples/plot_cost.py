#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Plot cost files (run.py --mode cost --save FILE, or what --json prints) as the 2x2 overhead
table.

    python3 examples/plot_cost.py cost.json -o cost.png
    python3 examples/plot_cost.py tp1.json tp2.json cell.json -o cost.png   # several runs together

Cells are merged by what makes two cells the same measurement (run.py's CellIdentity: engine,
release, model, TP, workload, trials, arrivals, length, mismatched arms, each arm's flag and
reported settings; a setting one cell's file does not hold is unknown there, not a difference:
run.same_measurement): a later file's cell replaces an earlier one's, with a line saying so.

One panel per 2x2 table, as run.py prints them (run.cost_tables: one identity but for TP and
the workload, so a burst and a Poisson-arrival cell of one shape, or two attention backends,
are two panels), each titled with what tells it from the others (the arrival rate among
it). In a panel, one group of bars per TP degree (TP=1 and every other degree), one bar per
workload (cold, shared-prefix): the flag's overhead in percent with its 95% interval.
A missing cell is drawn as an empty slot labelled "missing", because one cell alone is
not a result. A bar whose whole interval lies below zero (the flag-on arm measured faster)
is hatched and labelled, and what to check is said on stderr. --model, --batch and
--max-tokens keep only the panels of that model, batch or length.

Needs matplotlib (pip install matplotlib); run.py itself does not.
"""

import argparse
import os
import sys

import labplot

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import run  # noqa: E402  (run.py: what makes two cells the same measurement)

COST_SCHEMAS = ("batch-invariance-lab/cost/1",)
WORKLOADS = ("cold", "shared-prefix")


def is_figure(value):
    """A number a bar can be drawn at (a file may hold null, or a number beyond any float)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 1e300


def is_cell(doc):
    return "workload" in doc and "overhead_pct" in doc and "schema" not in doc


def cell_fault(cell):
    """What is wrong with a cell's figures as the picture reads them, or None: its overhead a
    number or null, its interval null or two numbers (low, high)."""
    overhead, ci = cell.get("overhead_pct"), cell.get("ci95_pct")
    if overhead is not None and not (isinstance(overhead, (int, float))
                                     and not isinstance(overhead, bool)):
        return "its overhead_pct is %r, not a number or null" % (overhead,)
    if ci is None:
        return None
    if not isinstance(ci, list) or len(ci) != 2:
        return "its ci95_pct is %s, not an interval [low, high] or null" % (
            "a list of %d value%s" % (len(ci), "" if len(ci) == 1 else "s")
            if isinstance(ci, list) else repr(ci))
    if not all(x is None or (isinstance(x, (int, float)) and not isinstance(x, bool))
               for x in ci):
        return "its ci95_pct %r holds something other than numbers" % (ci,)
    return None


def load(paths, say=lambda line: sys.stderr.write(line + "\n")):
    """One cost document holding every cell of paths (cost files, or cells run.py --json printed)."""
    merged, found = [], []  # merged: [cell, path] in the order first seen
    for path in paths:
        doc = labplot.read(path)
        if is_cell(doc):
            cells = [doc]
        else:
            cells = labplot.load(path, COST_SCHEMAS, "cost").get("cells") or []
        for i, cell in enumerate(cells, 1):
            if not isinstance(cell, dict) or not is_cell(cell):
                raise ValueError("%s holds something that is not a cost cell" % path)
            fault = cell_fault(cell)
            if fault:
                raise ValueError("%s: cell %d (%s, TP %s): %s" % (
                    path, i, cell.get("workload"), cell.get("tp", "?"), fault))
            found.append((path, cell))
    # a setting an earlier lab did not read is unknown, not a difference
    read = run.settings_read_by_all([cell for _, cell in found])
    for path, cell in found:
        # the lab's own rule for one measurement
        earlier = next((m for m in merged if run.same_measurement(m[0], cell, read)), None)
        if earlier is None:
            merged.append([cell, path])
            continue
        say("plot_cost.py: the cell of %s replaces the one of %s (%s)" % (
            path, earlier[1], run.cell_key(cell, read).text()))
        earlier[:] = [cell, path]
    if not merged:
        raise ValueError("%s: no cell yet" % ", ".join(paths))
    return {"schema": COST_SCHEMAS[0], "cells": [cell for cell, _ in merged]}


def tables(doc, model=None, batch=None, max_tokens=None):
    """Every 2x2 table of the cells, as run.py prints them (run.cost_tables: cells of one
    identity but for TP and the workload, one prefix length a shared-prefix column), the
    newest cell's first, narrowed by model, batch and length where given: [(heading, degrees,
    slots)], slots mapping (TP, workload) to the slot's bar (None: missing)."""
    read = run.settings_read_by_all(doc["cells"])
    cells = [run.CellLabels.from_record(c, read) for c in doc["cells"]]

    def record_of(labels):  # the record a table's cell was read from
        return next(r for c, r in zip(cells, doc["cells"]) if c is labels)

    found = []
    for group, prefix, same in run.cost_tables(cells):
        if (model is not None and group.model != model) or \
                (batch is not None and group.batch != batch) or \
                (max_tokens is not None and group.max_tokens != max_tokens):
            continue
        degrees = run.table_degrees(same)
        slots = {}
        for tp in degrees:
            for workload in WORKLOADS:
                cell = run.table_slot(same, tp, workload)
                slots[tp, workload] = None if cell is None else bar(cell, record_of(cell))
        heading = run.table_heading(cells, group, prefix)
        named = sorted({labplot.named(record_of(c)) for c in same} - {""})
        if named:  # the cells' --label and --metadata, as saved
            heading += "; " + ", ".join(named)
        found.append((heading, degrees, slots))
    if not found:
        raise ValueError("no cell of that model, batch and length")
    return found


def bar(cell, record):
    """What a slot draws of a cell: its figure (None: no figure), interval, significance, and
    what to check where the flag-on arm measured faster (run.flag_on_faster)."""
    overhead = cell.overhead
    value = overhead.pct if is_figure(overhead.pct) else None
    interval = overhead.ci95_pct if value is not None and overhead.ci95_pct and all(
        map(is_figure, overhead.ci95_pct)) else None
    return {"value": value, "interval": interval, "significant": overhead.significant,
            "faster": run.flag_on_faster(record)}


def figure(doc, model=None, batch=None, max_tokens=None, say=lambda line: None):
    """The chart as a matplotlib figure, one panel a table (tables()). Value labels sit above
    each interval, inside limits that leave room for them, and the legend sits outside the
    axes: no label can overlap the title, the legend or another label, whatever the sign of
    the overheads. A bar whose flag-on arm measured faster is hatched and labelled so, and
    what to check is said (say)."""
    plt = labplot.pyplot()
    from matplotlib.patches import Patch

    found = tables(doc, model, batch, max_tokens)
    fig, axes = plt.subplots(len(found), 1, figsize=(8.5, 4.5 * len(found)), squeeze=False)
    width = 0.36
    faster_seen = False
    for ax, (heading, tps, slots) in zip(axes[:, 0], found):
        bars = [b for b in slots.values() if b and b["value"] is not None]
        bounds = [b["interval"] or [b["value"]] * 2 for b in bars]  # no interval: the value
        low = min([0.0] + [lo for lo, _ in bounds])
        high = max([0.0] + [hi for _, hi in bounds])
        span = max(high - low, 1.0)
        room = 0.22 * span  # above the highest interval: two lines of label
        panel_faster = any(b["faster"] for b in bars)
        faster_seen = faster_seen or panel_faster
        for w, workload in enumerate(WORKLOADS):
            for t, tp in enumerate(tps):
                x = t + (w - 0.5) * width
                slot = slots[tp, workload]
                if slot is None or slot["value"] is None:
                    # no cell, or a cell without a figure: drawn as missing, never as +0.0 %
                    ax.bar(x, 0, width, color="none", edgecolor="0.6", ls="--")
                    ax.text(x, 0.02 * span, "missing" if slot is None else "no figure",
                            ha="center", va="bottom", fontsize=8, color="0.4", rotation=90)
                    continue
                value = slot["value"]
                lo, hi = slot["interval"] or (value, value)
                ax.bar(x, value, width, color="C%d" % w, alpha=0.85 if slot["significant"] else 0.35,
                       hatch="//" if slot["faster"] else None)
                ax.errorbar(x, value, yerr=[[value - lo], [hi - value]], color="k", capsize=4, lw=1)
                note = "\nn.s." if not slot["significant"] else ""
                if slot["faster"]:
                    note = "\non faster:\ncheck arms"
                    say("plot_cost.py: TP=%s, %s, %s: %s" % (
                        "?" if tp is None else tp, workload, heading, "; ".join(slot["faster"])))
                ax.text(x, max(hi, 0) + 0.03 * span, "%+.1f%%%s" % (value, note),
                        ha="center", va="bottom", fontsize=8)
        ax.axhline(0, color="0.3", lw=0.8)
        ax.set_xticks(range(len(tps)))
        ax.set_xticklabels(["TP=%s" % ("?" if tp is None else tp) for tp in tps])
        ax.set_ylabel("overhead of the flag (%), 95% interval")
        ax.set_title("Cost of batch invariance: %s" % heading, fontsize=8, wrap=True)
        ax.set_ylim(low - 0.08 * span, high + room + (0.15 * span if panel_faster else 0))
        ax.set_xlim(-0.7, len(tps) - 0.3)
    handles = [Patch(color="C%d" % w, label=workload) for w, workload in enumerate(WORKLOADS)]
    handles.append(Patch(color="0.7", alpha=0.35, label="pale: not significant"))
    if faster_seen:
        handles.append(Patch(facecolor="white", edgecolor="k", hatch="//",
                             label="hatched: flag on faster:\ncheck the arms' flags,\n"
                             "warm-up, which URL is which"))
    axes[0, 0].legend(handles=handles, fontsize=8, title="workload", title_fontsize=8,
                      loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    return fig


def plot(paths, out, model=None, batch=None, max_tokens=None):
    plt = labplot.pyplot()
    fig = figure(load(paths), model, batch, max_tokens,
                 say=lambda line: sys.stderr.write(line + "\n"))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description="Plot a cost file as the 2x2 overhead table.")
    p.add_argument("files", nargs="+", help="cost files written by run.py --mode cost --save, or cells "
                   "it printed with --json")
    p.add_argument("-o", "--output", required=True, help="the PNG to write")
    p.add_argument("--model")
    p.add_argument("--batch", type=int)
    p.add_argument("--max-tokens", type=int)
    args = p.parse_args(argv)
    return labplot.run("plot_cost.py", args.output, lambda: plot(
        args.files, args.output, args.model, args.batch, args.max_tokens))


if __name__ == "__main__":
    sys.exit(main())
