"""The rules no sweep check may break, held over every entry of run.py's SWEEP_CHECKS against
what the practice engine made move, never against the check's own account of it:

- where what the check varies moves, it says "moved", and the step and kind it says first
  moved are the ones the engine's own record of what it computed shows (GET /stub/served);
- where only run-to-run noise moves (a seed the server ignores), it does not blame what it
  varied, whether or not its record declares that it compares runs;
- where nothing moves, "held";
- where the cache serves every prompt (counted or not), "uncompared";
- where the server refuses or fails the check's request, "stopped", never "equal";
- its verdict and lines never hold the API key the run was given;
- and, under every other fault: no "held", "equal" or "invariant" where nothing was
  compared.

A new check is covered by being listed in LISTED (the test fails until it is).
The wrong checks at the end are kept as tests that must fail these rules."""

import json
import re
import types
import unittest
import urllib.request
from unittest import mock

from support import StubConfig, StubServer, TempDirTest, run, run_lab

# Every check of SWEEP_CHECKS, by its NAME: how it is switched on, and how the practice
# engine moves what it varies and nothing else it compares (QUIET: the flag on, decode equal
# to prefill, apart from the one switch)
QUIET = dict(invariant=True, prefill_agrees=True)
LISTED = {
    "cache_check": (("--cache-check", "--traffic", "copies"),
                    dict(QUIET, cache_path_differs=True, prompt_tokens_details=True)),
    # a prefill reduces in its own order
    "prefill": (("--prefill-check",), dict(invariant=True)),
    # flag off: a 64-token neighbour moves a decode, a 16-token one does not
    "neighbours": (("--neighbours", "16,64"), dict(prefill_agrees=True)),
    "observer": (("--observer-check",), dict(QUIET, logprobs_path_differs=True)),
}
SWITCHED_ON = {name: switch for name, (switch, _) in LISTED.items()}
VARIED = {name: varied for name, (_, varied) in LISTED.items()}
KEY = "sk-rules-Zq9xQ2v7"  # every run is given it; no check may repeat it
HELD, MOVED, UNCOMPARED, STOPPED = "held", "moved", "uncompared", "stopped"

# The practice engine's faults whose truth is known for every check: (its settings, or None
# for VARIED's; the sweep's own options; the outcomes the truth allows)
TRUTHS = {
    "what it varies moves": (None, (), {MOVED}),
    "nothing moves": (QUIET, (), {HELD}),
    "only run-to-run noise moves (the seed ignored, said)": (
        dict(engine="sglang", prefill_agrees=True), ("--temperature", "0.8"), {HELD, UNCOMPARED}),
    "only run-to-run noise moves (the seed taken, not used)": (
        dict(QUIET, ignore_seed=True), ("--temperature", "0.8"), {HELD, UNCOMPARED}),
    "the cache serves every prompt": (
        dict(QUIET, cache_serves="all", prompt_tokens_details=True), (), {UNCOMPARED}),
    "the cache serves every prompt, uncounted": (
        dict(QUIET, cache_serves="all", prompt_tokens_details=True, uncounted_cache_hits=True),
        (), {UNCOMPARED}),
    # the first request after batch 1's is each check's own: the server answers it 500
    "the server fails the check's request": (
        dict(QUIET, prompt_tokens_details=True, faults={2: "http500"}), (), {STOPPED}),
}
# Where a fault's truth is another for one check, and why
TRUTH_FOR = {
    # copies of one vLLM request share its cache, so a cold batch of several copies is
    # partly served and compares nothing: SGLang's cache is emptied before each batch, so
    # every batch's cold request is cold and its repeat served
    ("cache_check", "nothing moves"): (dict(QUIET, engine="sglang"), (), {HELD}),
    # SGLang ignores the seed only with the flag off, and there its decode at batch 2
    # reduces in another order than its prefill: the engine moved what the check compares
    ("prefill", "only run-to-run noise moves (the seed ignored, said)"): (
        dict(engine="sglang", prefill_agrees=True), ("--temperature", "0.8"), {MOVED}),
}
# Faults whose truth differs check by check: only the rules on claims are held there
OTHER_FAULTS = {
    "cache serves half of each request": (dict(cache_serves="some", prompt_tokens_details=True), ()),
    "cache serves one item": (dict(engine="sglang", cache_serves="one"), ()),
    "top logprobs above 5 refused": (dict(max_logprobs=5), ()),
    "no prefix cache": (dict(prefix_caching=False, prompt_tokens_details=True), ()),
}
CLAIMS = re.compile(r"\b(held|equal|equals|invariant|agree)\b")
UNMEASURED = ("nothing compared", "not measured", "no data")
FIRST_MOVED = re.compile(r"(?P<kind>tokens|logprobs) first moved at step (?P<step>\d+)")
FIRST_DIFFERING = re.compile(r"first differing step (?P<step>\d+)")


def summaries_of(argv):
    """(the run's result, the last sweep summary it made) of a run of run.py with argv."""
    made = []
    real = run.sweep_summary

    def keep(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    with mock.patch.object(run, "sweep_summary", keep):
        result = run_lab(*argv)
    return result, made[-1] if made else None


def sweep_of(stub, name, options):
    """(the run's result, its last sweep summary: the check records themselves)."""
    return summaries_of(["--mode", "sweep", "--engine", stub.config.engine, "--url", stub.url,
                         "--sizes", "1,2", "--repeat", 2, "--max-tokens", 12, "--api-key", KEY,
                         *options, *SWITCHED_ON[name]])


def outcome_of(record):
    """The check's outcome, as the saved sweep gives it (run.Verdict.outcome)."""
    return getattr(record.verdict, "outcome", None)


def said(record, summary):
    """Everything the check says: its verdict and its lines."""
    sizes = []
    return "\n".join([str(record.verdict)] + [str(line) for line in record.lines(sizes)])


def served_log(stub):
    with urllib.request.urlopen(stub.url + "/stub/served") as answer:
        return json.load(answer)


def prefill_truth(log, prompt):
    """Where the engine's decodes of the prompt first differ from its prefills of the same
    tokens, by its own record: (step, "logprobs"), or None where none differs."""
    prefills = {tuple(e["generated"]): e["logprobs"] for e in log
                if e.get("prefill_of") == prompt}
    firsts = []
    for entry in log:
        if entry.get("prompt") != prompt:
            continue
        prefill = prefills.get(tuple(entry.get("ids", ())))
        if prefill is not None:
            firsts += [step for step, (a, b) in enumerate(zip(entry["logprobs"], prefill))
                       if a != b][:1]
    return (min(firsts), "logprobs") if firsts else None


def cache_truth(log, prompt):
    """Where the engine's completions of the prompt that its cache served first differ from
    those it computed cold, by its own record: (step, None), or None where none differs."""
    entries = [e for e in log if e.get("prompt") == prompt and "cached" in e]
    firsts = [next(step for step, (a, b) in enumerate(zip(
        zip(cold["ids"], cold["top"]), zip(warm["ids"], warm["top"]))) if a != b)
        for cold in entries if not cold["cached"] for warm in entries if warm["cached"]
        if (cold["ids"], cold["top"]) != (warm["ids"], warm["top"])]
    return (min(firsts), None) if firsts else None


def first_moved_truth(log, prompt):
    """Where the runs the engine computed beside a neighbour first differ from the lone run
    computed before them, by its own record: (step, "tokens" or "logprobs"), or None."""
    firsts, lone = [], None
    for entry in log:
        if entry.get("prompt") != prompt:
            continue
        if not entry["neighbour"]:
            lone = entry
            continue
        if lone is None:
            continue
        for step, (a, b) in enumerate(zip(lone["ids"], entry["ids"])):
            if a != b:
                firsts.append((step, "tokens"))
                break
            if lone["logprobs"][step] != entry["logprobs"][step]:
                firsts.append((step, "logprobs"))
                break
    return min(firsts, key=lambda f: (f[0], f[1] != "tokens")) if firsts else None


def claims_broken(record, comparable=True):
    """The rules on claims a record breaks, each as a line."""
    broken, verdict = [], str(record.verdict)
    if not record.compared:
        if CLAIMS.search(verdict):
            broken.append("claims %r having compared nothing" % verdict)
        if not verdict.startswith(UNMEASURED):
            broken.append("compared nothing and does not say so: %r" % verdict)
        if record.held:
            broken.append("its --expect holds having compared nothing")
    if not comparable and record.held:
        broken.append("its --expect holds where nothing was comparable")
    return broken


def rules_broken(name, truth):
    """Every rule the check listed under name breaks against the practice engine: a line
    each (empty: it keeps them all)."""
    broken = []
    for fault, truth_of_fault in TRUTHS.items():
        config, options, allowed = TRUTH_FOR.get((name, fault), truth_of_fault)
        config = VARIED[name] if config is None else config
        with StubServer(StubConfig(scheduler_window=0.05, **config)) as stub:
            r, summary = sweep_of(stub, name, options)
            log = served_log(stub) if fault == "what it varies moves" else []
        record = summary.checks.get(name) if summary is not None else None
        if record is None:
            broken.append("%s: no record (%s)" % (fault, r.stderr[-300:]))
            continue
        outcome, words = outcome_of(record), said(record, summary)
        if outcome not in allowed:
            broken.append("%s: %s, where the engine's truth allows %s (%r)"
                          % (fault, outcome, "/".join(sorted(allowed)), str(record.verdict)))
        if allowed == {STOPPED} and CLAIMS.search(str(record.verdict)):
            broken.append("%s: claims %r" % (fault, str(record.verdict)))
        if KEY in words or KEY in r.stdout or KEY in r.stderr:
            broken.append("%s: it says the API key" % fault)
        broken += ["%s: %s" % (fault, b) for b in claims_broken(
            record, comparable=allowed != {UNCOMPARED})]
        if fault == "what it varies moves" and truth is not None:
            of_record, said_as = truth
            found = said_as.search(words)
            expected = of_record(log, run.DEFAULT_PROMPT)
            says = None if found is None else (int(found.group("step")),
                                               found.groupdict().get("kind") or expected[1])
            if expected is not None and says != expected:
                broken.append("%s: says %r first moved, the engine's record: %s at step %d"
                              % (fault, found and found.group(0), expected[1] or "moved",
                                 expected[0]))
    for fault, (config, options) in OTHER_FAULTS.items():
        with StubServer(StubConfig(scheduler_window=0.05, **config)) as stub:
            r, summary = sweep_of(stub, name, options)
        record = summary.checks.get(name) if summary is not None else None
        if record is None:
            broken.append("%s: no record" % fault)
            continue
        broken += ["%s: %s" % (fault, b) for b in claims_broken(record)]
    return broken


# Where a check says what first moved: how the engine's own record says it, and how the
# check's words say it (a check that names no step is held to nothing here)
FIRST_MOVED_TRUTH = {"neighbours": (first_moved_truth, FIRST_MOVED),
                     "prefill": (prefill_truth, FIRST_DIFFERING),
                     "cache_check": (cache_truth, FIRST_DIFFERING)}


class EveryCheckKeepsTheRules(TempDirTest):
    def test_every_check_is_listed(self):
        self.assertEqual(set(LISTED), {kind.NAME for kind in run.SWEEP_CHECKS})

    def test_every_check_against_the_engines_truth(self):
        for kind in run.SWEEP_CHECKS:
            with self.subTest(check=kind.NAME):
                self.assertEqual(rules_broken(kind.NAME, FIRST_MOVED_TRUTH.get(kind.NAME)), [])


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


# Wrong checks, each listed in place of the real one it copies: the rules must reject each
# (its rules_broken is not empty). Each breaks one rule, as a check written in haste might.


class NeverComparesTexts(run.ObserverCheck):
    """Says the text held wherever both runs were computed, never comparing them."""

    @staticmethod
    def setting(logprobs, reference, run_):
        if not (reference[1] and run_[1]):
            return run.ObserverSetting(logprobs, 0, 0, 1)
        return run.ObserverSetting(logprobs, 1, 1)


class NoControlAndSaysNot(run.NeighbourCheck):
    """Takes its lone run for its control, and its record does not say it compares runs: at
    a temperature where the server ignores the seed, it blames the neighbours."""

    def control(self, run_, prompt, lone):
        return 1

    def summary_part(self, parts, sizes):
        record = super().summary_part(parts, sizes)
        if record is None or not record.lengths:
            return record
        moved = [p.length for p in record.lengths if p.runs and p.equal < p.runs]
        verdict = run.check_verdict(run.CheckFinding(
            parts=len(record.lengths), compared=sum(1 for p in record.lengths if p.runs),
            held=run.NEIGHBOURS_HELD,
            moved="moved beside neighbours of %s tokens" % ", ".join(map(str, moved))
            if moved else None))
        return type(record)(verdict, record.lengths, 0, 0)


class WrongFirstMoved(run.NeighbourCheck):
    """Names the step after the one that moved, and the other kind."""

    def batch_part(self, run_, prompt, n, batch):
        row = super().batch_part(run_, prompt, n, batch)
        if row is None:
            return row
        other = {"tokens": "logprobs", "logprobs": "tokens"}
        return type(row)([run.dataclasses.replace(
            p, first_step=p.first_step + 1, first_moved=other.get(p.first_moved))
            if p.first_step is not None else p for p in row.lengths],
            row.control_runs, row.control_equal)


class WrongPrefillStep(run.PrefillCheck):
    """Names the step after the first whose decode and prefill differ."""

    def batch_part(self, run_, prompt, n, batch):
        row = super().batch_part(run_, prompt, n, batch)
        if row is None or row.first_step is None:
            return row
        return run.dataclasses.replace(row, first_step=row.first_step + 1)


class WrongCacheStep(run.CacheCheck):
    """Names the step after the first where the hit and the cold prefill differ."""

    def batch_part(self, run_, prompt, n, batch):
        part = super().batch_part(run_, prompt, n, batch)
        if part is None or part.first_step is None:
            return part
        return run.dataclasses.replace(part, first_step=part.first_step + 1)


class SaysTheKey(run.ObserverCheck):
    """Writes the key it was given into its verdict."""

    def batch_part(self, run_, prompt, n, batch):
        self.key = run_.cfg.api_key
        return super().batch_part(run_, prompt, n, batch)

    def summary_part(self, parts, sizes):
        record = super().summary_part(parts, sizes)
        if record is None or not getattr(self, "key", None):
            return record
        return run.dataclasses.replace(record, verdict=run.Verdict.of(
            "%s (asked with %s)" % (record.verdict, self.key), record.verdict.outcome))


class WrongChecksAreRejected(TempDirTest):
    def rejected(self, wrong):
        listed = [wrong if kind.NAME == wrong.NAME else kind for kind in run.SWEEP_CHECKS]
        with mock.patch.object(run, "SWEEP_CHECKS", listed):
            return rules_broken(wrong.NAME, FIRST_MOVED_TRUTH.get(wrong.NAME))

    def test_a_check_that_never_compares_texts(self):
        self.assertTrue(any("what it varies moves: held" in b
                            for b in self.rejected(NeverComparesTexts)))

    def test_a_check_with_no_control_that_does_not_say_it_compares_runs(self):
        self.assertTrue(any("only run-to-run noise moves" in b and ": moved" in b
                            for b in self.rejected(NoControlAndSaysNot)))

    def test_a_check_whose_first_moved_names_the_wrong_step_and_kind(self):
        self.assertTrue(any("first moved, the engine's record" in b
                            for b in self.rejected(WrongFirstMoved)))

    def test_a_prefill_check_whose_first_differing_step_is_not_the_engines(self):
        self.assertTrue(any("first moved, the engine's record: logprobs at step" in b
                            for b in self.rejected(WrongPrefillStep)))

    def test_a_cache_check_whose_first_differing_step_is_not_the_engines(self):
        self.assertTrue(any("first moved, the engine's record: moved at step" in b
                            for b in self.rejected(WrongCacheStep)))

    def test_a_check_that_says_the_key(self):
        self.assertTrue(any("it says the API key" in b for b in self.rejected(SaysTheKey)))


if __name__ == "__main__":
    unittest.main()
