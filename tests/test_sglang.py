"""SGLang as it really is (0.5.23): the seed ignored with the flag off, decode graphs that can
be off while their sizes stay listed, the effective running-request limit, its clamp value,
and the practice engine's SGLang side, point by point."""

import json
import unittest
import urllib.request

from support import StubConfig, StubServer, TempDirTest, fixture, post, run, run_lab
from stub_server import sglang_server_info


def arm_differences(off, on):
    """What cost mode finds between two arms' settings."""
    return run.SettingDifference.between(off, on, ("off", "on"), flag_own=True)

SGLANG_CLAMP = -3.4028234663852886e38  # torch.finfo(torch.float32).min




def sweep(stub, *extra):
    # copies in one request: each size one batch of the stub's (unless extra names a --traffic)
    return run_lab("--mode", "sweep", "--engine", "sglang", "--url", stub.url, "--max-tokens", 16,
                   "--traffic", "copies", *extra)


class UnseededFlagOffArm(TempDirTest):
    def test_seeded_sweep_on_a_flag_off_server_warns_and_records_it(self):
        with StubServer(StubConfig(engine="sglang")) as stub:
            r = sweep(stub, "--temperature", 0.6, "--sizes", "1,2,9", "--save", self.path("s.json"))
        self.assertEqual(r.code, 0, r)
        self.assertIn("does not honour the seed", r.stderr)
        self.assertIn("sampling_batch_info.py", r.stderr)
        doc = self.load("s.json")
        self.assertIs(doc["params"]["seed_honoured"], False)
        self.assertIs(doc["server"]["seed_honoured"], False)
        self.assertEqual(doc["summary"]["verdict"], "sampling noise not ruled out")
        self.assertIn("seed 42 (IGNORED by the server)", r.stdout)

    def test_the_negative_control_does_not_pass_on_sampling_noise(self):
        with StubServer(StubConfig(engine="sglang")) as stub:
            r = sweep(stub, "--temperature", 0.6, "--sizes", "1,2", "--expect", "variant")
        self.assertEqual(r.code, 1, r)
        self.assertIn("not put down to batching", r.stdout)

    def test_flag_on_honours_the_seed_and_does_not_warn(self):
        with StubServer(StubConfig(engine="sglang", invariant=True)) as stub:
            r = sweep(stub, "--temperature", 0.6, "--sizes", "1,2,9", "--json", "--expect", "invariant")
        self.assertEqual(r.code, 0, r)
        self.assertNotIn("honour", r.stderr)
        self.assertIs(r.json()["params"]["seed_honoured"], True)

    def test_greedy_is_not_affected(self):
        with StubServer(StubConfig(engine="sglang")) as stub:
            r = sweep(stub, "--sizes", "1,2,9", "--json")
        self.assertNotIn("honour", r.stderr)
        self.assertIn(r.json()["summary"]["verdict"], run.BATCH_EFFECTS)

    def test_the_verdict_rule(self):
        m = run.Measured
        self.assertEqual(run.verdict(m(6, 3, 5, True, moved=True, compared=True, unseeded=True)), run.NOISE_NOT_RULED_OUT)
        self.assertEqual(run.verdict(m(6, 1, compared=True, batch1_repeatable=False, unseeded=True)),
                         run.NOISE_NOT_RULED_OUT)
        self.assertEqual(run.verdict(m(6, 1, compared=True, unseeded=True)), "invariant")
        self.assertEqual(run.verdict(m(6, 1, compared=True, batch1_repeatable=False)), run.NOT_REPEATABLE)


class DecodeGraphsOff(unittest.TestCase):
    def test_every_size_has_bucket_none(self):
        with StubServer(StubConfig(engine="sglang", decode_graphs=False)) as stub:
            r = sweep(stub, "--sizes", "1,2,15,16,17", "--repeat", 1, "--json")
        self.assertEqual(r.code, 0, r)
        doc = r.json()
        self.assertEqual([s["bucket"] for s in doc["prompts"][0]["sizes"]], [None] * 5)
        self.assertEqual(doc["server"]["graph_sizes"], [])

    def test_the_default_ladder_still_straddles_the_engines_sizes(self):
        with StubServer(StubConfig(engine="sglang", decode_graphs=False)) as stub:
            r = sweep(stub, "--max-batch", 9, "--repeat", 1, "--max-tokens", 4, "--json")
        self.assertEqual(r.json()["params"]["sizes"], [1, 2, 3, 4, 5, 7, 8, 9])

    def test_a_cost_pair_that_differs_in_the_decode_graph_backend_is_refused(self):
        with StubServer(StubConfig(engine="sglang")) as off, \
                StubServer(StubConfig(engine="sglang", invariant=True, decode_graphs=False)) as on:
            r = run_lab("--mode", "cost", "--engine", "sglang", "--url", off.url, "--invariant", on.url)
            self.assertEqual(r.code, 2, r)
            self.assertIn("CUDA-graph decode backend", r.stderr)
            self.assertEqual(len(r.stderr.strip().splitlines()), 1)
            self.assertEqual(off.generation_bodies() + on.generation_bodies(), [])


class EffectiveLimits(TempDirTest):
    def test_the_limit_in_force_comes_from_internal_states(self):
        with StubServer(StubConfig(engine="sglang", max_num_seqs=16)) as stub:
            refused = sweep(stub, "--sizes", "1,17", "--repeat", 1, "--max-tokens", 4)
            r = sweep(stub, "--max-batch", 32, "--repeat", 1, "--max-tokens", 4, "--save", self.path("s.json"))
        # a size the server never runs as one batch is refused before any generation request
        self.assertEqual(refused.code, 2, refused)
        self.assertIn("the server runs at most 16 requests at once", refused.stderr)
        self.assertEqual(r.code, 0, r)
        self.assertIn("the ladder stops at batch 16", r.stderr)
        self.assertLessEqual(max(self.load("s.json")["params"]["sizes"]), 16)
        server = self.load("s.json")["server"]
        self.assertEqual((server["max_num_seqs"], server["max_num_seqs_source"]),
                         (16, "internal_states[].effective_max_running_requests_per_dp"))
        self.assertEqual((server["max_model_len"], server["max_model_len_source"]), (2048, "/v1/models"))

    def test_the_raw_flags_stand_in_when_nothing_better_is_there(self):
        info = sglang_server_info(StubConfig(engine="sglang"), 30000)
        del info["internal_states"]
        info.update(max_running_requests=48, context_length=4096)
        facts = run.ADAPTERS["sglang"].facts(info, None)
        self.assertEqual((facts.max_num_seqs, facts.max_num_seqs_source), (48, "max_running_requests"))
        self.assertEqual((facts.max_model_len, facts.max_model_len_source), (4096, "context_length"))
        info["max_running_requests"] = None
        self.assertIsNone(run.ADAPTERS["sglang"].facts(info, None).max_num_seqs)

    def test_the_smallest_rank_limit_is_the_one_that_binds(self):
        info = sglang_server_info(StubConfig(engine="sglang"), 30000)
        info["internal_states"] = [{"effective_max_running_requests_per_dp": n} for n in (24, 12)]
        self.assertEqual(run.ADAPTERS["sglang"].facts(info, None).max_num_seqs, 12)


class CostHeaderLabels(unittest.TestCase):
    def test_the_flag_s_row_names_it_whole_and_the_columns_stay_aligned(self):
        with StubServer(StubConfig(engine="sglang")) as off, \
                StubServer(StubConfig(engine="sglang", invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 1,
                        "--trials", 1, "--warmup", 0, "--max-tokens", 2)
        self.assertEqual(r.code, 0, r)
        lines = r.stdout.splitlines()
        header = next(i for i, line in enumerate(lines) if line.startswith("setting "))
        flag = lines[header + 1]
        self.assertEqual(flag.split(), ["--enable-deterministic-inference", "off", "on"], flag)
        column = lines[header].index("--url (flag off)")
        self.assertEqual(flag.index(" off") + 1, column)
        self.assertNotEqual(lines[header + 2][column], " ")  # the next row's value starts there


class ClampValue(unittest.TestCase):
    def test_sglangs_clamp_counts_as_clamped_not_as_a_distance(self):
        clamps = run.ADAPTERS["sglang"].logprob_clamps
        self.assertEqual(clamps, (SGLANG_CLAMP,))
        self.assertEqual(run.logprob_distance(SGLANG_CLAMP, -12.5, clamps), (None, "clamped"))
        base = run.Completion("ab", ["a", "b"], [-1.5, -2.5], [{}, {}])
        other = run.Completion("ab", ["a", "b"], [SGLANG_CLAMP, -2.5], [{}, {}])
        d = run.compare_completions(base, other, clamps)
        self.assertEqual((d.max_ulp, d.first_ulp_step, d.ulp_notes), (0, 0, ("clamped",)))
        # without the engine's clamp it would have been a distance of about a billion ULPs
        self.assertGreater(run.compare_completions(base, other).max_ulp, 10 ** 9)

    def test_a_clamped_logprob_in_a_sweep_is_footnoted(self):
        with StubServer(StubConfig(engine="sglang", invariant=True, faults={2: "clamp"})) as stub:
            r = sweep(stub, "--sizes", "1,2", "--repeat", 1)
        self.assertEqual(r.code, 0, r)
        self.assertIn("clamped -inf", r.stdout)
        self.assertIn("logprobs moved but tokens held", r.stdout)
        row2 = next(line.split() for line in r.stdout.splitlines() if line.split()[:1] == ["2"])
        self.assertEqual(row2[7], "0*")  # no distance, footnoted


class PracticeEngineLike0523(unittest.TestCase):
    """The stub's SGLang side, point by point against 0.5.23."""

    def generate(self, stub, **body):
        body.setdefault("sampling_params", {"temperature": 0.0, "max_new_tokens": 4})
        return post(stub.url + "/generate", body)

    def test_seed_ignored_with_the_flag_off_honoured_with_it_on(self):
        sp = {"temperature": 0.9, "max_new_tokens": 24, "sampling_seed": 7}
        for invariant, same in ((False, False), (True, True)):
            with self.subTest(invariant=invariant):
                with StubServer(StubConfig(engine="sglang", invariant=invariant)) as stub:
                    texts = {self.generate(stub, text="p", sampling_params=dict(sp))[1]["text"] for _ in range(4)}
                self.assertEqual(len(texts) == 1, same, texts)

    def test_a_null_seed_is_accepted(self):
        with StubServer(StubConfig(engine="sglang")) as stub:
            status, answer = self.generate(stub, text="p", sampling_params={"sampling_seed": None, "max_new_tokens": 2})
        self.assertEqual(status, 200, answer)

    def test_error_bodies(self):
        with StubServer(StubConfig(engine="sglang")) as stub:
            status, answer = self.generate(stub, text="p", sampling_params={"seed": 1})
            self.assertEqual((status, type(answer["error"])), (400, str))
            status, answer = self.generate(stub, text="p", sampling_params={"sampling_seed": "x"})
            self.assertEqual(status, 400)
            self.assertIn("sampling_seed must be an integer", answer["error"]["message"])
            status, answer = self.generate(stub, text=7)
            self.assertEqual((status, answer.get("object")), (400, "error"))
            self.assertIn("message", answer)

    def test_logprob_keys(self):
        with StubServer(StubConfig(engine="sglang")) as stub:
            _, with_top = self.generate(stub, text="p", return_logprob=True, top_logprobs_num=3)
            _, without_top = self.generate(stub, text="p", return_logprob=True, top_logprobs_num=0)
            _, none = self.generate(stub, text="p")
        self.assertIn("input_token_logprobs", with_top["meta_info"])
        self.assertEqual(len(with_top["meta_info"]["output_top_logprobs"]), 4)
        self.assertIn("output_token_logprobs", without_top["meta_info"])
        self.assertNotIn("output_top_logprobs", without_top["meta_info"])
        self.assertNotIn("output_token_logprobs", none["meta_info"])
        comps = run.ADAPTERS["sglang"].completions([without_top], 1, True)
        self.assertEqual(comps[0].top_logprobs, [{}] * 4)

    def test_input_ids_in_place_of_text(self):
        with StubServer(StubConfig(engine="sglang")) as stub:
            status, one = self.generate(stub, input_ids=[11, 12, 13])
            status2, many = self.generate(stub, input_ids=[[11, 12, 13], [14, 15]])
        self.assertEqual((status, status2), (200, 200))
        self.assertEqual(len(one["output_ids"]), 4)
        self.assertEqual(len(many), 2)
        self.assertEqual(many[0]["text"], one["text"])

    def test_server_info_fields(self):
        with StubServer(StubConfig(engine="sglang", max_num_seqs=16, decode_graphs=False)) as stub:
            with urllib.request.urlopen(stub.url + "/server_info", timeout=10) as resp:
                info = json.loads(resp.read())
        self.assertIsNone(info["max_running_requests"])
        self.assertIsNone(info["context_length"])
        self.assertEqual(info["internal_states"][0]["effective_max_running_requests_per_dp"], 16)
        self.assertEqual(info["cuda_graph_config"]["decode"]["backend"], "disabled")
        self.assertFalse(info["disable_cuda_graph"])
        self.assertTrue(info["cuda_graph_config"]["decode"]["bs"])


class RealAnswers0523(unittest.TestCase):
    """The two arms of the real SGLang 0.5.23 experiment (fixtures/sglang-0.5.23), read by the
    adapter as that run's REPORT.md shows them, and the practice engine held against them."""

    FOLDER = "sglang-0.5.23"

    def info(self, arm):
        return fixture("server_info_flag_%s.json" % arm, self.FOLDER)

    def facts(self, info):
        return run.ADAPTERS["sglang"].facts(info, None).checked()

    def test_the_real_pair_reads_as_its_report_says(self):
        off, on = self.facts(self.info("off")), self.facts(self.info("on"))
        self.assertEqual((off.version, off.flag, on.flag), ("0.5.23", False, True))
        for facts in (off, on):
            self.assertEqual((facts.attention_backend, facts.tp), ("triton", 1))
            self.assertEqual((facts.graph_sizes, facts.graph_source),
                             ([1, 2, 4, 8, 12, 16, 24, 32], "reported"))
            self.assertEqual(facts.max_num_seqs_source,
                             "internal_states[].effective_max_running_requests_per_dp")
            self.assertEqual(facts.hazards, [])
        self.assertEqual(arm_differences(off, on), [])

    def test_a_setting_edited_on_one_arm_is_a_difference(self):
        edits = {
            "attention backend": ("attention_backend", "fa3"),
            "CUDA-graph prefill backend": ("cuda_graph_config", "prefill", "backend", "disabled"),
        }
        for label, edit in edits.items():
            with self.subTest(setting=label):
                on_info = self.info("on")
                *path, key, value = edit
                dig_into(on_info, path)[key] = value
                differences = arm_differences(self.facts(self.info("off")), self.facts(on_info))
                self.assertEqual([d.setting for d in differences], [label])

    def test_the_real_generate_answer(self):
        answer = fixture("generate_logprobs3_on.json", self.FOLDER)
        (completion,) = run.ADAPTERS["sglang"].completions([answer], 1, True)
        self.assertEqual(completion.tokens, ["token_id:%d" % t for t in answer["output_ids"]])
        self.assertEqual([len(top) for top in completion.top_logprobs], [3] * 4)
        self.assertEqual(completion.finish_reason, "length")

    def test_the_practice_engine_sends_every_setting_the_real_one_sends(self):
        real, practice = self.info("off"), sglang_server_info(StubConfig(engine="sglang"), 30000)
        for label, path in run.ADAPTERS["sglang"].SETTINGS:
            with self.subTest(setting=label):
                if has_path(real, path):
                    self.assertTrue(has_path(practice, path), path)


def dig_into(info, path):
    for key in path:
        info = info[key]
    return info


def has_path(info, path):
    """Does a JSON answer hold this path of keys (whatever its value, null included)?"""
    for key in path:
        if not isinstance(info, dict) or key not in info:
            return False
        info = info[key]
    return True


class AnswersOfTheWrongShape(unittest.TestCase):
    def item(self, steps, top=None, ids=None):
        meta = {"output_token_logprobs": steps, "finish_reason": {"type": "length"}}
        if top is not None:
            meta["output_top_logprobs"] = top
        item = {"text": "x", "meta_info": meta}
        if ids is not None:
            item["output_ids"] = ids
        return [item]

    def refused(self, answer, words):
        with self.assertRaises(run.ServerError) as caught:
            run.SglangAdapter().completions(answer, 1, True)
        self.assertIn(words, str(caught.exception))

    def test_sglang_token_ids_must_be_whole_numbers_each_once_and_agree_with_output_ids(self):
        self.refused(self.item([[-0.5, 1.5, None]]), "not a whole number")
        self.refused(self.item([[-0.5, True, None]]), "not a whole number")
        self.refused(self.item([[-0.5, 3, None]], top=[[[-0.5, 3, None], [-1.0, 3, None]]]),
                     "each once a step")
        self.refused(self.item([[-0.5, 3, None]], ids=[4]), "output_ids are not the tokens")
        good = run.SglangAdapter().completions(self.item([[-0.5, 3, None]], ids=[3]), 1, True)
        self.assertEqual(good[0].tokens, ["token_id:3"])


if __name__ == "__main__":
    unittest.main()
