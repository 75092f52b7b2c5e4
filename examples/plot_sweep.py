#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Plot one or more sweep files (run.py --mode sweep --save FILE) into one PNG.

    python3 examples/plot_sweep.py off.json on.json -o sweep.png

Top: the largest float32 ULP distance from batch 1's logprobs, per batch size, on a log
scale; a size whose logprobs matched bit for bit is drawn on the bottom line as an open
marker labelled 0. Bottom: the first step whose token differed from batch 1's ("held"
when none did). A size where the prefix cache served requests is drawn as a grey cross, not
a point: what moved there compares the cache, not the batch. Each file's legend line ends
with its saved verdict. The CUDA-graph buckets reported by the first file's server are
shaded: sizes in one band pad to the same graph; past the last band there is no graph.

Needs matplotlib (pip install matplotlib); run.py itself does not.
"""

import argparse
import os
import sys

import labplot

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import run  # noqa: E402  (run.py: the sweep files it writes)

SWEEP_SCHEMAS = run.SWEEP_SCHEMAS_READ  # what the run.py beside it reads back
ZERO_LINE = 0.5    # where "0 ULP" is drawn on the log axis


def server_name(doc):
    """Engine, release, model and flag of a sweep's server."""
    server = doc.get("server") or {}
    flag = {True: "flag on", False: "flag off"}.get(server.get("flag"), "flag unknown")
    return "%s %s, %s, %s" % (doc.get("engine"), server.get("version") or "?", doc.get("model"),
                              flag)


def label(doc, path):
    """A file's legend line: its label and metadata where it has them, its server, its saved
    verdict, and the file."""
    named = labplot.named(doc)
    return "%s%s: %s (%s)" % (named + ": " if named else "", server_name(doc), verdict(doc),
                              os.path.basename(path))


def verdict(doc):
    """The sweep's verdict as it saved it, with the sizes the cache served where any were,
    then each check's own verdict (<check>_verdict): a flag-off sweep whose sizes held but
    whose neighbour check moved is not drawn as plainly invariant."""
    summary = doc.get("summary") or {}
    said = str(summary.get("verdict") or "no verdict saved")
    served_sizes = summary.get("served_sizes") or []
    if served_sizes:
        said += "; the cache served requests at %s" % ",".join(map(str, served_sizes))
    for key in sorted(k for k in summary if isinstance(k, str) and k.endswith("_verdict")):
        if summary[key] is not None:
            said += "; %s check: %s" % (key[:-len("_verdict")].replace("_", " "), summary[key])
    return said


def per_size(doc):
    """(batch size, max ULP, first token divergence, requests the prefix cache served) over
    every prompt of the file; a size the summary lists among the cache's counts as served
    where its passes do not say how many."""
    rows = {}
    listed = set((doc.get("summary") or {}).get("served_sizes") or [])
    for prompt in doc["prompts"]:
        for s in prompt["sizes"]:
            ulp, div, hits = rows.get(s["batch_size"], (0, None, 0))
            d = s["first_token_divergence"]
            hits += sum(r.get("served") or 0 for r in s.get("runs") or [])
            rows[s["batch_size"]] = (max(ulp, s["max_ulp"]),
                                     d if div is None else (div if d is None else min(div, d)),
                                     hits)
    return sorted((n, u, d, hits or (1 if n in listed else 0))
                  for n, (u, d, hits) in rows.items())


def shade_buckets(ax, graph_sizes, top):
    previous = 0
    for i, b in enumerate(sorted(graph_sizes or [])):
        if b > top:
            break
        ax.axvspan(previous + 0.5, b + 0.5, color="0.9" if i % 2 else "0.82", zorder=0, lw=0)
        previous = b


def figure(docs, paths):
    """The chart as a matplotlib figure; the title and the legend (one line a file, named by
    its base name) sit outside both axes, so neither covers a point or the other."""
    plt = labplot.pyplot()
    from matplotlib.ticker import FuncFormatter

    fig, (ax_ulp, ax_div) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True,
                                         gridspec_kw={"height_ratios": [3, 2]})
    top = max(n for doc in docs for n, _, _, _ in per_size(doc))
    for ax in (ax_ulp, ax_div):
        shade_buckets(ax, (docs[0].get("server") or {}).get("graph_sizes"), top)
    max_tokens = max(doc["params"]["max_tokens"] for doc in docs)
    for i, (doc, path) in enumerate(zip(docs, paths)):
        # Files side by side within a size, so one file's markers never hide another's.
        shifted = [(n + 0.22 * (i - (len(docs) - 1) / 2.0), u, d, hits)
                   for n, u, d, hits in per_size(doc)]
        # a size the cache served is no batch effect: a grey cross, apart from the points
        cached = [(n, u, d) for n, u, d, hits in shifted if hits]
        rows = [(n, u, d) for n, u, d, hits in shifted if not hits]
        ax_ulp.plot([n for n, _, _ in cached], [u if u > 0 else ZERO_LINE for _, u, _ in cached],
                    "x", color="0.45", ms=8)
        ax_div.plot([n for n, _, _ in cached], [max_tokens if d is None else d
                                                for _, _, d in cached], "x", color="0.45", ms=8)
        colour = "C%d" % i
        sizes = [n for n, _, _ in rows]
        ulps = [u if u > 0 else ZERO_LINE for _, u, _ in rows]
        ax_ulp.plot(sizes, ulps, "-", color=colour, alpha=0.5)
        ax_ulp.plot([n for n, u, _ in rows if u > 0], [u for _, u, _ in rows if u > 0], "o", color=colour,
                    label=label(doc, path))
        ax_ulp.plot([n for n, u, _ in rows if u == 0], [ZERO_LINE] * sum(1 for _, u, _ in rows if u == 0),
                    "o", mfc="white", color=colour)
        held = [n for n, _, d in rows if d is None]
        ax_div.plot([n for n, _, d in rows if d is not None], [d for _, _, d in rows if d is not None],
                    "s", color=colour)
        ax_div.plot(held, [max_tokens] * len(held), "s", mfc="white", color=colour)
    ax_ulp.set_yscale("log", base=2)
    # whole numbers of ULP in full (1048576, not 1.04858e+06)
    ax_ulp.yaxis.set_major_formatter(FuncFormatter(
        lambda v, _: "0" if v == ZERO_LINE else "%d" % v if v >= 1 else "%g" % v))
    ax_ulp.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax_ulp.axhline(ZERO_LINE, color="0.5", lw=0.6, ls=":")
    # what the markers mean goes in the axis labels: a text inside the axes sits on markers
    ax_ulp.set_ylabel("max ULP vs batch 1 (float32, log scale;\nopen at the dotted line: 0)",
                      fontsize=9)
    fig.suptitle("Batch invariance sweep: logprob distance and token divergence per batch size", fontsize=11)
    ax_ulp.set_ylim(ZERO_LINE / 1.5,
                    max([2.0] + [u for doc in docs for _, u, _, _ in per_size(doc)]) * 2.5)
    fig.legend(*ax_ulp.get_legend_handles_labels(), fontsize=8, loc="lower center", frameon=False)
    ax_div.set_ylim(-2, max_tokens + 4)
    ax_div.set_ylabel("first token divergence (step;\nopen at the top: every token held)",
                      fontsize=9)
    ax_div.set_xlabel("batch size (shaded: CUDA-graph buckets of %s)\ngrey x: the prefix cache "
                      "served requests at that size, so it compares the cache, not the batch"
                      % server_name(docs[0]), fontsize=9)
    fig.tight_layout(rect=(0, 0.035 * len(docs) + 0.01, 1, 1))
    return fig


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def load(path):
    """A sweep file, refused in one line naming what is wrong with it where it lacks what
    the picture reads: its summary, its params' max_tokens, and per prompt its batch sizes,
    each with its batch size, largest ULP and first divergence."""
    doc = labplot.load(path, SWEEP_SCHEMAS, "sweep")
    if not isinstance(doc.get("summary"), dict):
        raise ValueError("%s: its summary is %s, not the sweep's summary (an object): not a "
                         "sweep file run.py saved" % (path, json_type(doc.get("summary"))))
    params = doc.get("params")
    if not isinstance(params, dict) or not is_number(params.get("max_tokens")):
        raise ValueError("%s: its params hold no max_tokens: not a sweep file run.py saved"
                         % path)
    prompts = doc.get("prompts")
    if not isinstance(prompts, list):
        raise ValueError("%s: it holds no prompts (the list of each prompt's batch sizes, "
                         "found %s): not a sweep file run.py saved" % (path, json_type(prompts)))
    for i, prompt in enumerate(prompts, 1):
        sizes = prompt.get("sizes") if isinstance(prompt, dict) else None
        if not isinstance(sizes, list) or not all(
                isinstance(s, dict) and is_number(s.get("batch_size")) and is_number(
                    s.get("max_ulp")) and (s.get("first_token_divergence") is None
                                           or is_number(s.get("first_token_divergence")))
                for s in sizes):
            raise ValueError("%s: prompt %d has no list of batch sizes, each with batch_size, "
                             "max_ulp and first_token_divergence: not a sweep file run.py saved"
                             % (path, i))
    if not any(prompt["sizes"] for prompt in prompts):
        raise ValueError("%s: no batch size was measured yet (the sweep is %s): nothing to "
                         "draw" % (path, doc["summary"].get("state") or "not complete"))
    return doc


def json_type(value):
    """How JSON names a value's type: null, a list, a number, ..."""
    if value is None:
        return "null"
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    return next((name for kind, name in names.items() if isinstance(value, kind)), "a number")


def plot(paths, out):
    plt = labplot.pyplot()
    fig = figure([load(p) for p in paths], paths)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description="Plot sweep files into one PNG.")
    p.add_argument("files", nargs="+", help="sweep files written by run.py --mode sweep --save")
    p.add_argument("-o", "--output", required=True, help="the PNG to write")
    args = p.parse_args(argv)
    return labplot.run("plot_sweep.py", args.output, lambda: plot(args.files, args.output))


if __name__ == "__main__":
    sys.exit(main())
