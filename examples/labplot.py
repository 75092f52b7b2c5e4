# SPDX-License-Identifier: Apache-2.0
"""What plot_sweep.py and plot_cost.py share: reading a lab file of the right kind, the
matplotlib check with its install hint, and one-line errors with exit code 2."""

import json
import sys


def read(path):
    """A JSON object from a file: what run.py --save writes or --json prints."""
    with open(path, encoding="utf-8") as f:
        try:
            doc = json.load(f)
        except RecursionError:
            raise ValueError("%s is nested deeper than any lab file" % path) from None
    if not isinstance(doc, dict):
        raise ValueError("%s is not a lab file (it holds a JSON %s)" % (path, type(doc).__name__))
    return doc


def load(path, schemas, kind):
    """A lab save file, refused unless it holds `kind` results (its "schema" field, one of schemas)."""
    doc = read(path)
    if doc.get("schema") not in schemas:
        raise ValueError("%s is not a %s file (schema %r)" % (path, kind, doc.get("schema")))
    return doc


def named(doc):
    """A result's --label and --metadata as run.py saved them ("" where it has neither)."""
    label = doc.get("label") if isinstance(doc.get("label"), str) else ""
    metadata = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    facts = ", ".join("%s=%s" % item for item in metadata.items())
    return " ".join(part for part in (label, "[%s]" % facts if facts else "") if part)


def pyplot():
    """matplotlib.pyplot drawing to files only (no screen needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def run(name, output, draw):
    """Call draw(); report success, a missing matplotlib or a bad input file; return the exit code."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.stderr.write("%s: needs matplotlib: pip install matplotlib\n" % name)
        return 2
    try:
        draw()
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError,
            OverflowError) as err:
        # a file of another shape than the lab writes (a number too large to draw, say): one
        # line, never a traceback
        sys.stderr.write("%s: %s (%s)\n" % (name, str(err)[:300], type(err).__name__))
        return 2
    return said("wrote %s" % output)


def said(line):
    """Print the closing line; a full disk or a closed pipe is one line on stderr and exit 74
    (the picture is written)."""
    try:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except OSError:
        quiet_stdout()
        return 74
    return 0


def quiet_stdout():
    """stdout could not be written: point it at /dev/null, so that exiting does not fail again
    flushing what is left."""
    import os
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except OSError:
        pass
