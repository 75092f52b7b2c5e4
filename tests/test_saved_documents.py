"""The saved documents keep their shape: sweeps and cost runs against the practice engine
(CASES), saved now, equal field by field the documents an earlier lab saved for the same runs
(tests/fixtures/saved/: sweep.json and cost.json from version 0.9.0, the others from the
version after it, each written by `python3 tests/test_saved_documents.py --write
PATH/TO/run.py`), apart from what differs from run to run by nature: times, the practice
engines' addresses, the command line. A change to the schema shows here, and must be
documented.
"""

import contextlib
import importlib.util
import io
import json
import os
import re
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
ADDRESS = re.compile(r"http://127\.0\.0\.1:\d+")  # a practice engine's, inside a text


def sweep_run(*argv, stub=None, baseline_stub=None):
    """A sweep case: argv after --url, against a fresh practice engine (and a second one as
    --baseline's server where asked)."""
    def run_case(run_module, path, out):
        with contextlib.ExitStack() as stack:
            server = stack.enter_context(StubServer(stub or StubConfig()))
            extra = []
            if baseline_stub is not None:
                other = stack.enter_context(StubServer(baseline_stub))
                extra = ["--baseline", other.url]
            stack.enter_context(contextlib.redirect_stdout(out))
            stack.enter_context(contextlib.redirect_stderr(out))
            return run_module.main(["--mode", "sweep", "--url", server.url] + list(argv) + extra
                                   + ["--save", path])
    return run_case


def cost_run(*argv, streamed=False):
    """A cost case: argv after the two arms' URLs, against a flag-off and a flag-on practice
    engine on one virtual clock (so the times are the same on every run). Streamed answers
    are paced in real time, so a load case runs on the real clock (its times then differ from
    run to run: LOOSE)."""
    def run_case(run_module, path, out):
        clock = None if streamed else VirtualClock()
        with mock.patch.object(run_module, "CLOCK", clock or run_module.CLOCK), \
                StubServer(StubConfig(step_delay=0.01, jitter=0.05, seed=1, clock=clock)) as off, \
                StubServer(StubConfig(invariant=True, step_delay=0.01, slowdown=1.2, jitter=0.05,
                                      seed=2, clock=clock)) as on, \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            return run_module.main(["--mode", "cost", "--url", off.url, "--invariant", on.url]
                                   + list(argv) + ["--save", path])
    return run_case


# Every saved document a fixture pins: its name, and the run that saves it
CASES = {
    "sweep": sweep_run("--traffic", "copies", "--sizes", "1,2,3,17", "--repeat", "2", "--max-tokens", "8",
                       "--prefill-check"),
    "sweep-cache-check": sweep_run("--traffic", "copies", "--sizes", "1,3", "--max-tokens", "6", "--cache-check",
                                   stub=StubConfig(prompt_tokens_details=True)),
    "sweep-mixed": sweep_run("--sizes", "1,5", "--traffic", "mixed", "--max-tokens", "6",
                             "--prefix-cache", "keep", "--temperature", "0.7", "--seed", "3"),
    "sweep-baseline-server": sweep_run("--traffic", "copies", "--sizes", "1,4", "--max-tokens", "6",
                                       stub=StubConfig(invariant=True),
                                       baseline_stub=StubConfig(invariant=True, tp_size=2,
                                                                rotation_offset=3)),
    "cost": cost_run("--batch", "2", "--trials", "6", "--warmup", "1", "--max-tokens", "4"),
    "cost-shared-prefix": cost_run("--batch", "3", "--trials", "3", "--warmup", "0",
                                   "--max-tokens", "3", "--workload", "shared-prefix",
                                   "--prefix-tokens", "40", "--precision", "50",
                                   "--allow-mismatch"),
    "cost-load": cost_run("--concurrency", "2", "--requests", "4", "--trials", "3", "--warmup",
                          "0", "--max-tokens", "3", streamed=True),
}
LOOSE = {"cost-load"}  # cases timed on the real clock: any float stands for any other


def saved_by(run_module, name, tmp):
    """The document run_module saves for this case's run against fresh practice engines."""
    path = os.path.join(tmp, "%s.json" % name)
    out = io.StringIO()
    code = CASES[name](run_module, path, out)
    assert code == 0, out.getvalue()
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def differences(saved, now, where="$", loose=False):
    """Where two documents differ, field by field, apart from the UNCOMPARED keys (and, loose,
    the values of floats)."""
    if isinstance(saved, dict) and isinstance(now, dict):
        found = ["%s.%s: only in the saved document" % (where, k) for k in saved.keys() - now.keys()]
        found += ["%s.%s: only in the new document" % (where, k) for k in now.keys() - saved.keys()]
        if list(saved) != [k for k in now if k in saved]:
            found.append("%s: the keys are in another order" % where)
        for key in saved.keys() & now.keys():
            if key not in UNCOMPARED:
                found += differences(saved[key], now[key], "%s.%s" % (where, key), loose)
        return found
    if isinstance(saved, list) and isinstance(now, list) and len(saved) == len(now):
        return [d for i, (a, b) in enumerate(zip(saved, now))
                for d in differences(a, b, "%s[%d]" % (where, i), loose)]
    if loose and type(saved) is float and type(now) is float:
        return []
    if isinstance(saved, str) and isinstance(now, str):
        saved, now = ADDRESS.sub("ADDRESS", saved), ADDRESS.sub("ADDRESS", now)
    return [] if saved == now and type(saved) is type(now) else ["%s: %r, now %r" % (where, saved, now)]


class SavedDocumentsKeepTheirShape(unittest.TestCase):
    def test_every_case(self):
        import run
        for name in CASES:
            with self.subTest(name), tempfile.TemporaryDirectory() as tmp:
                with open(os.path.join(SAVED, "%s.json" % name), encoding="utf-8") as f:
                    saved = json.load(f)
                now = saved_by(run, name, tmp)
                self.assertEqual(differences(saved, now, loose=name in LOOSE), [])

    def test_the_comparison_sees_a_changed_field(self):
        doc = {"summary": {"max_ulp": 3, "created": "x"}, "prompts": [{"verdict": "a"}]}
        changed = json.loads(json.dumps(doc))
        changed["prompts"][0]["verdict"] = "b"
        changed["summary"]["created"] = "y"
        self.assertEqual(differences(doc, changed), ["$.prompts[0].verdict: 'a', now 'b'"])


def write(run_path, names=()):
    """Save the named cases' documents (every case's where none is named) with the run.py at
    run_path, as the fixtures to compare with."""
    spec = importlib.util.spec_from_file_location("saved_run", run_path)
    module = sys.modules["saved_run"] = importlib.util.module_from_spec(spec)  # for dataclasses
    spec.loader.exec_module(module)
    os.makedirs(SAVED, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names or CASES:
            doc = saved_by(module, name, tmp)
            with open(os.path.join(SAVED, "%s.json" % name), "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=1)
                f.write("\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        write(sys.argv[2], sys.argv[3:])
    else:
        unittest.main()
