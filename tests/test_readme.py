"""The docs stay true: every code block marked `<!-- readme-test -->` in README.md,
examples/README.md and tests/README.md is run in order, each file's in one folder of its own,
against the practice engine, as a reader following the page from top to bottom would run it.

How a block reads: in a transcript, lines starting with `$ ` are commands (a line ending in
a backslash goes on to the next) and the lines after a command are what it prints; in a
plain block every line is a command. A command ending in `&` starts a practice server in the
background, `kill %1 %2` stops them; `pip install` lines are left out (the machine has what
it has), and the plot scripts run only where matplotlib is installed. Each command must exit
0 and print every line quoted after it, numbers aside (timings and noise differ from run to
run; the words, and the shape of each line, may not). The ports 8000 and 8001 become free
ports, so that the test can run on any machine."""

import contextlib
import os
import re
import shlex
import subprocess
import sys
import tempfile
import unittest
from concurrent.futures import ThreadPoolExecutor

from support import ROOT, free_port

MARK = "<!-- readme-test -->"
NUMBER = re.compile(r"[-+]?\d+(\.\d+)?")

try:
    import matplotlib  # noqa: F401
    HAVE_MATPLOTLIB = True
except ImportError:
    HAVE_MATPLOTLIB = False


def blocks(text):
    """The marked code blocks of a Markdown text, in order: (line number, lines)."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.strip() == MARK and i + 1 < len(lines) and lines[i + 1].startswith("```"):
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            found.append((i + 2, lines[i + 2:end]))
    return found


def commands(lines):
    """(command, quoted output lines) of one block."""
    transcript = any(line.startswith("$ ") for line in lines)
    steps, pending = [], None
    for line in lines:
        if pending is not None:  # a continued command
            pending += " " + line.strip()
            if not line.rstrip().endswith("\\"):
                steps.append([pending.replace("\\ ", " "), []])
                pending = None
            continue
        command = line[2:] if transcript and line.startswith("$ ") else (line if not transcript else None)
        if command is None:
            if steps and line.strip():
                steps[-1][1].append(line)
            continue
        if not command.strip():
            continue
        if command.rstrip().endswith("\\"):
            pending = command.rstrip()[:-1].rstrip()
            continue
        steps.append([command, []])
    return [(c, out) for c, out in steps]


# What a line may carry on a loaded machine and not on a quiet one: a cost arm whose trials
# spread wide is marked NOISY after its figures (run.py's print_cost_report). The page quotes
# the figures; the mark is the machine's load, so a quoted line matches with or without it.
LOAD_MARKS = re.compile(r"\s+NOISY \(max/min > [0-9.]+\)$")


def normalised(line):
    return " ".join(NUMBER.sub("#", LOAD_MARKS.sub("", line.rstrip())).split())


class Reader:
    """A shell as the README's reader has one: servers in the background, one folder."""

    def __init__(self, folder, ports):
        self.folder, self.ports, self.servers = folder, ports, []
        for name in ("run.py", "tests", "examples"):
            if not os.path.lexists(os.path.join(folder, name)):  # a folder used before
                os.symlink(os.path.join(ROOT, name), os.path.join(folder, name))

    def mapped(self, text):
        return re.sub(r"\b800([01])\b", lambda m: str(self.ports[int(m.group(1))]), text)

    def run(self, command):
        """Run one README command; (exit code or None when left out, output)."""
        command = self.mapped(command.split(" # ")[0].split("  # ")[0].strip())
        words = shlex.split(command)
        if words[:2] == ["pip", "install"]:
            return None, ""
        if words[0] == "kill":
            self.stop()
            return 0, ""
        if any("plot_" in w for w in words) and not HAVE_MATPLOTLIB:
            return None, ""
        env = dict(os.environ, OFF_URL="http://localhost:%d" % self.ports[0],
                   ON_URL="http://localhost:%d" % self.ports[1])
        env.pop("NO_COLOR", None)
        while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value before the command
            name, _, value = words.pop(0).partition("=")
            env[name] = value.replace("python3 ", sys.executable + " ")
        if words[-1] == "&":
            return self.start(words[:-1], env), ""
        if words[0] == "python3":
            words[0] = sys.executable
        elif words[0].endswith(".sh"):
            words = ["bash"] + words
        p = subprocess.run(words, cwd=self.folder, env=env, capture_output=True, text=True, timeout=300,
                           stdin=subprocess.DEVNULL)
        return p.returncode, p.stdout + p.stderr

    def start(self, words, env):
        """A server in the background, as a shell starts it: nothing waits for it here, so a
        block's own commands must (--wait-ready), as they must for a reader who pastes it."""
        words = [sys.executable if w == "python3" else w for w in words]
        self.servers.append(subprocess.Popen(words, cwd=self.folder, env=env, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL))
        return 0

    def stop(self):
        for server in self.servers:
            server.terminate()
            server.wait(timeout=30)
        self.servers = []


def fenced_blocks(text):
    """Every code block of a Markdown text, marked or not: (line number, lines)."""
    lines = text.splitlines()
    found, start = [], None
    for i, line in enumerate(lines):
        if line.startswith("```"):
            if start is None:
                start = i + 1
            else:
                found.append((start + 1, lines[start:i]))
                start = None
    return found


def check(test, text, folder=None):
    """Run every marked block of text; each command must exit 0 and print what is quoted. In
    a fresh folder, or in folder (where it may have run before)."""
    ran = 0
    with contextlib.ExitStack() as stack:
        if folder is None:
            folder = stack.enter_context(tempfile.TemporaryDirectory())
        reader = Reader(folder, (free_port(), free_port()))
        try:
            for line_no, lines in blocks(text):
                for command, quoted in commands(lines):
                    code, output = reader.run(command)
                    if code is None:
                        continue
                    ran += 1
                    where = "line %d: %s" % (line_no, command)
                    test.assertEqual(code, 0, "%s\n%s" % (where, output[-2000:]))
                    seen = {normalised(reader.mapped(line)) for line in output.splitlines()}
                    for want in quoted:
                        if want.strip() in ("...", ""):
                            continue
                        test.assertIn(normalised(reader.mapped(want)), seen, "%s: no line %r in\n%s"
                                      % (where, want, output[-3000:]))
        finally:
            reader.stop()
    return ran


DOCS = {  # each page, and the fewest marked blocks it has (a page that lost them fails)
    "README.md": 4,
    os.path.join("examples", "README.md"): 1,
    os.path.join("tests", "README.md"): 1,
}


REAL = os.path.join(ROOT, "examples", "real")


def shipped_text():
    """Every text file under examples/real, thousands separators gone, as one text."""
    texts = []
    for folder, _, names in os.walk(REAL):
        for name in names:
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    texts.append(f.read())
            except (UnicodeDecodeError, OSError):  # a picture
                continue
    return re.sub(r"(?<=\d),(?=\d{3}\b)", "", "\n".join(texts))


def findings_table(readme):
    """The README's findings table: its rows (under the header `| what | vLLM 0.26.0 | ...`),
    each (what, [cells])."""
    lines = readme.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| what | vLLM"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append((cells[0], cells[1:]))
    return rows


def figures_missing(cell, text, numbers):
    """The figures of one table cell that no shipped file holds: counts "A of B" as a pair
    (a sweep's saved or printed count), percentages, intervals and ULPs as numbers."""
    plain = re.sub(r"(?<=\d),(?=\d{3}\b)", "", cell)
    missing = []
    for a, b in re.findall(r"\b(\d+) of (\d+)\b", plain):
        pair = (r'"unique_completions": %s,\s*"total_completions": %s\b' % (a, b),
                r"\b%s (unique )?of %s\b" % (a, b), r"unique completions %s, total %s\b" % (a, b))
        if not any(re.search(p, text) for p in pair):
            missing.append("%s of %s" % (a, b))
    for value in re.findall(r"([+-]?\d+(?:\.\d+)?) ?%", plain) + re.findall(
            r"\[([+-]?\d+\.\d), ([+-]?\d+\.\d)\]", plain):
        for v in ([value] if isinstance(value, str) else value):
            if round(float(v), 1) not in numbers:
                missing.append(v)
    for ulp in re.findall(r"(\d+) ULP", plain):
        if int(ulp) not in numbers:
            missing.append(ulp + " ULP")
    return missing


class FindingsTable(unittest.TestCase):
    def test_every_figure_of_the_findings_table_is_in_a_shipped_file(self):
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            readme = f.read()
        text = shipped_text()
        numbers = set()
        for found in re.findall(r"-?\d+(?:\.\d+)?", text):
            numbers.update((round(float(found), 1), round(float(found))))
        rows = findings_table(readme)
        self.assertGreaterEqual(len(rows), 8)
        for what, cells in rows:
            for cell in cells:
                with self.subTest(row=what, cell=cell):
                    self.assertEqual(figures_missing(cell, text, numbers), [])

    def test_a_figure_no_file_holds_is_found(self):
        text = shipped_text()
        self.assertEqual(figures_missing("1 of 3,963 (small)", text, set()), [])
        self.assertEqual(figures_missing("1 of 3,964 (small)", text, set()), ["1 of 3964"])
        self.assertEqual(figures_missing("+912.4 % [+1.1, +2.2]", text, {1.1, 2.2}), ["+912.4"])


def docs_pages():
    """Every page of the docs: the three READMEs, and each README under examples/real and
    tests/fixtures (the real runs and the real answers they describe)."""
    pages = [os.path.join(ROOT, page) for page in DOCS]
    for top in (REAL, os.path.join(ROOT, "tests", "fixtures")):
        for folder, _, names in os.walk(top):
            pages += [os.path.join(folder, name) for name in names if name == "README.md"]
    return pages


# A path a page names relative to its own folder (`../x`, `real/y/`), and any name of a folder
# the repository does not hold (the machine's shared notes and runs): a reader has neither
RELATIVE_PATH = re.compile(r"`(\.\./[^`\s*]+)`")
OUTSIDE = re.compile(r"\bshared/(?:real-runs|wire|gpu)\b")


def dead_references(page, text):
    """The references of one page that lead nowhere a reader of the repository has."""
    dead = [m.group(0) for m in OUTSIDE.finditer(text)]
    for m in RELATIVE_PATH.finditer(text):
        target = os.path.normpath(os.path.join(os.path.dirname(page), m.group(1)))
        if not (target.startswith(ROOT + os.sep) and os.path.exists(target)):
            dead.append(m.group(1))
    return dead


class References(unittest.TestCase):
    def test_every_page_names_only_files_the_repository_holds(self):
        for page in docs_pages():
            with self.subTest(page=os.path.relpath(page, ROOT)):
                with open(page, encoding="utf-8") as f:
                    self.assertEqual(dead_references(page, f.read()), [])

    def test_a_reference_outside_the_repository_is_found(self):
        page = os.path.join(ROOT, "examples", "README.md")
        self.assertEqual(dead_references(page, "the answers in `../shared/wire/x.body`; "
                                               "`../examples/experiment.py`"),
                         ["shared/wire", "../shared/wire/x.body"])


class Readme(unittest.TestCase):
    def test_every_marked_block_runs_as_its_page_says(self):
        """The pages run at the same time, each in a folder and on ports of its own: they wait
        on their practice servers, not on the processor. A failure is reported for its page."""
        texts = {}
        for page in DOCS:
            with open(os.path.join(ROOT, page), encoding="utf-8") as f:
                texts[page] = f.read()
        with ThreadPoolExecutor(len(DOCS)) as pool:
            runs = {page: pool.submit(check, self, text) for page, text in texts.items()}
        for page, fewest in DOCS.items():
            with self.subTest(page):
                self.assertGreaterEqual(len(blocks(texts[page])), fewest)
                self.assertGreater(runs[page].result(), fewest)

    def test_every_block_that_starts_servers_waits_for_them(self):
        """A server started in the background is still loading when the next line runs: the
        first lab command after it must wait (--wait-ready), or a pasted block fails as
        connection refused. Every block of the pages, marked or not."""
        for page in DOCS:
            with open(os.path.join(ROOT, page), encoding="utf-8") as f:
                text = f.read()
            for line_no, lines in fenced_blocks(text):
                waiting_for = None
                for command, _ in commands(lines):
                    if command.rstrip().endswith("&"):
                        waiting_for = waiting_for or command
                    elif waiting_for and "run.py" in command:
                        with self.subTest(page=page, line=line_no):
                            self.assertIn("--wait-ready", command,
                                          "%s line %d: started %r, then %r without waiting"
                                          % (page, line_no, waiting_for, command))
                        waiting_for = None

    def test_the_quick_start_runs_twice_in_one_folder(self):
        """Run again where it ran, the quick start measures anew and keeps the first sweep
        beside the new one."""
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            first = MARK + "\n```\n" + "\n".join(blocks(f.read())[0][1]) + "\n```\n"
        with tempfile.TemporaryDirectory() as folder:
            self.assertGreater(check(self, first, folder), 2)
            self.assertGreater(check(self, first, folder), 2)
            self.assertTrue(os.path.exists(os.path.join(folder, "off.1.json")))

    def test_a_broken_command_or_a_changed_message_fails_it(self):
        broken = [
            "```\n$ python3 run.py --mode sweep --url http://localhost:8000 --sizes 1,x\n```",
            "```\n$ python3 run.py --mode harness --engine vllm\nthis line is not printed\n```",
        ]
        for block in broken:
            with self.subTest(block=block):
                with self.assertRaises(AssertionError):
                    check(self, MARK + "\n" + block + "\n")

    def test_how_blocks_are_read(self):
        lines = ["$ python3 a.py \\", "      --flag 1", "out 1", "out 2", "$ b &"]
        self.assertEqual(commands(lines), [("python3 a.py --flag 1", ["out 1", "out 2"]), ("b &", [])])
        self.assertEqual(commands(["x --y  # note", "", "z"]), [("x --y  # note", []), ("z", [])])
        self.assertEqual(normalised("  max ULP 4:  +30.8% [-1.5, 2]"), "max ULP #: #% [#, #]")
        # a cost arm marked NOISY under load is the line the page quotes, and only that one
        quoted = "  flag off median 0.1620s  MAD 0.0035s  min-max 0.1549-0.1699s  790.3 tokens/s"
        self.assertEqual(normalised(quoted + "  NOISY (max/min > 1.5)"), normalised(quoted))
        self.assertNotEqual(normalised(quoted + "  NOISY (max/min > 1.5) and more"),
                            normalised(quoted))


if __name__ == "__main__":
    unittest.main()
