#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Two saved lab results side by side, with what changed (benchstat's old, new, delta layout).

    python3 examples/compare.py before.json after.json     # two sweeps, or two cost files

Sweeps: the servers' settings (only those that differ) and known hazards, the parameters, the
summary with every check's verdict (the neighbour and observer checks' parts one by one) and
the drift in nats, and every batch size both measured, with the requests the prefix cache
served there. Cost files (or cells printed with --json): every cell either file holds, matched
by everything it was measured under (run.py's own CellIdentity), else by all but the engine's
release and the settings it changes by itself, so that one cell before and after an engine
upgrade is one row, each of two backends its own (matched_cells): its overhead, interval and
significance, and each part of the identity that changed (the release among them). Standard
library only. Exit codes: 0 printed, 2 a file that is not a lab result, or two of different
kinds.
"""

import dataclasses
import io
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import run  # noqa: E402  (run.py: what makes two cost cells the same measurement)

SWEEP_SCHEMAS = run.SWEEP_SCHEMAS_READ  # what the run.py beside it reads back
COST_SCHEMAS = (run.COST_SCHEMA,)
SUMMARY_FIELDS = ("verdict", "unique_completions", "total_completions", "moved", "max_ulp",
                  "max_nats",
                  "flip_risk", "batch1_repeatable", "first_moved", "served_sizes", "state",
                  "prefix_cache_bypass", "prefill_verdict", "prefill_max_ulp", "prefill_divergent",
                  "prefill_kl_mean")
SIZE_FIELDS = ("max_ulp", "max_nats", "first_token_divergence", "distinct_in_batch",
               "same_as_baseline", "served", "cached_tokens")


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


def named_rows(a, b, prefix=""):
    """Rows of the results' --label and --metadata, where either holds one."""
    rows = []
    for key in ("label", "metadata"):
        if a.get(key) is not None or b.get(key) is not None:
            rows.append((prefix + key, a.get(key), b.get(key)))
    return rows


def compare_sweeps(a, b, out):
    table("result (its label and metadata)", named_rows(a, b), out)
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
    table("summary", [(k, ma.get(k), mb.get(k)) for k in summary_fields(ma, mb)], out)
    table("checks, part by part", check_parts(ma, mb), out)
    sizes = lambda doc: {s["batch_size"]: dict(s, served=served(s))
                         for s in first_prompt(doc).get("sizes") or []}
    za, zb = sizes(a), sizes(b)
    rows = [("batch %d %s" % (n, k), za[n].get(k), zb[n].get(k))
            for n in sorted(set(za) & set(zb)) for k in SIZE_FIELDS]
    table("batch sizes both measured (first prompt of each)", rows, out)
    only = sorted(set(za) ^ set(zb))
    if only:
        out.write("\nbatch sizes in one file only: %s\n" % ",".join(map(str, only)))


def summary_fields(ma, mb):
    """The summary's fields both files may hold, and every check's verdict either holds (each
    check saves its own as <check>_verdict)."""
    verdicts = [k for k in list(ma) + [k for k in mb if k not in ma]
                if k.endswith("_verdict") and k not in SUMMARY_FIELDS]
    return [k for k in SUMMARY_FIELDS + tuple(verdicts) if k in ma or k in mb]


# The checks whose summary holds one part a row: (summary key, what names a part, its label)
CHECK_PARTS = (("neighbours_lengths", "length", "neighbours of %s tokens"),
               ("observer_settings", "logprobs", "observer, logprobs %s"))


def check_parts(ma, mb):
    """Rows of the neighbour and observer checks: each part's runs equal to the lone run, and
    its drift where it saves one."""
    rows = []
    for key, name, label in CHECK_PARTS:
        parts = [{p.get(name): p for p in (m.get(key) or []) if isinstance(p, dict)}
                 for m in (ma, mb)]
        for part in sorted(set(parts[0]) | set(parts[1]), key=str):
            old, new = parts[0].get(part) or {}, parts[1].get(part) or {}
            rows.append((label % part + " equal", equal_of(old), equal_of(new)))
            if "max_nats" in old or "max_nats" in new:
                rows.append((label % part + " max nats", old.get("max_nats"), new.get("max_nats")))
    return rows


def equal_of(part):
    """"equal of runs" of a check's part, or None where the file has no such part."""
    if "runs" not in part:
        return None
    return "%s of %s" % (part.get("equal"), part.get("runs"))


def served(size):
    """Requests the prefix cache served at a size, over its passes (None: none said so)."""
    counts = [r.get("served") for r in size.get("runs") or [] if isinstance(r, dict)]
    counts = [c for c in counts if isinstance(c, int) and not isinstance(c, bool)]
    return sum(counts) if counts else None


def hazard_names(server):
    """The known hazards a server's settings met, by the setting each is of (None: the server
    hid its settings)."""
    hazards = server.get("hazards")
    if not isinstance(hazards, list):
        return None
    return ",".join(str(h.get("setting") if isinstance(h, dict) else h)
                    for h in hazards) or "none"


def first_prompt(doc):
    """A sweep's first prompt (the one the size table compares), as saved."""
    prompts = doc.get("prompts") or [{}]
    return prompts[0]


def with_key_settings(identity):
    """An identity less the releases, holding of the reported settings only those users
    compare cells on (run.KEY_SETTINGS: attention backend, dtype, ...): what tells two cells
    of one file apart across an engine upgrade, which changes the other settings by itself."""
    return dataclasses.replace(
        identity.across_releases(),
        settings=tuple(s for s in identity.settings if s[0] in run.KEY_SETTINGS))


def matched_cells(a, b):
    """The cells of two cost documents as rows [(name, old cell or None, new cell or None)].
    A cell is matched by its whole identity (cells of one release); then, across an engine
    upgrade, by its identity less the release with the settings users compare
    (with_key_settings), so that each of two backends measured before and after an upgrade
    meets its own; then by the identity less the release and every reported setting
    (run.CellIdentity.across_releases), where that leaves one cell a side. A cell matched by
    none is a row of its own: no cell hides another."""
    left = [[c for c in doc.get("cells") or [] if isinstance(c, dict)] for doc in (a, b)]
    # settings an earlier lab did not read are unknown, not changed
    read = run.settings_read_by_all(left[0] + left[1])
    rows = []
    for level in (lambda c: run.cell_key(c, read),
                  lambda c: with_key_settings(run.cell_key(c, read)),
                  lambda c: run.cell_key(c).across_releases()):
        keys = [[level(c) for c in side] for side in left]
        pairs = [(old, new) for old, k in zip(left[0], keys[0]) for new, m in zip(left[1], keys[1])
                 if k == m and keys[0].count(k) == 1 and keys[1].count(k) == 1]
        rows.extend(pairs)
        left = [[c for c in left[0] if all(c is not old for old, _ in pairs)],
                [c for c in left[1] if all(c is not new for _, new in pairs)]]
    rows.extend([(c, None) for c in left[0]] + [(None, c) for c in left[1]])
    # each row named by the least that tells it from the others
    namings = (lambda k: k.across_releases().text(release=False),
               lambda k: with_key_settings(k).text(release=False),
               lambda k: k.text(sorted({s[0] for s in k.settings})))
    keys = [run.cell_key(new if new is not None else old, read) for old, new in rows]
    names = [namings[0](k) for k in keys]
    for naming in namings[1:]:
        names = [naming(k) if names.count(name) > 1 else name for k, name in zip(keys, names)]
    return sorted(zip(names, (old for old, _ in rows), (new for _, new in rows)),
                  key=lambda row: row[0])


def compare_costs(a, b, out):
    rows = []
    for name, old, new in matched_cells(a, b):
        old, new = old or {}, new or {}
        rows.append((name + " overhead %", old.get("overhead_pct"), new.get("overhead_pct")))
        rows.append((name + " 95% interval", old.get("ci95_pct"), new.get("ci95_pct")))
        rows.append((name + " significant", old.get("significant"), new.get("significant")))
        rows.extend(named_rows(old, new, name + " "))
        if old and new:  # what changed between the two cells, the release among it
            read = run.settings_read_by_all([old, new])
            before, after = run.cell_key(old, read), run.cell_key(new, read)
            rows.extend((name + " " + part, before.parts().get(part), after.parts().get(part))
                        for part in before.differing(after))
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
