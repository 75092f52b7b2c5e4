"""Requests are values and one executor sends them: run.py's structure, read from its source,
holds one function that hands request threads to the thread starter and one place that
builds a generation request's body (each engine's adapter writes it in its wire format)."""

import ast
import unittest

from support import RUN_PY


def on_adapter(func):
    """Is the call adapter.X(...) or something.adapter.X(...)?"""
    value = getattr(func, "value", None)
    return (isinstance(value, ast.Name) and value.id in ("adapter", "self")) or (
        isinstance(value, ast.Attribute) and value.attr == "adapter")


def callers(tree, called, adapters_only=False):
    """(class, function) of every function whose body calls a name or attribute called (with
    adapters_only: an adapter's method of that name)."""
    found = set()
    for cls in [None] + [n for n in tree.body if isinstance(n, ast.ClassDef)]:
        body = tree.body if cls is None else cls.body
        for fn in body:
            if not isinstance(fn, ast.FunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call):
                    f = node.func
                    name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
                    if name in called and (not adapters_only or on_adapter(f)):
                        found.add((cls.name if cls else None, fn.name))
    return found


class OneExecutor(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(RUN_PY, encoding="utf-8") as f:
            cls.tree = ast.parse(f.read())

    def test_one_function_hands_request_threads_to_the_thread_starter(self):
        self.assertEqual(callers(self.tree, {"in_threads"}), {(None, "send_requests")})

    def test_one_place_builds_a_generation_request_body(self):
        builders = callers(self.tree, {"body", "stream_body", "prefill_only_body"},
                           adapters_only=True)
        # the adapters' own stream_body writes on their body: the engine's wire format
        outside = {(c, f) for c, f in builders if c not in ("VllmAdapter", "SglangAdapter")}
        self.assertEqual(outside, {("Request", "body")})

    def test_one_class_opens_generation_requests(self):
        openers = callers(self.tree, {"Exchange"}) | {
            c for c in callers(self.tree, {"request"})
            if any(isinstance(n, ast.Attribute) and n.attr == "generate_path"
                   for cls in self.tree.body if isinstance(cls, ast.ClassDef) and cls.name == c[0]
                   for fn in cls.body if isinstance(fn, ast.FunctionDef) and fn.name == c[1]
                   for n in ast.walk(fn))}
        outside = {(c, f) for c, f in openers
                   if c not in ("Executor", "HttpClient", "VllmAdapter", "SglangAdapter")}
        self.assertEqual(outside, set())


def used_above_definition(tree):
    """run.py's module-level names loaded on a line above their definition, annotations aside
    (they are not evaluated: from __future__ import annotations)."""
    defined = {}
    for node in tree.body:
        names = []
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        for name in names:
            defined.setdefault(name, node.lineno)
    annotations = set()
    for node in ast.walk(tree):
        found = []
        if isinstance(node, ast.FunctionDef):
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            found = [a.annotation for a in args if a.annotation] + [node.returns]
            found += [a.annotation for a in (node.args.vararg, node.args.kwarg) if a is not None]
        elif isinstance(node, ast.AnnAssign):
            found = [node.annotation]
        annotations.update(id(sub) for a in found if a is not None for sub in ast.walk(a))
    return {node.id for node in ast.walk(tree)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
            and id(node) not in annotations and node.id in defined
            and node.lineno < defined[node.id]}


class ReadingOrder(unittest.TestCase):
    def test_few_names_are_used_above_their_definition(self):
        with open(RUN_PY, encoding="utf-8") as f:
            above = used_above_definition(ast.parse(f.read()))
        self.assertLessEqual(len(above), 15, sorted(above))

    def test_the_map_names_every_section_in_its_order(self):
        # a section opens with a line of dashes and its name, the name ending at its colon
        with open(RUN_PY, encoding="utf-8") as f:
            text = f.read()
        lines = text.splitlines()
        sections = [lines[i + 1][2:].split(":")[0].split(" (")[0]
                    for i, line in enumerate(lines[:-1]) if line == "# " + "-" * 76]
        doc = ast.get_docstring(ast.parse(text))
        listed = doc[doc.index("Sections, in the order they appear"):]
        at, missing = 0, []
        for name in sections:  # each after the one before it
            found = listed.find(name, at)
            if found == -1:
                missing.append(name)
            at = max(at, found)
        self.assertEqual(missing, [])


if __name__ == "__main__":
    unittest.main()
