"""The code a result came from: `run.py --version` names a checkout by its commit (dirty and
the hash of its bytes when changed), a copy outside a checkout by the hash of its bytes, and
every saved result keeps the same name in its `lab` record."""

import hashlib
import os
import shutil
import subprocess
import sys
import unittest

from support import RUN_PY, StubServer, TempDirTest, run, run_lab


def git(folder, *args):
    return subprocess.run(["git", "-C", folder, "-c", "user.name=lab", "-c", "user.email=lab@x",
                           *args], capture_output=True, text=True, check=True).stdout.strip()


def version_of(path):
    p = subprocess.run([sys.executable, path, "--version"], capture_output=True, text=True,
                       timeout=60)
    return p.returncode, p.stdout.strip()


@unittest.skipIf(shutil.which("git") is None, "no git on this machine")
class TheCodeIsNamed(TempDirTest):
    def test_a_checkout_is_named_by_its_commit_and_said_dirty_when_changed(self):
        shutil.copy(RUN_PY, self.path("run.py"))
        git(self.tmp, "init", "-q")
        git(self.tmp, "add", "run.py")
        git(self.tmp, "commit", "-q", "-m", "lab")
        commit = git(self.tmp, "rev-parse", "--short", "HEAD")
        named = "run.py (batch-invariance lab) %s, git %s" % (run.LAB_VERSION, commit)
        self.assertEqual(version_of(self.path("run.py")), (0, named))
        with open(self.path("run.py"), "a", encoding="utf-8") as f:
            f.write("\n# a local change\n")
        with open(self.path("run.py"), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:12]
        self.assertEqual(version_of(self.path("run.py"))[1],
                         "%s-dirty, run.py sha256 %s" % (named, digest))

    def test_two_clones_of_one_commit_with_other_edits_read_differently(self):
        os.mkdir(self.path("a"))
        shutil.copy(RUN_PY, os.path.join(self.path("a"), "run.py"))
        git(self.path("a"), "init", "-q")
        git(self.path("a"), "add", "run.py")
        git(self.path("a"), "commit", "-q", "-m", "lab")
        git(self.tmp, "clone", "-q", self.path("a"), self.path("b"))
        names = []
        for clone, edit in (("a", "# one change\n"), ("b", "# another change\n")):
            with open(os.path.join(self.path(clone), "run.py"), "a", encoding="utf-8") as f:
                f.write(edit)
            names.append(version_of(os.path.join(self.path(clone), "run.py"))[1])
        self.assertNotEqual(names[0], names[1])
        self.assertTrue(all("-dirty, run.py sha256 " in name for name in names), names)

    def test_a_copy_outside_a_checkout_is_named_by_the_hash_of_its_bytes(self):
        shutil.copy(RUN_PY, self.path("run.py"))
        with open(self.path("run.py"), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:12]
        self.assertEqual(version_of(self.path("run.py")),
                         (0, "run.py (batch-invariance lab) %s, run.py sha256 %s"
                          % (run.LAB_VERSION, digest)))

    def test_a_copy_dropped_into_another_checkout_is_not_named_by_that_checkout(self):
        git(self.tmp, "init", "-q")
        with open(self.path("other.txt"), "w", encoding="utf-8") as f:
            f.write("another project\n")
        git(self.tmp, "add", "other.txt")
        git(self.tmp, "commit", "-q", "-m", "other")
        shutil.copy(RUN_PY, self.path("run.py"))  # untracked there
        self.assertIn("run.py sha256 ", version_of(self.path("run.py"))[1])

    def test_every_saved_result_names_the_code(self):
        with StubServer() as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1", "--max-tokens", 2,
                        "--repeat", 1, "--save", self.path("s.json"))
        self.assertEqual(r.code, 0, r.stderr)
        self.assertEqual(self.load("s.json")["lab"]["code"], run.lab_code())


if __name__ == "__main__":
    unittest.main()
