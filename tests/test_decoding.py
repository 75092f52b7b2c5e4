# SPDX-License-Identifier: Apache-2.0
"""Reading a generation answer by its engine's plan (run.decode_planned): exactly what
json.loads gives, malformed text refused as json.loads refuses it, a copy's values decoded
once and shared, the text of a baseline's lists kept as the server wrote it and saved so."""

import gc
import json
import math
import os
import random
import unittest
from unittest import mock

from support import FIXTURES, PROMPT, StubConfig, StubServer, TempDirTest, fixture, run, run_lab

VLLM = run.VllmAdapter()
SGLANG = run.SglangAdapter()
PLANS = [VLLM.answer_plan(True), VLLM.answer_plan(False), SGLANG.answer_plan(False),
         {"choices": [{"logprobs": {"top_logprobs": [{}]}}]}, {"usage": run.KEEP_TEXT}]


def choice(index, shift, tokens=6):
    """A vLLM choice whose logprobs are shifted by `shift` (copies share a shift)."""
    rng = random.Random(5)
    steps = [[("token_id:%d" % rng.randrange(1000), -rng.uniform(0, 9) - shift) for _ in range(3)]
             for _ in range(tokens)]
    return {"index": index, "text": "some text", "finish_reason": "length", "stop_reason": None,
            "logprobs": {"text_offset": list(range(tokens)), "token_logprobs": [s[0][1] for s in steps],
                         "tokens": [s[0][0] for s in steps], "top_logprobs": [dict(s) for s in steps]}}


def answer(shifts, tokens=6):
    return {"id": "cmpl-1", "object": "text_completion", "model": "m",
            "choices": [choice(i, shift, tokens) for i, shift in enumerate(shifts)],
            "usage": {"prompt_tokens": 3, "completion_tokens": 12, "prompt_tokens_details": None}}


def wires(doc):
    """The same document as servers write it: compact, with spaces, indented."""
    return [json.dumps(doc, separators=(",", ":")), json.dumps(doc), json.dumps(doc, indent=2),
            " \n" + json.dumps(doc, indent="\t") + "\r\n"]


def random_value(rng, depth=0):
    kind = rng.choice(["int", "float", "str", "null", "bool"] + (["list", "dict"] * 2 if depth < 4 else []))
    if kind == "int":
        return rng.choice([0, 1, 12, -7, 10**30])
    if kind == "float":
        return rng.choice([0.5, -1e-7, 1e300, -0.0, math.nan, math.inf])
    if kind == "str":
        return rng.choice(["", "a", 'q"uote', "\u00e9\\", "line\nbreak", "\u0000", "token_id:3"])
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["choices", "logprobs", "tokens", "top_logprobs", "usage", "k\u00e9y", 'q"k', "index"]
    return {rng.choice(keys): random_value(rng, depth + 1) for _ in range(rng.randrange(5))}


class WhatJsonLoadsGives(unittest.TestCase):
    def test_real_and_practice_answers_in_every_layout_and_by_every_plan(self):
        docs = [fixture("completions_two_prompts_logprobs3_token_ids.json"),
                fixture("../sglang-0.5.17/generate_two_off.json"), fixture("../sglang-0.5.17/generate_two_on.json"),
                answer([0]),
                answer([0, 0, 0]), answer([0, 1, 2, 3, 0, 0]), answer([]), {"choices": []}, {}, [],
                [{"text": "a", "meta_info": {"x": [1, 2]}}] * 3]
        for doc in docs:
            for text in wires(doc):
                for plan in PLANS:
                    with self.subTest(doc=str(doc)[:60], text=text[:20], plan=plan):
                        self.assertEqual(run.decode_planned(text, plan), json.loads(text))

    def test_random_documents(self):
        rng = random.Random(2026)
        for _ in range(300):
            doc = {"choices": [random_value(rng) for _ in range(rng.randrange(4))], "usage": random_value(rng)}
            if rng.random() < 0.5:
                member = random_value(rng)
                doc["choices"] = [dict(member if isinstance(member, dict) else {}, logprobs=random_value(rng))] * 2
            text = rng.choice(wires(doc))
            plan = rng.choice(PLANS)
            decoded, expected = run.decode_planned(text, plan), json.loads(text)
            # NaN is never equal to itself: compare what both say in JSON
            self.assertEqual(json.dumps(decoded), json.dumps(expected), (text, plan))

    def test_arrays_whose_objects_differ_short_and_long(self):
        # Walking stops after two objects that repeat little: the rest is decoded at once, by
        # copying it behind a "[" (a short rest) or by decoding the array again (a long one)
        for shifts in (list(range(4)), list(range(200)), [0, 1] + [2] * 50, [0] * 3 + list(range(150))):
            for text in wires(answer(shifts, tokens=2))[:2]:
                self.assertEqual(run.decode_planned(text, VLLM.answer_plan(False)), json.loads(text))

    def test_malformed_text_is_refused_exactly_where_json_loads_refuses_it(self):
        rng = random.Random(7)
        cases = []
        for good in (json.dumps(answer([0, 0, 1])), json.dumps(answer(list(range(120)), tokens=1)),
                     json.dumps(answer(list(range(6)), tokens=2))):
            cases += [good[:n] for n in range(0, len(good), 1 + len(good) // 60)]
            cases += [good + "x", good + "{}", "{" + good]
            for _ in range(150):
                at = rng.randrange(len(good))
                cases.append(good[:at] + rng.choice('{}[],:"x0 \\') + good[at + rng.choice([0, 1]):])
        for text in cases:
            for plan in PLANS[:3]:
                try:
                    expected = json.loads(text)
                except ValueError:
                    with self.assertRaises(ValueError, msg=(text, plan)):
                        run.decode_planned(text, plan)
                else:
                    self.assertEqual(json.dumps(run.decode_planned(text, plan)), json.dumps(expected))


class CopiesDecodedOnce(unittest.TestCase):
    def test_a_copy_shares_the_values_of_the_choice_before_it_and_nothing_else_is_shared(self):
        decoded = run.decode_planned(json.dumps(answer([0, 0, 1, 1])), VLLM.answer_plan(False))
        logprobs = [c["logprobs"] for c in decoded["choices"]]
        self.assertIs(logprobs[1], logprobs[0])
        self.assertIsNot(logprobs[2], logprobs[1])
        self.assertIs(logprobs[3], logprobs[2])
        self.assertEqual([c["index"] for c in decoded["choices"]], [0, 1, 2, 3])

    def test_copies_after_a_first_choice_that_differs_are_still_shared(self):
        # real vLLM 0.26.0 and SGLang 0.5.17 answered copies in two runs of alike choices
        decoded = run.decode_planned(json.dumps(answer([5, 0, 0, 0])), VLLM.answer_plan(False))
        logprobs = [c["logprobs"] for c in decoded["choices"]]
        self.assertIsNot(logprobs[1], logprobs[0])
        self.assertIs(logprobs[2], logprobs[1])
        self.assertIs(logprobs[3], logprobs[1])

    def test_sglang_copies_share_their_meta_info(self):
        for name in ("generate_two_off.json", "generate_two_on.json"):
            with open(os.path.join(FIXTURES, "..", "sglang-0.5.17", name), encoding="utf-8") as f:
                text = f.read()
            decoded = run.decode_planned(text, SGLANG.answer_plan(False))
            self.assertEqual(decoded, json.loads(text))
            for lists in ("output_token_logprobs", "output_top_logprobs"):
                self.assertIs(decoded[1]["meta_info"][lists], decoded[0]["meta_info"][lists])
            self.assertNotEqual(decoded[1]["meta_info"]["id"], decoded[0]["meta_info"]["id"])

    def test_a_number_that_begins_like_the_one_before_is_not_taken_for_it(self):
        text = '{"choices":[{"index":1,"n":12},{"index":12,"n":1},{"index":1,"n":12.5}]}'
        self.assertEqual(run.decode_planned(text, VLLM.answer_plan(False)), json.loads(text))

    def test_the_lab_reads_copies_alike_and_a_different_choice_apart(self):
        completions = VLLM.completions(run.decode_planned(json.dumps(answer([0, 0, 1])), VLLM.answer_plan(False)),
                                       3, True)
        self.assertTrue(run.same_completion(completions[1], completions[0]))
        self.assertFalse(run.same_completion(completions[2], completions[1]))
        self.assertEqual(run.compare_completions(completions[0], completions[2]).max_ulp > 0, True)


class TextsKept(unittest.TestCase):
    def test_the_baseline_lists_text_is_the_servers_own(self):
        for text in wires(answer([0])):
            decoded = run.decode_planned(text, VLLM.answer_plan(True))
            c = VLLM.completions(decoded, 1, True)[0]
            self.assertEqual(sorted(c.texts), ["logprobs", "tokens", "top_logprobs"])
            for name, kept in c.texts.items():
                self.assertIn(kept, text)
                self.assertEqual(json.loads(kept), getattr(c, name))

    def test_what_is_not_the_servers_list_keeps_no_text(self):
        doc = answer([0])
        doc["choices"][0]["logprobs"]["top_logprobs"][2] = None  # the lab mends this list
        c = VLLM.completions(run.decode_planned(json.dumps(doc), VLLM.answer_plan(True)), 1, True)[0]
        self.assertEqual(sorted(c.texts), ["logprobs", "tokens"])
        self.assertIsNone(VLLM.completions(json.loads(json.dumps(doc)), 1, True)[0].texts)

    def test_a_completion_is_saved_as_it_would_be_encoded(self):
        for doc, layout in ((answer([0]), None), (answer([0]), 1)):
            doc["choices"][0]["logprobs"]["token_logprobs"][0] = -math.inf if layout else -0.0
            text = json.dumps(doc, indent=layout)
            c = VLLM.completions(run.decode_planned(text, VLLM.answer_plan(True)), 1, True)[0]
            saved = run.completion_json(c)
            self.assertEqual(json.loads(saved), json.loads(run.json_text(c.to_record())))
            self.assertNotIn("\n", saved)  # one line, and standard JSON (no -Infinity)
            self.assertNotIn("Infinity\n", saved.replace('"-Infinity"', ""))


class SavedAsTheServerWroteThem(TempDirTest):
    def test_a_saved_baseline_holds_the_servers_text_encoded_by_no_one_else(self):
        encoded = []  # every document the lab encodes while it saves
        real = run.json_text
        with StubServer(StubConfig()) as stub, \
                mock.patch.object(run, "json_text", lambda doc, *a: (encoded.append(doc), real(doc, *a))[1]):
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,3", "--max-tokens", 5,
                        "--save", self.path("s.json"))
            self.assertEqual(r.code, 0, r)
            # The practice engine answers batch 1 alike every time: ask for it once more
            client = run.HttpClient(stub.url, None, 10, 1 << 20)
            body = json.loads(stub.generation_bodies()[0])
            self.assertEqual(body["prompt"], [PROMPT])
            kept = VLLM.completions(client.request("/v1/completions", body, plan=VLLM.answer_plan(True)),
                                    1, True)[0].texts
        with open(self.path("s.json"), encoding="utf-8") as f:
            saved_text = f.read()
        self.assertIn(kept["top_logprobs"], saved_text)
        baselines = [d for d in encoded if "top_logprobs" in d]
        self.assertTrue(baselines)
        self.assertFalse([d for d in baselines if isinstance(d["top_logprobs"], list)])  # never encoded
        self.assertEqual(saved_text.count("\n"), 1)
        baseline = json.loads(saved_text)["prompts"][0]["baseline"]
        self.assertEqual(baseline["top_logprobs"], json.loads(kept["top_logprobs"]))


class CopiesInTwoRuns(unittest.TestCase):
    def test_a_sweep_compares_each_run_of_copies_and_finds_what_a_plain_decode_finds(self):
        compared = []
        real = run.compare_completions
        with StubServer(StubConfig(copies_split=3)) as stub, \
                mock.patch.object(run, "compare_completions",
                                  lambda *a: (compared.append(a[1]), real(*a))[1]):
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,8", "--max-tokens", 16,
                        "--repeat", 1, "--json")
            self.assertEqual(r.code, 0, r)
            client = run.HttpClient(stub.url, None, 10, 1 << 20)
            bodies = [json.loads(b) for b in stub.generation_bodies()]
            plain = [VLLM.completions(client.request("/v1/completions", b), len(b["prompt"]), True)
                     for b in bodies]
        row = {s["batch_size"]: s for s in json.loads(r.stdout)["prompts"][0]["sizes"]}[8]
        base, batch = plain[0][0], plain[1]
        self.assertEqual(row["max_ulp"], max(real(base, c).max_ulp for c in batch))
        self.assertGreater(row["max_ulp"], 0)
        self.assertEqual(len(compared), 1 + 2)  # batch 1, then each run of batch 8 once


class CollectorPaused(unittest.TestCase):
    def test_the_collector_is_on_again_after_a_sweep_and_after_a_failed_one_and_off_stays_off(self):
        with StubServer(StubConfig()) as stub:
            self.assertEqual(run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 2).code, 0)
            self.assertTrue(gc.isenabled())
            with StubServer(StubConfig(faults={1: "http500"})) as broken:
                self.assertNotEqual(run_lab("--mode", "sweep", "--url", broken.url, "--sizes", "1",
                                            "--max-tokens", 2).code, 0)
            self.assertTrue(gc.isenabled())
            gc.disable()
            try:
                run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1", "--max-tokens", 2)
                self.assertFalse(gc.isenabled())
            finally:
                gc.enable()


if __name__ == "__main__":
    unittest.main()
