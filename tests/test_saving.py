"""--save: cheap on long runs, compact, with its provenance, and never lost or replaced
when writing fails."""

import io
import json
import os
import stat
import subprocess
import sys
import unittest
from unittest import mock

from support import ROOT, StubConfig, StubServer, TempDirTest, one_error_line, run, run_lab


class SavingCanFail(TempDirTest):
    def test_a_save_that_fails_after_measuring_fails_the_run_but_keeps_the_table(self):
        real = run.write_json_atomic
        calls = []

        def full_disk(path, doc, *pieces):
            calls.append(doc["summary"]["state"])
            if len(calls) > 1:
                raise run.SaveError("--save: cannot write %s (No space left on device)" % path)
            return real(path, doc, *pieces)

        with StubServer() as stub, mock.patch.object(run, "write_json_atomic", full_disk):
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2,3", "--max-tokens", 4, "--repeat", 1,
                        "--save", self.path("s.json"))
        one_error_line(self, r, 3, "No space left on device")
        self.assertIn("summary: unique completions", r.stdout)  # the table is still printed
        self.assertEqual(self.load("s.json")["summary"]["state"], "running")  # the last good file is whole

    def test_a_folder_that_cannot_be_written_is_refused_before_any_request(self):
        if os.geteuid() == 0:
            target = "/proc/lab-cannot-write-here.json"
        else:
            os.chmod(self.tmp, stat.S_IRUSR | stat.S_IXUSR)
            self.addCleanup(os.chmod, self.tmp, stat.S_IRWXU)
            target = self.path("s.json")
        with StubServer() as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--save", target)
            self.assertEqual(stub.requests, [])
        one_error_line(self, r, 2, "--save: cannot write in")

    def test_two_cost_runs_saving_to_one_file_keep_both_cells(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "run.py"), "--mode", "cost", "--url", off.url,
                                       "--invariant", on.url, "--batch", "1", "--trials", "6", "--warmup", "0",
                                       "--max-tokens", "2", "--workload", workload, "--prefix-tokens", "8",
                                       "--quiet", "--save", self.path("c.json")],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                     for workload in ("cold", "shared-prefix")]
            errors = [p.communicate(timeout=120)[1] for p in procs]
        self.assertEqual([p.returncode for p in procs], [0, 0], errors)
        self.assertEqual(sorted(c["workload"] for c in self.load("c.json")["cells"]), ["cold", "shared-prefix"])

    def test_a_finished_sweep_is_kept_beside_the_next_one(self):
        """The same command run twice (the quick start, re-run in its folder): the second run
        measures, the first sweep is kept as s.1.json and said, a third as s.2.json."""
        with StubServer() as stub:
            args = ("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 2, "--repeat", 1,
                    "--save", self.path("s.json"))
            self.assertEqual(run_lab(*args).code, 0)
            first = self.load("s.json")
            r = run_lab(*args)
            self.assertEqual(r.code, 0, r.stderr)
            self.assertIn("s.json held a finished sweep; it is kept as %s" % self.path("s.1.json"),
                          r.stderr)
            self.assertEqual(self.load("s.1.json"), first)
            second = self.load("s.json")
            self.assertNotEqual(second, first)  # measured anew (its times are its own)
            self.assertEqual(run_lab(*args).code, 0)
            self.assertEqual(self.load("s.2.json"), second)
            self.assertEqual(self.load("s.1.json"), first)

    def test_a_finished_sweep_that_cannot_be_kept_is_refused_before_any_generation(self):
        with StubServer() as stub:
            args = ("--mode", "sweep", "--url", stub.url, "--sizes", "1", "--max-tokens", 2,
                    "--repeat", 1, "--save", self.path("s.json"))
            self.assertEqual(run_lab(*args).code, 0)
            before = self.load("s.json")
            n = len(stub.generation_bodies())
            with mock.patch.object(run, "MAX_KEPT_SWEEPS", 0):
                r = run_lab(*args)
            self.assertEqual(len(stub.generation_bodies()), n)
        one_error_line(self, r, 2, "holds a finished sweep")
        self.assertEqual(self.load("s.json"), before)

class CheapSaves(TempDirTest):
    def test_a_fast_run_writes_the_file_once_during_the_run_and_once_at_the_end(self):
        writes = []
        real = run.write_json_atomic
        with mock.patch.object(run, "write_json_atomic", side_effect=lambda p, d, *pieces: (writes.append(d["summary"]["state"]), real(p, d, *pieces))):
            with StubServer() as stub:
                r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2,3,4,5,6,7,8", "--max-tokens", 2,
                            "--repeat", 2, "--save", self.path("s.json"))
        self.assertEqual(r.code, 0, r)
        self.assertEqual(writes, ["running", "complete"])
        self.assertEqual(len(self.load("s.json")["prompts"][0]["sizes"]), 8)

    def test_the_schedule(self):
        clock = [100.0]

        def save(number, seconds):
            def write(path):
                built.append(number)
                clock[0] += seconds
            return write

        with mock.patch.object(run.time, "monotonic", lambda: clock[0]):
            saves = run.ThrottledSave(self.path("x.json"))
            built = []
            saves.offer(save(1, 0.5))                               # first: written, took 0.5 s
            self.assertEqual(saves.next_due, 100.5 + 9.5)           # 0.5 s is a twentieth of 10 s
            clock[0] = 109.0
            saves.offer(save(2, 0.1))                               # not due: not even built
            self.assertEqual(built, [1])
            clock[0] = 110.0
            saves.offer(save(3, 0.01))                              # due; quick, so the interval rules
            self.assertEqual((built, saves.next_due), ([1, 3], 110.01 + 1.0))
        self.assertEqual(run.ThrottledSave(None).offer(lambda path: 1 / 0), None)  # no --save: nothing built

    def test_saved_json_is_one_compact_line(self):
        run.write_json_atomic(self.path("c.json"), {"a": [1, 2], "b": {"c": None}})
        with open(self.path("c.json")) as f:
            self.assertEqual(f.read(), '{"a":[1,2],"b":{"c":null}}\n')

class Provenance(TempDirTest):
    def test_saved_results_say_how_they_were_made_without_the_key(self):
        with StubServer(StubConfig()) as off, StubServer(StubConfig(invariant=True)) as on:
            sweep = run_lab("--mode", "sweep", "--url", off.url, "--sizes", "1,2", "--max-tokens", 4,
                            "--api-key", "sk-secret-1", "--save", self.path("s.json"))
            cost = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 1,
                           "--trials", 1, "--warmup", 0, "--max-tokens", 2, "--api-key=sk-secret-2",
                           "--save", self.path("c.json"))
        self.assertEqual((sweep.code, cost.code), (0, 0), (sweep, cost))
        for lab in (self.load("s.json")["lab"], self.load("c.json")["cells"][0]["lab"]):
            with self.subTest(command=lab["command"][:3]):
                self.assertEqual(lab["version"], run.LAB_VERSION)
                self.assertEqual(lab["command"][0], "run.py")
                self.assertIn("--save", lab["command"])
                self.assertNotIn("sk-secret", json.dumps(lab))
                self.assertTrue(lab["started"] <= lab["ended"])
                self.assertTrue(lab["host"])
        self.assertIn("[api key]", self.load("s.json")["lab"]["command"])

    def test_version_names_the_code(self):
        p = subprocess.run([sys.executable, os.path.join(ROOT, "run.py"), "--version"], capture_output=True,
                           text=True, timeout=60)
        self.assertEqual((p.returncode, p.stdout.strip()),
                         (0, "run.py (batch-invariance lab) %s" % run.lab_code()))
        self.assertTrue(run.lab_code().startswith(run.LAB_VERSION + ", "))


class SavesThatCannotLoseAResult(TempDirTest):
    def test_a_link_to_a_missing_folder_is_refused_before_any_request(self):
        os.symlink(os.path.join(self.path("nowhere"), "s.json"), self.path("link.json"))
        with StubServer() as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--save", self.path("link.json"))
            self.assertEqual(stub.requests, [])
        one_error_line(self, r, 2, "a link to")

    def test_a_read_only_file_is_refused_before_any_request(self):
        with open(self.path("ro.json"), "w") as f:
            json.dump({"schema": run.COST_SCHEMA, "cells": []}, f)
        os.chmod(self.path("ro.json"), 0o444)
        with StubServer() as stub, StubServer(StubConfig(invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", stub.url, "--invariant", on.url,
                        "--save", self.path("ro.json"))
        one_error_line(self, r, 2, "is read-only")

    def test_a_file_another_run_wrote_meanwhile_is_not_overwritten(self):
        path = self.path("s.json")
        saves = run.ThrottledSave(path, exclusive=True)
        saves.write(lambda p: run.write_json_atomic(p, {"run": "mine", "n": 1}))
        run.write_json_atomic(path, {"run": "theirs"})  # another run, into the same file
        saves.write(lambda p: run.write_json_atomic(p, {"run": "mine", "n": 2}))
        self.assertEqual(self.load("s.json"), {"run": "theirs"})
        self.assertIsNotNone(saves.moved_to)
        with open(saves.moved_to, encoding="utf-8") as f:
            self.assertEqual(json.load(f), {"run": "mine", "n": 2})
        out = io.StringIO()
        code = run.report_save(run.Config("sweep", save=path), saves, 0, run.Out(out, out))
        self.assertEqual(code, run.EXIT_SERVER)
        self.assertIn("written by another run", out.getvalue())

    def test_a_cost_cell_whose_path_a_sweep_took_meanwhile_is_saved_beside_it(self):
        path = self.path("shared.json")
        sweep = {"schema": "batch-invariance-lab/sweep/2", "prompts": [],
                 "summary": {"state": "complete"}}
        save_cell = run.save_cell

        def sweep_saves_first(where, cell):  # a sweep started with the same --save wins the race
            if not os.path.exists(path):
                run.write_json_atomic(path, sweep)
            return save_cell(where, cell)

        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on, \
                mock.patch.object(run, "save_cell", sweep_saves_first):
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 1,
                        "--trials", 2, "--warmup", 0, "--max-tokens", 2, "--save", path)
        self.assertEqual(r.code, run.EXIT_SERVER, r)
        self.assertEqual(self.load("shared.json"), sweep)  # the sweep's file as it saved it
        kept = self.path("shared.%d.json" % os.getpid())
        self.assertIn("holds batch-invariance-lab/sweep/2 now, not cost results (another run "
                      "saved there while this one measured); not overwritten: saved %s instead"
                      % kept, r.stderr)
        with open(kept, encoding="utf-8") as f:
            cells = json.load(f)["cells"]
        self.assertEqual([(c["state"], c["trials"]) for c in cells], [("complete", 2)])


if __name__ == "__main__":
    unittest.main()
