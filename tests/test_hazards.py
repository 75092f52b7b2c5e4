"""Known hazards: the server settings that upstream reports say break or weaken batch
invariance, found in each server's own facts, printed before measuring and saved."""

import copy
import unittest

from support import StubConfig, StubServer, TempDirTest, fixture, run, run_lab

# (engine, /server_info path, value that switches the hazard on, words of its setting, reference)
SWITCHES = [
    ("vllm", ("vllm_config", "compilation_config", "pass_config", "enable_sp"), True, "sequence parallelism",
     "vllm-project/vllm#56370"),
    ("vllm", ("vllm_config", "compilation_config", "pass_config", "fuse_gemm_comms"), True, "sequence parallelism",
     "vllm-project/vllm#56370"),
    ("vllm", ("vllm_config", "speculative_config"), {"method": "ngram", "num_speculative_tokens": 4},
     "speculative decoding", "vllm-project/vllm#54506"),
    ("vllm", ("vllm_config", "model_config", "quantization"), "fp8", "online FP8 quantization",
     "vllm-project/vllm#57016"),
    ("sglang", ("kv_cache_dtype",), "fp8_e4m3", "FP8 KV cache", "sgl-project/sglang#35938"),
    ("vllm", ("vllm_env", "VLLM_USE_FLASHINFER_SAMPLER"), True, "FlashInfer sampler",
     "vllm-project/vllm#51187"),
]


class HazardsKnowTheirReleases(TempDirTest):
    def test_a_hazard_fixed_in_a_release_is_not_raised_against_it(self):
        fp8 = {("vllm_config", "model_config", "quantization"): "fp8"}
        raised = {}
        for version in ("0.26.0", "0.33.0"):
            config = StubConfig(version=version, info_overrides=fp8)
            with StubServer(config) as stub:
                r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                            "--repeat", 1, "--json")
            self.assertEqual(r.code, 0, r)
            raised[version] = [h["setting"] for h in r.json()["server"]["hazards"]]
        self.assertEqual(len(raised["0.26.0"]), 1, raised)
        self.assertIn("online FP8 quantization", raised["0.26.0"][0])
        self.assertEqual(raised["0.33.0"], [])  # per-token scales with the flag from 0.33.0

    def test_an_unknown_release_is_not_taken_for_a_fixed_one(self):
        info = {"vllm_config": {"model_config": {"quantization": "fp8"}}}
        self.assertEqual(len(run.hazards_in("vllm", info, None)), 1)
        self.assertEqual(len(run.hazards_in("vllm", info, "0.32.1")), 1)
        self.assertEqual(run.hazards_in("vllm", info, "0.33.0+cu130"), [])


class ReleasesComparedAsReleases(unittest.TestCase):
    """A release is read as Python's packaging orders it: what comes before a fix has none."""

    FP8 = {"vllm_config": {"model_config": {"quantization": "fp8"}}}

    def test_pre_releases_and_dev_builds_come_before_their_release(self):
        for version in ("0.33.0rc1", "0.33.0.dev12+g1234abc", "0.33.0a1", "0.33.0b2",
                        "0.33.0-rc1", "0.33.0.dev0", "0.32.1", "0.32.99.post3"):
            with self.subTest(version=version):
                self.assertEqual(len(run.hazards_in("vllm", self.FP8, version)), 1)

    def test_the_release_and_what_follows_it_have_the_fix(self):
        for version in ("0.33", "0.33.0", "0.33.0+cu130", "0.33.0.post1", "0.33.1", "1.0"):
            with self.subTest(version=version):
                self.assertEqual(run.hazards_in("vllm", self.FP8, version), [])

    def test_what_cannot_be_read_is_unknown_and_raises_the_hazard(self):
        for version in (None, "", "abc", "9" * 5000, 33, "0.33.0 and more"):
            with self.subTest(version=str(version)[:12]):
                self.assertIsNone(run.release(version))
                self.assertEqual(len(run.hazards_in("vllm", self.FP8, version)), 1)

    def test_the_order(self):
        order = ["0.32.1", "0.33.0.dev1", "0.33.0a1", "0.33.0b2", "0.33.0rc1", "0.33.0",
                 "0.33.0.post1", "0.33.1", "1.0"]
        keys = [run.release(v) for v in order]
        self.assertEqual(keys, sorted(keys))
        self.assertEqual(run.release("0.33"), run.release("0.33.0"))

    def test_the_flags_own_settings_only_on_the_releases_whose_flag_sets_them(self):
        # vLLM 0.26.0 with compilation mode 0 and breakable CUDA graphs on its flag-on arm: the
        # user's own settings, a difference between the arms, not the flag's
        folder = "vllm-0.33.0"
        models = fixture("v1_models.json", folder)
        facts = {}
        for version in ("0.26.0", "0.33.0rc1", "0.33.0"):
            off, on = (run.ADAPTERS["vllm"].facts(version, models, fixture(name, folder), None)
                       for name in ("server_info_flag_off.json", "server_info_flag_on.json"))
            facts[version] = run.SettingDifference.between(off.checked(), on.checked(),
                                                           ("off", "on"), flag_own=True)
        self.assertEqual(facts["0.33.0"], [])
        for version in ("0.26.0", "0.33.0rc1"):
            self.assertEqual({d.setting for d in facts[version]},
                             {"compilation mode", "breakable CUDA graph"}, version)


def with_settings(info, settings):
    """A copy of a real /server_info answer with settings written in ({path: value})."""
    info = copy.deepcopy(info)
    for path, value in settings.items():
        node = info
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return info


FLASHINFER_ON = {("vllm_env", "VLLM_USE_FLASHINFER_SAMPLER"): True}
V1_ROW, V2_ROW = "old (V1) model runner", "V2 model runner"


class HazardsByRelease(unittest.TestCase):
    """Rows re-read at vLLM 0.34.0, each present on one release and absent on another, on the
    real 0.33.0 answers and on 0.34.0's (fixtures/vllm-0.34.0: the real arms' settings)."""

    def setUp(self):
        self.off_033 = fixture("server_info_flag_off.json", "vllm-0.33.0")
        self.on_033 = fixture("server_info_flag_on.json", "vllm-0.33.0")

    def rows(self, info, version):
        return [h["setting"] for h in run.hazards_in("vllm", info, version)]

    def test_the_flashinfer_sampler_by_model_runner(self):
        info = with_settings(self.on_033, FLASHINFER_ON)
        opted_out = with_settings(info, {("vllm_env", "VLLM_USE_V2_MODEL_RUNNER"): False})
        cases = [("0.26.0", info, V1_ROW),  # before the V2 runner was the default
                 ("0.33.0", info, V2_ROW),  # 0.33.0 runs V2 unless told not to
                 ("0.33.0", opted_out, V1_ROW),
                 ("0.34.0", info, V2_ROW),  # V1 is gone
                 ("0.34.0", opted_out, V2_ROW)]
        for version, server, row in cases:
            with self.subTest(version=version, opted_out=server is opted_out):
                rows = self.rows(server, version)
                self.assertEqual(len(rows), 1, rows)
                self.assertIn(row, rows[0])
        self.assertEqual(len(self.rows(info, None)), 2)  # an unknown release: either may run
        self.assertEqual(self.rows(self.on_033, "0.34.0"), [])  # the sampler switched off

    def test_the_v2_row_says_who_it_concerns(self):
        row = next(h for h in run.HAZARDS if V2_ROW in h.setting)
        self.assertIn("unseeded", row.setting)
        self.assertIn("flag on too", row.why)
        self.assertIn("sampler.py lines 304-315", row.versions)
        self.assertIn("301-312", row.versions)

    def test_the_sliding_window_fix_from_0_34_0(self):
        window = {("vllm_config", "cache_config", "sliding_window"): 4096}
        on, off = with_settings(self.on_033, window), with_settings(self.off_033, window)
        self.assertTrue(self.on_033["vllm_config"]["attention_config"]["backend"]
                        .endswith(".FlashAttentionBackend"))
        before = self.rows(on, "0.33.0")
        self.assertEqual(len(before), 1, before)
        self.assertIn("sliding-window", before[0])
        self.assertEqual(self.rows(on, "0.34.0"), [])
        self.assertEqual(self.rows(off, "0.33.0"), [])  # flag off: it moves anyway
        triton = with_settings(on, {("vllm_config", "attention_config", "backend"):
                                    "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend"})
        self.assertEqual(self.rows(triton, "0.33.0"), [])
        self.assertEqual(self.rows(self.on_033, "0.33.0"), [])  # no sliding window

    def test_through_the_practice_engine_serving_each_release(self):
        raised = {}
        for version in ("0.26.0", "0.33.0", "0.34.0"):
            with StubServer(StubConfig(version=version, info_overrides=FLASHINFER_ON)) as stub:
                r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2",
                            "--max-tokens", 4, "--repeat", 1, "--json")
            self.assertEqual(r.code, 0, r)
            raised[version] = [h["setting"] for h in r.json()["server"]["hazards"]]
        self.assertIn(V1_ROW, raised["0.26.0"][0])
        self.assertIn(V2_ROW, raised["0.33.0"][0])
        self.assertIn(V2_ROW, raised["0.34.0"][0])
        self.assertEqual([len(rows) for rows in raised.values()], [1, 1, 1])


class TpCostsAcrossTheAllReduceChange(unittest.TestCase):
    def test_a_note_only_where_tp_cells_straddle_0_34_0(self):
        straddle = run.tp_cost_release_notes("vllm", [("0.33.0", 2), ("0.34.0", 2), ("0.34.0", 1)])
        self.assertEqual(len(straddle), 1, straddle)
        self.assertIn("TP > 1 costs measured before 0.34.0 and from it are not comparable",
                      straddle[0])
        self.assertIn("one-stage custom all-reduce", straddle[0])
        for cells in ([("0.33.0", 1), ("0.34.0", 1)],  # TP 1: no all-reduce
                      [("0.34.0", 2), ("0.34.1", 4)],  # one side only
                      [("0.33.0", 2), (None, 2), ("0.34.0", None)]):  # unknowns straddle nothing
            with self.subTest(cells=cells):
                self.assertEqual(run.tp_cost_release_notes("vllm", cells), [])
        self.assertEqual(run.tp_cost_release_notes("sglang", [("0.33.0", 2), ("0.34.0", 2)]), [])


class EachHazardOnItsOwn(TempDirTest):
    def test_one_at_a_time_in_the_header_and_the_saved_file(self):
        for i, (engine, path, value, words, ref) in enumerate(SWITCHES):
            with self.subTest(engine=engine, path=path):
                overrides = {path: value}
                if engine == "sglang":
                    overrides[("disable_radix_cache",)] = True  # only the hazard under test
                with StubServer(StubConfig(engine=engine, info_overrides=overrides)) as stub:
                    r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                                "--repeat", 1, "--save", self.path("s%d.json" % i))
                self.assertEqual(r.code, 0, r)
                hazards = self.load("s%d.json" % i)["server"]["hazards"]
                self.assertEqual(len(hazards), 1, hazards)
                self.assertIn(words, hazards[0]["setting"])
                self.assertIn(ref, hazards[0]["refs"])
                header = r.stdout[:r.stdout.index("params:")]
                self.assertIn("HAZARD: " + hazards[0]["setting"], header)
                self.assertIn(ref, header)

    def test_the_radix_cache_default_is_one(self):
        with StubServer(StubConfig(engine="sglang")) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4, "--repeat", 1,
                        "--json")
        self.assertEqual([h["refs"] for h in r.json()["server"]["hazards"]], ["sgl-project/sglang#34683"])

    def test_a_server_with_none(self):
        with StubServer() as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4, "--repeat", 1)
        self.assertIn("known hazards: none known", r.stdout)

    def test_hidden_settings_are_unknown_not_none(self):
        with StubServer(StubConfig(dev_mode=False)) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4, "--repeat", 1,
                        "--json")
        self.assertIsNone(r.json()["server"]["hazards"])

    def test_cost_prints_both_arms_hazards_and_saves_them(self):
        spec = {("vllm_config", "speculative_config"): {"method": "ngram"}}
        with StubServer(StubConfig(info_overrides=spec)) as off, \
                StubServer(StubConfig(invariant=True, info_overrides=spec)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 1, "--trials", 1,
                        "--warmup", 0, "--max-tokens", 2, "--save", self.path("c.json"))
        self.assertEqual(r.code, 0, r)
        self.assertIn("flag-off arm: HAZARD: speculative decoding", r.stdout)
        self.assertIn("flag-on arm: HAZARD: speculative decoding", r.stdout)
        cell = self.load("c.json")["cells"][0]
        self.assertEqual(len(cell["servers"]["on"]["hazards"]), 1)

    def test_a_flag_on_divergence_lists_the_hazards_before_the_checklist(self):
        spec = {("vllm_config", "speculative_config"): {"method": "ngram"}}
        with StubServer(StubConfig(invariant=True, coverage_gap=True, info_overrides=spec,
                                   prefix_caching=False)) as stub:
            r = run_lab("--mode", "sweep", "--traffic", "copies", "--url", stub.url, "--sizes", "1,17,25", "--max-tokens", 32, "--repeat", 1)
        tail = r.stdout[r.stdout.index("reports the flag ON"):]
        self.assertLess(tail.index("HAZARD: speculative decoding"), tail.index("fused-MoE"))


SGLANG_NEWEST = "0.5.23"


class TheNewestHazards(unittest.TestCase):
    """vllm#54035, sglang#36291 and sglang#36174: each raised where its setting and release
    meet, and not where they do not (all three open when read: no release has a fix)."""

    def refs(self, engine, info, version):
        return [h["refs"].split(" ")[0] for h in run.hazards_in(engine, info, version)]

    def test_vllm_fp8_kv_cache_decode_against_prefill(self):
        ref = "vllm-project/vllm#54035"
        for version in ("0.28.0", "0.33.0", "0.34.0", "0.34.1rc1", None):
            for backend in (None, "FLASH_ATTN",
                            "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"):
                info = {"vllm_config": {"cache_config": {"cache_dtype": "fp8_e4m3"},
                                        "attention_config": {"backend": backend}}}
                with self.subTest(version=version, backend=backend):
                    self.assertIn(ref, self.refs("vllm", info, version))
        quiet = [({"cache_dtype": "auto"}, None), ({"cache_dtype": "bfloat16"}, "FLASH_ATTN"),
                 ({"cache_dtype": "fp8"}, "FLASHINFER")]  # another kernel: not the FA3 split
        for cache, backend in quiet:
            info = {"vllm_config": {"cache_config": cache, "attention_config": {"backend": backend}}}
            with self.subTest(cache=cache, backend=backend):
                self.assertNotIn(ref, self.refs("vllm", info, "0.34.0"))
        # SGLang's FP8 KV cache is its own row (sglang#35938), not vLLM's
        self.assertNotIn(ref, self.refs("sglang", {"kv_cache_dtype": "fp8_e4m3"}, SGLANG_NEWEST))

    def test_sglang_flag_without_effect_on_a_quantized_model_with_a_drafter(self):
        ref = "sgl-project/sglang#36291"
        base = {"model_path": "m", "enable_deterministic_inference": True,
                "quantization": "modelopt_fp4", "speculative_algorithm": "DFLASH2"}
        for version in ("0.5.18", SGLANG_NEWEST, None):
            with self.subTest(version=version):
                self.assertIn(ref, self.refs("sglang", base, version))
        self.assertIn(ref, self.refs("sglang", dict(base, quantization=None,
                                                    modelopt_quant="fp4"), SGLANG_NEWEST))
        for change in ({"enable_deterministic_inference": False}, {"speculative_algorithm": None},
                       {"quantization": None}):
            with self.subTest(change=change):
                self.assertNotIn(ref, self.refs("sglang", dict(base, **change), SGLANG_NEWEST))
        self.assertNotIn(ref, self.refs("vllm", base, "0.34.0"))

    def test_sglang_refuses_the_flag_for_deepseek_v4(self):
        ref = "sgl-project/sglang#36174"
        for backend in ("flashmla", "flashmla_mega"):
            with self.subTest(backend=backend):
                self.assertIn(ref, self.refs("sglang", {"dsv4_attn_backend": backend},
                                             SGLANG_NEWEST))
        # any other model leaves it "auto"; a release without DeepSeek-V4 has no such field
        self.assertNotIn(ref, self.refs("sglang", {"dsv4_attn_backend": "auto"}, SGLANG_NEWEST))
        self.assertNotIn(ref, self.refs("sglang", {"attention_backend": "fa3"}, "0.5.14"))
        self.assertNotIn(ref, self.refs("vllm", {"dsv4_attn_backend": "flashmla"}, "0.34.0"))

    def test_each_is_quoted_with_its_issue_and_date(self):
        rows = {h.refs.split(" ")[0]: h for h in run.HAZARDS}
        for ref in ("vllm-project/vllm#54035", "sgl-project/sglang#36291",
                    "sgl-project/sglang#36174"):
            with self.subTest(ref=ref):
                self.assertRegex(rows[ref].refs, r"\((open; .*)?2026-08-\d\d")
                self.assertIn("open when read", rows[ref].versions)
                self.assertIsNone(rows[ref].fixed_in)
        self.assertIn("choices.py lines 113-120", rows["sgl-project/sglang#36174"].versions)


class TheCountersBlindSpots(TempDirTest):
    """vLLM's prefix-cache counters never count a request that asks for prompt_logprobs, nor
    anything under --disable-log-stats: warned before measuring where the sweep meets it."""

    def sweep(self, config, *extra):
        with StubServer(config) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                        "--repeat", 1, "--save", self.path("s.json"), *extra)
        self.assertEqual(r.code, 0, r)
        return r, [h["setting"] for h in self.load("s.json")["server"]["hazards"] or []]

    def test_the_prefill_checks_requests_on_vllm(self):
        r, settings = self.sweep(StubConfig(), "--prefill-check")
        self.assertEqual(len(settings), 1, settings)
        self.assertIn("prompt_logprobs", settings[0])
        header = r.stdout[:r.stdout.index("params:")]
        self.assertIn("HAZARD: " + settings[0], header)
        self.assertIn("kv_cache_manager.py lines 277-286", header)
        self.assertEqual(self.sweep(StubConfig())[1], [])  # no prefill check: no such request
        self.assertEqual(  # SGLang's counters are its own
            self.sweep(StubConfig(engine="sglang", prefix_caching=False), "--prefill-check")[1],
            [])

    def test_no_counters_while_vllm_caches(self):
        r, settings = self.sweep(StubConfig(no_metrics=True))
        self.assertEqual(len(settings), 1, settings)
        self.assertIn("--disable-log-stats", settings[0])
        self.assertIn("HAZARD: " + settings[0], r.stdout[:r.stdout.index("params:")])
        # the cache off: nothing the counters would have said
        self.assertEqual(self.sweep(StubConfig(no_metrics=True, prefix_caching=False))[1], [])


class TheRealServers(unittest.TestCase):
    def test_the_real_0_26_0_pair_meets_none(self):
        # Async scheduling is on in both (the default); on a real 0.26.0 server the flag held
        # with it, so no row fires for it.
        for name in ("server_info_flag_off.json", "server_info_flag_on.json"):
            with self.subTest(file=name):
                info = fixture(name)
                self.assertTrue(info["vllm_config"]["scheduler_config"]["async_scheduling"])
                facts = run.ADAPTERS["vllm"].facts(fixture("version.json")["version"], fixture("v1_models.json"),
                                                   info, None)
                self.assertEqual(facts.hazards, [])

    def test_the_real_pair_with_a_hazard_written_in(self):
        info = copy.deepcopy(fixture("server_info_flag_on.json"))
        info["vllm_config"]["compilation_config"]["pass_config"]["enable_sp"] = True
        facts = run.ADAPTERS["vllm"].facts("0.26.0", fixture("v1_models.json"), info, None)
        self.assertEqual([h["refs"] for h in facts.hazards], ["vllm-project/vllm#56370, #56377"])

    def test_every_row_names_its_evidence(self):
        for h in run.HAZARDS:
            with self.subTest(setting=h.setting):
                self.assertIn(h.engine, run.ADAPTERS)
                self.assertRegex(h.refs, r"(vllm-project/vllm|sgl-project/sglang)#\d+")
                self.assertTrue(h.why and h.versions and h.checked)
                self.assertFalse(h.fires(None))  # a setting the server does not report meets nothing


if __name__ == "__main__":
    unittest.main()
