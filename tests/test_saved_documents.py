"""The saved documents keep their shape: a sweep and a cost run against the practice engine,
saved now, equal field by field the documents the lab saved for the same runs at version
0.9.0 (tests/fixtures/saved/, written by `python3 tests/test_saved_documents.py --write
PATH/TO/run.py`), apart from what differs from run to run by nature: times, the server's
address, the command line. A change to the schema shows here, and must be documented.
"""

import contextlib
import importlib.util
import io
import json
import os
import sys
import tempfile
import unittest
from unittest import mock

from support import HERE, StubConfig, StubServer
from stub_server import VirtualClock

SAVED = os.path.join(HERE, "fixtures", "saved")
# What differs from run to run by nature: wall-clock times, the practice engine's port (in
# every URL), the command line and the lab's own version (in "lab")
UNCOMPARED = {"created", "ended", "seconds", "send_spread_s", "url", "lab"}


def saved_by(run_module, mode, tmp):
    """The document run_module saves for this mode's run against fresh practice engines."""
    path = os.path.join(tmp, "%s.json" % mode)
    out = io.StringIO()
    if mode == "sweep":
        with StubServer() as stub, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = run_module.main(["--mode", "sweep", "--url", stub.url, "--sizes", "1,2,3,17",
                                    "--repeat", "2", "--max-tokens", "8", "--prefill-check",
                                    "--save", path])
    else:
        clock = VirtualClock()
        with mock.patch.object(run_module, "CLOCK", clock), \
                StubServer(StubConfig(step_delay=0.01, jitter=0.05, seed=1, clock=clock)) as off, \
                StubServer(StubConfig(invariant=True, step_delay=0.01, slowdown=1.2, jitter=0.05,
                                      seed=2, clock=clock)) as on, \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = run_module.main(["--mode", "cost", "--url", off.url, "--invariant", on.url,
                                    "--batch", "2", "--trials", "6", "--warmup", "1", "--max-tokens",
                                    "4", "--save", path])
    assert code == 0, out.getvalue()
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def differences(saved, now, where="$"):
    """Where two documents differ, field by field, apart from the UNCOMPARED keys."""
    if isinstance(saved, dict) and isinstance(now, dict):
        found = ["%s.%s: only in the saved document" % (where, k) for k in saved.keys() - now.keys()]
        found += ["%s.%s: only in the new document" % (where, k) for k in now.keys() - saved.keys()]
        if list(saved) != [k for k in now if k in saved]:
            found.append("%s: the keys are in another order" % where)
        for key in saved.keys() & now.keys():
            if key not in UNCOMPARED:
                found += differences(saved[key], now[key], "%s.%s" % (where, key))
        return found
    if isinstance(saved, list) and isinstance(now, list) and len(saved) == len(now):
        return [d for i, (a, b) in enumerate(zip(saved, now)) for d in differences(a, b, "%s[%d]" % (where, i))]
    return [] if saved == now and type(saved) is type(now) else ["%s: %r, now %r" % (where, saved, now)]


class SavedDocumentsKeepTheirShape(unittest.TestCase):
    def check(self, mode):
        import run
        with open(os.path.join(SAVED, "%s.json" % mode), encoding="utf-8") as f:
            saved = json.load(f)
        with tempfile.TemporaryDirectory() as tmp:
            now = saved_by(run, mode, tmp)
        self.assertEqual(differences(saved, now), [])

    def test_a_sweep_document(self):
        self.check("sweep")

    def test_a_cost_document(self):
        self.check("cost")

    def test_the_comparison_sees_a_changed_field(self):
        doc = {"summary": {"max_ulp": 3, "created": "x"}, "prompts": [{"verdict": "a"}]}
        changed = json.loads(json.dumps(doc))
        changed["prompts"][0]["verdict"] = "b"
        changed["summary"]["created"] = "y"
        self.assertEqual(differences(doc, changed), ["$.prompts[0].verdict: 'a', now 'b'"])


def write(run_path):
    """Save both documents with the run.py at run_path, as the fixtures to compare with."""
    spec = importlib.util.spec_from_file_location("saved_run", run_path)
    module = sys.modules["saved_run"] = importlib.util.module_from_spec(spec)  # for dataclasses
    spec.loader.exec_module(module)
    os.makedirs(SAVED, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("sweep", "cost"):
            doc = saved_by(module, mode, tmp)
            with open(os.path.join(SAVED, "%s.json" % mode), "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=1)
                f.write("\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        write(sys.argv[2])
    else:
        unittest.main()
