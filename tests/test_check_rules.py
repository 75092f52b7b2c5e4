"""The rules no sweep check may break, held over every entry of run.py's SWEEP_CHECKS against
every relevant fault of the practice engine: no "held", "equal" or "invariant" where nothing
was compared (and "nothing compared" where no part did); "held" only with something compared;
a check that compares runs blames nothing it varied where the seed is not honoured; where
the fault leaves nothing comparable (the cache served every prompt), "nothing compared",
whatever the check counted. A new check is covered by being listed in SWITCHED_ON (the test
fails until it is)."""

import re
import types
import unittest
from unittest import mock

from support import StubConfig, StubServer, TempDirTest, run, run_lab

# How each check of SWEEP_CHECKS is switched on, by its NAME
SWITCHED_ON = {
    "cache_check": ("--cache-check", "--traffic", "copies"),
    "prefill": ("--prefill-check",),
    "neighbours": ("--neighbours", "16,64"),
    "observer": ("--observer-check",),
}

# The practice engine's faults: (its settings, the sweep's own options); each check meets all
FAULTS = {
    "none (flag on)": (dict(invariant=True), ()),
    "none (flag off)": (dict(), ()),
    "cache serves every prompt": (dict(cache_serves="all", prompt_tokens_details=True), ()),
    # the answers count no hit; only the server's own counters (/metrics) see them
    "cache serves every prompt, uncounted": (dict(cache_serves="all", prompt_tokens_details=True,
                                                  uncounted_cache_hits=True), ()),
    "cache serves half of each request": (dict(cache_serves="some", prompt_tokens_details=True), ()),
    "cache serves one item": (dict(engine="sglang", cache_serves="one"), ()),
    "seed ignored, said (SGLang flag off)": (dict(engine="sglang"), ("--temperature", "0.8")),
    "seed ignored, not said": (dict(ignore_seed=True), ("--temperature", "0.8")),
    "top logprobs above 5 refused": (dict(max_logprobs=5), ()),
    "no prefix cache": (dict(prefix_caching=False, prompt_tokens_details=True), ()),
}
# Faults under which no run can be compared, whatever a check counts: the prefix cache served
# every prompt, batch 1 and every check's own requests (and their controls) included. The rules
# are held against what the fault leaves, not against what the check says it compared.
NOTHING_COMPARABLE = {"cache serves every prompt", "cache serves every prompt, uncounted"}
CLAIMS = re.compile(r"\b(held|equal|equals|invariant|agree)\b")
UNMEASURED = ("nothing compared", "not measured", "no data")


def summaries_of(argv):
    """(the run's result, the last sweep summary it made): the check records themselves."""
    made = []
    real = run.sweep_summary

    def keep(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    with mock.patch.object(run, "sweep_summary", keep):
        result = run_lab(*argv)
    return result, made[-1] if made else None


def broken_rules(record, fault_unseeded, comparable=True):
    """The rules a check's summary record breaks, each as a line (comparable False: the fault
    left nothing to compare, whatever the record counts)."""
    broken, verdict = [], record.verdict
    if not comparable:
        if not verdict.startswith(UNMEASURED):
            broken.append("nothing was comparable, and it does not say so: %r" % verdict)
        if record.held:
            broken.append("its --expect holds where nothing was comparable")
        if record.compared:
            broken.append("counts %d compared where nothing was comparable" % record.compared)
    if not record.compared:
        if CLAIMS.search(verdict):
            broken.append("claims %r having compared nothing" % verdict)
        if not verdict.startswith(UNMEASURED):
            broken.append("compared nothing and does not say so: %r" % verdict)
        if record.held:
            broken.append("its --expect holds having compared nothing")
    if record.held and not record.compared:
        broken.append("held with nothing compared")
    if fault_unseeded and getattr(record, "COMPARES_RUNS", False) and not verdict.startswith(
            UNMEASURED) and record.verdict not in (run.SEED_NOT_HONOURED, run.CONTROL_MOVED):
        if not record.held:  # what moved was put down to what the check varied
            broken.append("blames what it varied where the seed is not honoured: %r" % verdict)
    return broken


class EveryCheckKeepsTheRules(TempDirTest):
    def test_every_check_is_listed(self):
        self.assertEqual(set(SWITCHED_ON), {kind.NAME for kind in run.SWEEP_CHECKS})

    def test_every_check_against_every_fault(self):
        for kind in run.SWEEP_CHECKS:
            for fault, (config, options) in FAULTS.items():
                self.assertIn(kind.NAME, SWITCHED_ON, "list how to switch it on")
                with self.subTest(check=kind.NAME, fault=fault), StubServer(
                        StubConfig(scheduler_window=0.05, **config)) as stub:
                    r, summary = summaries_of(
                        ["--mode", "sweep", "--engine", stub.config.engine, "--url", stub.url,
                         "--sizes", "1,2", "--repeat", 2, "--max-tokens", 12,
                         *options, *SWITCHED_ON[kind.NAME]])
                    self.assertNotIn("Traceback", r.stderr)
                    self.assertIsNotNone(summary, r)
                    record = summary.checks.get(kind.NAME)
                    self.assertIsNotNone(record, r)
                    unseeded = "--temperature" in options
                    comparable = fault not in NOTHING_COMPARABLE
                    self.assertEqual(broken_rules(record, unseeded, comparable), [],
                                     r.stdout[-2000:])


class ACheckTheServerRefuses(TempDirTest):
    def test_every_check_ends_with_its_reason_and_the_sweep_goes_on(self):
        # the first request after batch 1's is each check's own: the server answers it 500
        for kind in run.SWEEP_CHECKS:
            with self.subTest(check=kind.NAME), StubServer(StubConfig(
                    scheduler_window=0.05, prompt_tokens_details=True, faults={2: "http500"})) as stub:
                r, summary = summaries_of(
                    ["--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--repeat", 1,
                     "--max-tokens", 8, "--save", self.path(kind.NAME + ".json"),
                     *SWITCHED_ON[kind.NAME]])
                self.assertEqual(r.code, 0, r)
                doc = self.load(kind.NAME + ".json")
                self.assertEqual([s["batch_size"] for s in doc["prompts"][0]["sizes"]], [1, 2])
                record = summary.checks[kind.NAME]
                self.assertIn("the server could not serve it", record.verdict)
                self.assertFalse(record.held)
                self.assertIn("stops", r.stderr)


class RunsComparedWithTheirControl(TempDirTest):
    def test_a_server_that_ignores_the_seed_is_named_not_the_neighbours_nor_logprobs(self):
        # SGLang, flag off, ignores sampling_seed (the lab warns): runs differ by sampling
        with StubServer(StubConfig(engine="sglang", scheduler_window=0.05)) as stub:
            r = run_lab("--mode", "sweep", "--engine", "sglang", "--url", stub.url, "--sizes", "1,2",
                        "--repeat", 1, "--max-tokens", 16, "--temperature", "0.8",
                        "--neighbours", "16,64", "--observer-check", "--json")
        summary = r.json()["summary"]
        self.assertNotIn("moved beside neighbours", summary["neighbours_verdict"])
        self.assertNotIn("the text changed", summary["observer_verdict"])
        for verdict in (summary["neighbours_verdict"], summary["observer_verdict"]):
            self.assertIn("seed", verdict)

    def test_a_control_that_moved_is_named_where_the_lab_thinks_the_seed_honoured(self):
        with StubServer(StubConfig(ignore_seed=True, scheduler_window=0.05)) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--repeat", 1,
                        "--max-tokens", 16, "--temperature", "0.8", "--neighbours", "16,64",
                        "--observer-check", "--json")
        summary = r.json()["summary"]
        self.assertEqual(summary["neighbours_verdict"], run.CONTROL_MOVED)
        self.assertEqual(summary["observer_verdict"], run.CONTROL_MOVED)
        self.assertLess(summary["neighbours_control_equal"], summary["neighbours_control_runs"])


class PartsThatComparedNothing(unittest.TestCase):
    def test_a_length_the_cache_served_every_run_of_is_not_held(self):
        # 16 tokens: both runs compared and equal; 64: the cache served both (the old record
        # counted them with the runs no neighbour overlapped)
        rows = [run.NeighbourRow([run.NeighbourLength(16, 2, 2, None, 0, 0.0, 0),
                                  run.NeighbourLength(64, 0, 0, None, 0, 0.0, 2)])]
        summary = run.NeighbourSummary.of(rows, None)
        self.assertNotEqual(summary.verdict, "held beside every neighbour length")
        self.assertIn("64 tokens: nothing compared", summary.verdict)
        check = run.NeighbourCheck([16, 64])
        expect = types.SimpleNamespace(checks={"neighbours": summary})
        found = (run.check_expectation(check, "neighbours-equal", expect)
                 if hasattr(run, "check_expectation") else check.expectation("neighbours-equal", expect))
        held, line = found
        self.assertFalse(held)
        self.assertIn("expectation failed", line)


class ASweepForItsChecks(TempDirTest):
    def test_batch_1_alone_with_checks_reads_as_a_run_of_its_checks(self):
        with StubServer(StubConfig(invariant=True, scheduler_window=0.05)) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1", "--repeat", 1,
                        "--max-tokens", 8, "--neighbours", "16", "--observer-check")
        self.assertEqual(r.code, 0, r)
        self.assertNotIn("No verdict on invariance can be given", r.stdout)
        self.assertIn("this sweep ran for its checks", r.stdout)
        self.assertIn("neighbour check: held beside every neighbour length", r.stdout)


class TheCheckInterface(unittest.TestCase):
    def test_it_has_at_most_eight_members(self):
        members = [name for name, value in vars(run.SweepCheck).items()
                   if not name.startswith("__")]
        self.assertLessEqual(len(members), 8, members)


class FirstMovedSaysWhat(TempDirTest):
    def test_the_neighbour_line_names_what_first_moved(self):
        with StubServer(StubConfig(scheduler_window=0.05)) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1", "--repeat", 1,
                        "--max-tokens", 16, "--neighbours", "64")
        line = next(l for l in r.stdout.splitlines() if l.startswith("neighbour check, 64 tokens"))
        self.assertRegex(line, r"(logprobs|tokens) first moved at step \d+")


if __name__ == "__main__":
    unittest.main()
