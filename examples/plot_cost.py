#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Plot cost files (run.py --mode cost --save FILE, or what --json prints) as the 2x2 overhead
table.

    python3 examples/plot_cost.py cost.json -o cost.png
    python3 examples/plot_cost.py tp1.json tp2.json cell.json -o cost.png   # several runs together

Cells are merged by what makes two cells the same measurement (run.py's CellIdentity: engine,
release, model, TP, workload, trials, arrivals, length, mismatched arms): a later file's cell
replaces an earlier one's, with a line saying so.

One group of bars per TP degree (TP=1 and every other degree in the file), one bar per
workload (cold, shared-prefix): the flag's overhead in percent with its 95% interval.
A missing cell is drawn as an empty slot labelled "missing", because one cell alone is
not a result. With several models, batches or lengths in the file, --model, --batch and
--max-tokens pick one (default: those of the newest cell).

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


def load(paths, say=lambda line: sys.stderr.write(line + "\n")):
    """One cost document holding every cell of paths (cost files, or cells run.py --json printed)."""
    merged, origin = {}, {}
    for path in paths:
        doc = labplot.read(path)
        if is_cell(doc):
            cells = [doc]
        else:
            cells = labplot.load(path, COST_SCHEMAS, "cost").get("cells") or []
        for cell in cells:
            if not isinstance(cell, dict) or not is_cell(cell):
                raise ValueError("%s holds something that is not a cost cell" % path)
            key = run.cell_key(cell)  # the lab's own rule for one measurement
            if key in merged:
                say("plot_cost.py: the cell of %s replaces the one of %s (%s)" % (
                    path, origin[key], key.text()))
            merged[key], origin[key] = cell, path
    if not merged:
        raise ValueError("%s: no cell yet" % ", ".join(paths))
    return {"schema": COST_SCHEMAS[0], "cells": list(merged.values())}


def select(doc, model=None, batch=None, max_tokens=None):
    """The cells of one 2x2 table: those that share the newest chosen cell's identity but for
    TP and workload (run.py's CellIdentity: engine, release, model, trials, arrivals, length),
    the choice narrowed by model, batch and length where given."""
    chosen = [c for c in doc["cells"]
              if (model is None or c.get("model") == model) and (batch is None or c.get("batch") == batch)
              and (max_tokens is None or c.get("max_tokens") == max_tokens)]
    if not chosen:
        raise ValueError("no cell of that model, batch and length")
    newest = max(chosen, key=lambda c: str(c.get("created", "")))
    group = run.cell_key(newest).table_group()
    return group, [c for c in doc["cells"] if run.cell_key(c).table_group() == group]


def figure(doc, model=None, batch=None, max_tokens=None):
    """The chart as a matplotlib figure. Value labels sit above each interval, inside limits
    that leave room for them, and the legend sits outside the axes: no label can overlap the
    title, the legend or another label, whatever the sign of the overheads."""
    plt = labplot.pyplot()
    from matplotlib.patches import Patch

    group, cells = select(doc, model, batch, max_tokens)
    others = sorted({c.get("tp") for c in cells if c.get("tp") != 1}, key=str)
    tps = [1] + (others or ["k"])
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    width = 0.36
    measured = [c for c in cells if is_figure(c.get("overhead_pct"))]
    bounds = [c["ci95_pct"] or [c["overhead_pct"]] * 2 for c in measured]  # no interval: the value
    low = min([0.0] + [b[0] for b in bounds])
    high = max([0.0] + [b[1] for b in bounds])
    span = max(high - low, 1.0)
    room = 0.22 * span  # above the highest interval: two lines of label
    for w, workload in enumerate(WORKLOADS):
        for t, tp in enumerate(tps):
            x = t + (w - 0.5) * width
            cell = next((c for c in cells if c.get("tp") == tp and c.get("workload") == workload), None)
            if cell is None or not is_figure(cell.get("overhead_pct")):
                # no cell, or a cell without a figure: drawn as missing, never as +0.0 %
                ax.bar(x, 0, width, color="none", edgecolor="0.6", ls="--")
                ax.text(x, 0.02 * span, "missing" if cell is None else "no figure", ha="center",
                        va="bottom", fontsize=8, color="0.4", rotation=90)
                continue
            value = cell["overhead_pct"]
            lo, hi = cell["ci95_pct"] or (value, value)
            ax.bar(x, value, width, color="C%d" % w, alpha=0.85 if cell["significant"] else 0.35)
            ax.errorbar(x, value, yerr=[[value - lo], [hi - value]], color="k", capsize=4, lw=1)
            ax.text(x, max(hi, 0) + 0.03 * span, "%+.1f%%%s" % (value, "" if cell["significant"] else "\nn.s."),
                    ha="center", va="bottom", fontsize=8)
    ax.axhline(0, color="0.3", lw=0.8)
    ax.set_xticks(range(len(tps)))
    ax.set_xticklabels(["TP=%s" % ("?" if tp is None else tp) for tp in tps])
    ax.set_ylabel("overhead of the flag (%), 95% interval")
    ax.set_title("Cost of batch invariance: %s" % group.text(), fontsize=9)
    handles = [Patch(color="C%d" % w, label=workload) for w, workload in enumerate(WORKLOADS)]
    handles.append(Patch(color="0.7", alpha=0.35, label="pale: not significant"))
    ax.legend(handles=handles, fontsize=8, title="workload", title_fontsize=8, loc="upper left",
              bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.set_ylim(low - 0.08 * span, high + room)
    ax.set_xlim(-0.7, len(tps) - 0.3)
    fig.tight_layout()
    return fig


def plot(paths, out, model=None, batch=None, max_tokens=None):
    plt = labplot.pyplot()
    fig = figure(load(paths), model, batch, max_tokens)
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
