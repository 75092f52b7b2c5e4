"""--mode cost: the arms checked against each other, the request bodies, the overhead
against slowed practice engines, token counts, and the trials kept when a server fails."""

import copy
import json
import unittest
from unittest import mock

from stub_server import VirtualClock, sglang_server_info
from support import StubConfig, StubServer, TempDirTest, fixture, free_port, run, run_lab


def arm_differences(off, on):
    """What cost mode finds between two arms' settings."""
    return run.SettingDifference.between(off, on, ("off", "on"), flag_own=True)


DELAY = 0.005   # seconds per decode step in the timed stubs
TOKENS = 16     # tokens per completion in the timed runs
JITTER = 0.1    # +-10% seeded timing noise, so the interval has a width to contain the truth


def vllm_facts(info):
    models = fixture("v1_models.json")
    return run.ADAPTERS["vllm"].facts(fixture("version.json")["version"], models, info, None)


class HazardCheckOnRealServers(unittest.TestCase):
    """The real vLLM 0.26.0 flag-off / flag-on pair: only the flag and its consequences differ."""

    def setUp(self):
        self.off_info = fixture("server_info_flag_off.json")
        self.on_info = fixture("server_info_flag_on.json")

    def test_the_real_pair_passes(self):
        off, on = vllm_facts(self.off_info), vllm_facts(self.on_info)
        self.assertEqual((off.flag, on.flag), (False, True))
        self.assertEqual(arm_differences(off, on), [])
        self.assertEqual(off.attention_backend, "FlashAttentionBackend")
        self.assertEqual((off.graph_sizes[-1], off.graph_source), (128, "reported"))
        self.assertEqual(off.load_format, "dummy")

    def test_editing_any_listed_setting_fails_it(self):
        edits = {
            "max num seqs": ("scheduler_config", "max_num_seqs", 32),
            "attention backend": ("attention_config", "backend", "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend"),
            "TP size": ("parallel_config", "tensor_parallel_size", 2),
            "prefix caching": ("cache_config", "enable_prefix_caching", False),
            "dtype": ("model_config", "dtype", "torch.float16"),
            "CUDA-graph sizes": ("compilation_config", "cudagraph_capture_sizes", [1, 2, 4]),
            "chunked prefill": ("scheduler_config", "enable_chunked_prefill", False),
            "KV-cache dtype": ("cache_config", "cache_dtype", "fp8"),
            "max model length": ("model_config", "max_model_len", 4096),
            "enforce eager": ("model_config", "enforce_eager", True),
            "quantization": ("model_config", "quantization", "fp8"),
            "max num batched tokens": ("scheduler_config", "max_num_batched_tokens", 4096),
            "CUDA-graph mode": ("compilation_config", "cudagraph_mode", [1, 1]),
        }
        for label, (section, key, value) in edits.items():
            with self.subTest(setting=label):
                on_info = copy.deepcopy(self.on_info)
                on_info["vllm_config"][section][key] = value
                hazards = arm_differences(vllm_facts(self.off_info), vllm_facts(on_info))
                self.assertEqual([h.setting for h in hazards], [label])

    def test_the_real_0_33_pair_passes_its_compile_settings_the_flags_own(self):
        folder = "vllm-0.33.0"
        off_info = fixture("server_info_flag_off.json", folder)
        on_info = fixture("server_info_flag_on.json", folder)
        version = fixture("version.json", folder)["version"]
        models = fixture("v1_models.json", folder)
        off, on = (run.ADAPTERS["vllm"].facts(version, models, info, None).checked()
                   for info in (off_info, on_info))
        self.assertEqual(arm_differences(off, on), [])
        self.assertEqual((off.settings["compilation mode"], on.settings["compilation mode"]), (3, 0))
        # the same two settings on a flag-off arm are a mismatch: only the flag may set them
        on_info["vllm_env"]["VLLM_BATCH_INVARIANT"] = False
        other = run.ADAPTERS["vllm"].facts(version, models, on_info, None).checked()
        self.assertEqual({d.setting for d in arm_differences(off, other)},
                         {"compilation mode", "breakable CUDA graph"})

    def test_prefix_cache_switched_off_by_the_flag_is_not_a_hazard(self):
        off_info, on_info = copy.deepcopy(self.off_info), copy.deepcopy(self.on_info)
        for info in (off_info, on_info):
            info["vllm_config"]["attention_config"]["backend"] = "vllm.v1.attention.backends.flashinfer.FlashInferBackend"
        on_info["vllm_config"]["cache_config"]["enable_prefix_caching"] = False
        self.assertEqual(arm_differences(vllm_facts(off_info), vllm_facts(on_info)), [])

    def test_sglang_flag_consequences_are_not_hazards(self):
        from stub_server import sglang_server_info
        a = run.ADAPTERS["sglang"]
        off = a.facts(sglang_server_info(StubConfig(engine="sglang"), 30000), None)
        on = a.facts(sglang_server_info(StubConfig(engine="sglang", invariant=True), 30001), None)
        self.assertEqual(arm_differences(off, on), [])  # sampling backend: set by the flag
        on_info = sglang_server_info(StubConfig(engine="sglang", invariant=True, attention_backend="fa3"), 30001)
        self.assertEqual([h.setting for h in arm_differences(off, a.facts(on_info, None))],
                         ["attention backend"])


class CostAgainstStubs(TempDirTest):
    def cost(self, off, on, *extra):
        return run_lab("--mode", "cost", "--engine", off.config.engine, "--url", off.url,
                       "--invariant", on.url, "--batch", 4, "--trials", 8, "--warmup", 1,
                       "--max-tokens", TOKENS, *extra)

    def timed(self, slowdown, *extra):
        """A cost run on emulated time: both stubs advance one virtual clock, which the lab
        reads as its own, so the figures are exact and no loaded machine can move them."""
        clock = VirtualClock()
        with mock.patch.object(run, "CLOCK", clock), \
                StubServer(StubConfig(step_delay=DELAY, jitter=JITTER, seed=1, clock=clock)) as off, \
                StubServer(StubConfig(invariant=True, step_delay=DELAY, slowdown=slowdown, jitter=JITTER,
                                      seed=2, clock=clock)) as on:
            return self.cost(off, on, *extra)

    def test_known_slowdown_lies_inside_the_interval(self):
        r = self.timed(1.3, "--json")
        self.assertEqual(r.code, 0, r)
        cell = r.json()
        lo, hi = cell["ci95_pct"]
        self.assertTrue(lo <= 30.0 <= hi, (lo, hi))
        self.assertTrue(cell["significant"])
        self.assertEqual(cell["trials"], 8)
        self.assertEqual(len(cell["off"]["samples_s"]), 8)
        self.assertEqual(cell["off"]["output_tokens"], [4 * TOKENS] * 8)
        self.assertEqual(len(cell["on"]["tokens_per_s"]), 8)
        self.assertAlmostEqual(cell["on"]["tokens_per_s"][0], 4 * TOKENS / cell["on"]["samples_s"][0], places=2)

    def test_a_flag_on_arm_measured_faster_is_said_with_what_to_check(self):
        r = self.timed(0.7)
        self.assertEqual(r.code, 0, r)
        lines = r.stdout.splitlines()
        at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("overhead -"))
        said = [line.strip() for line in lines[at + 1:at + 5]]
        self.assertTrue(said[0].startswith("the flag-on arm measured faster (the whole interval "
                                           "lies below 0)"), said)
        self.assertRegex(said[1], r"^check the flags as the lab read them: --url http://\S+: "
                         r"flag off \(VLLM_BATCH_INVARIANT=false\); --invariant http://\S+: "
                         r"flag on \(VLLM_BATCH_INVARIANT=true\)$")
        self.assertTrue(said[2].startswith("check the warm-up: 1 request(s) an arm"), said)
        self.assertTrue(said[3].startswith("check which URL is which"), said)

    def test_a_slower_flag_on_arm_is_not_said_to_be_faster(self):
        r = self.timed(1.3)
        self.assertNotIn("measured faster", r.stdout)

    def test_identical_servers_are_not_significant(self):
        r = self.timed(1.0)
        self.assertEqual(r.code, 0, r)
        self.assertIn("not significant", r.stdout)

    def test_both_arms_get_byte_identical_bodies_interleaved(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            r = self.cost(off, on, "--json")
            self.assertEqual(r.code, 0, r)
            a, b = off.generation_bodies(), on.generation_bodies()
        self.assertEqual(len(a), 9)
        self.assertEqual(a, b)
        body = json.loads(a[1])
        self.assertTrue(body["ignore_eos"])
        self.assertEqual((body["temperature"], body["max_tokens"]), (0.0, TOKENS))
        openings = {p.split("]")[0] for raw in a for p in json.loads(raw)["prompt"]}
        self.assertEqual(len(openings), 9 * 4)  # cold: no prompt shares an opening

    def test_sglang_arms_and_shared_prefix_workload(self):
        with StubServer(StubConfig(engine="sglang")) as off, \
                StubServer(StubConfig(engine="sglang", invariant=True)) as on:
            r = self.cost(off, on, "--workload", "shared-prefix", "--prefix-tokens", 50, "--json")
            self.assertEqual(r.code, 0, r)
            bodies = off.generation_bodies()
            self.assertEqual(bodies, on.generation_bodies())
        prefixes = {t.split("\nQuestion")[0] for raw in bodies for t in json.loads(raw)["text"]}
        self.assertEqual(len(prefixes), 1)
        self.assertEqual(r.json()["workload"], "shared-prefix")
        self.assertTrue(json.loads(bodies[0])["sampling_params"]["ignore_eos"])

    def test_mismatched_backends_are_refused_naming_the_setting(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True, attention_backend="TritonAttentionBackend")) as on:
            r = self.cost(off, on)
            self.assertEqual(r.code, 2)
            self.assertIn("attention backend", r.stderr)
            self.assertEqual(len(r.stderr.strip().splitlines()), 1)
            self.assertEqual(off.generation_bodies(), [])
            r = self.cost(off, on, "--allow-mismatch", "--json")
        self.assertEqual(r.code, 0, r)
        self.assertEqual([d["setting"] for d in r.json()["differences"]], ["attention backend"])

    def test_arms_the_wrong_way_round_are_refused(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", on.url, "--invariant", off.url)
            self.assertEqual(r.code, 2)
            self.assertIn("wrong way round", r.stderr)
            self.assertEqual(off.generation_bodies() + on.generation_bodies(), [])

    def test_servers_that_hide_their_settings_are_timed_with_a_warning(self):
        with StubServer(StubConfig(dev_mode=False)) as off, StubServer(StubConfig(invariant=True, dev_mode=False)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 1,
                        "--trials", 1, "--warmup", 0, "--max-tokens", 2, "--tp", 4, "--json")
        self.assertEqual(r.code, 0, r)
        self.assertIn("VLLM_SERVER_DEV_MODE=1", r.stderr)
        self.assertEqual(r.json()["tp"], 4)  # the label falls back to --tp

    def test_what_the_flag_sets_on_vllm_0_33_is_the_flags_never_a_mismatch(self):
        # 0.33.0's flag turns on breakable CUDA graphs, which run without torch.compile
        with StubServer(StubConfig(version="0.33.0")) as off, \
                StubServer(StubConfig(version="0.33.0", invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 1,
                        "--trials", 1, "--warmup", 0, "--max-tokens", 2)
        self.assertEqual(r.code, 0, r)
        lines = r.stdout.splitlines()
        for label in ("compilation mode", "breakable CUDA graph"):
            row = next(line for line in lines if line.startswith(label))
            self.assertIn("(set by the flag)", row)
        self.assertIn("cell: TP=1", r.stdout)

    def test_a_server_info_that_fails_leaves_its_settings_unknown_never_different(self):
        with StubServer(StubConfig(version="0.33.0")) as off, \
                StubServer(StubConfig(version="0.33.0", invariant=True, server_info_500=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 1,
                        "--trials", 1, "--warmup", 0, "--max-tokens", 2, "--json")
        self.assertEqual(r.code, 0, r)
        self.assertEqual(r.json()["differences"], [])
        self.assertIn("'NoneType' object has no attribute 'splitlines'", r.stderr)
        self.assertNotIn("VLLM_SERVER_DEV_MODE", r.stderr)  # it is set: the endpoint answered

    def test_short_completions_are_warned_about(self):
        with StubServer(StubConfig(honour_ignore_eos=False)) as off, \
                StubServer(StubConfig(invariant=True, honour_ignore_eos=False)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 2,
                        "--trials", 2, "--warmup", 0, "--max-tokens", 8)
        self.assertEqual(r.code, 0, r)
        self.assertIn("ignore_eos", r.stderr)

    def test_save_replaces_same_cell_adds_others_and_prints_the_table(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            save = ("--save", self.path("cost.json"), "--trials", 2, "--warmup", 0)
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 2,
                        "--max-tokens", 4, *save)
            self.assertEqual(r.code, 0, r)
            self.assertIn("One cell alone is not a result", r.stdout)
            self.assertIn("missing", r.stdout)
            run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 2,
                    "--max-tokens", 4, *save)
            self.assertEqual(len(self.load("cost.json")["cells"]), 1)
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 2,
                        "--max-tokens", 4, "--workload", "shared-prefix", "--prefix-tokens", 20, *save)
        doc = self.load("cost.json")
        self.assertEqual(doc["schema"], "batch-invariance-lab/cost/1")
        self.assertEqual(sorted(c["workload"] for c in doc["cells"]), ["cold", "shared-prefix"])
        cell = doc["cells"][0]
        for key in ("tp", "workload", "batch", "max_tokens", "trials", "model", "off", "on",
                    "overhead_pct", "ci95_pct", "significant", "servers", "differences"):
            self.assertIn(key, cell)
        self.assertIn("samples_s", cell["on"])
        self.assertIn("median_s", cell["off"])
        self.assertEqual(cell["servers"]["on"]["flag"], True)
        table = r.stdout[r.stdout.index("cost cells"):]
        tp1 = next(line for line in table.splitlines() if line.strip().startswith("TP=1"))
        self.assertNotIn("missing", tp1)
        self.assertIn("TP=k", table)

    def test_the_table_shows_the_cells_of_this_cells_arrivals_only(self):
        # A burst cell and a Poisson cell of one shape are two measurements (two cell keys):
        # the table printed after the burst run must show the burst cell's overhead.
        cell = fixture("cost-load.json", "saved")["cells"][0]
        poisson = dict(cell, arrivals="poisson at 100/s", overhead_pct=55.5)
        burst = dict(cell, arrivals="burst", overhead_pct=-4.4)
        cells = [run.CellLabels.from_record(c) for c in (poisson, burst)]
        table = "\n".join(run.cost_table_lines(cells, cells[1]))
        self.assertIn("-4.4%", table)
        self.assertNotIn("+55.5%", table)
        table = "\n".join(run.cost_table_lines(cells, cells[0]))
        self.assertIn("+55.5%", table)
        self.assertIn("poisson at 100/s", table)


class TokenCounts(TempDirTest):
    def cost(self, off, on, *extra):
        return run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 2,
                       "--trials", 2, "--warmup", 0, "--max-tokens", 8, "--json", *extra)

    def test_more_tokens_than_asked_is_a_server_error(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True, faults={2: "overshoot"})) as on:
            r = self.cost(off, on)
        self.assertEqual(r.code, 3, r)
        self.assertIn("reported 21 output tokens, more than 2 prompts x --max-tokens 8 allow", r.stderr)

    def test_arms_with_different_token_counts_are_compared_per_token(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True, honour_ignore_eos=False)) as on:
            r = self.cost(off, on)
        self.assertEqual(r.code, 0, r)
        cell = r.json()
        self.assertEqual(cell["compared_on"], "time per output token (the arms produced different token counts)")
        per_token = [(b / tb) / (a / ta) for a, b, ta, tb in zip(cell["off"]["samples_s"], cell["on"]["samples_s"],
                                                                  cell["off"]["output_tokens"],
                                                                  cell["on"]["output_tokens"])]
        self.assertEqual(cell["ratios"], [round(x, 6) for x in per_token])
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            self.assertEqual(self.cost(off, on).json()["compared_on"], "time per trial")


class ServerFaultsInCost(TempDirTest):
    def test_trial_failure_keeps_the_trials_before_it(self):
        # generation requests per arm: 1 warm-up, then trials; the 4th on the flag-on arm is trial 3
        with StubServer() as off, StubServer(StubConfig(invariant=True, faults={4: "http500"})) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 2,
                        "--trials", 6, "--warmup", 1, "--max-tokens", 4, "--save", self.path("c.json"))
        self.assertEqual(r.code, 3, r)
        self.assertIn("cost stopped at trial 3, on arm: HTTP 500", r.stderr)
        cell = self.load("c.json")["cells"][0]
        self.assertEqual(cell["trials"], 2)
        self.assertEqual(cell["state"], "stopped: server error")
        self.assertEqual(len(cell["off"]["samples_s"]), 3)  # trial 3's flag-off sample is kept too
        self.assertEqual(len(cell["on"]["samples_s"]), 2)

    def test_a_failed_run_does_not_replace_a_finished_cell(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            args = ("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 2,
                    "--trials", 3, "--warmup", 0, "--max-tokens", 4, "--save", self.path("c.json"))
            self.assertEqual(run_lab(*args).code, 0)
        with StubServer() as off, StubServer(StubConfig(invariant=True, faults={2: "drop"})) as on:
            args = ("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 2,
                    "--trials", 3, "--warmup", 0, "--max-tokens", 4, "--save", self.path("c.json"))
            self.assertEqual(run_lab(*args).code, 3)
        doc = self.load("c.json")
        self.assertEqual([c["state"] for c in doc["cells"]], ["complete"])
        self.assertEqual([c["trials"] for c in doc["incomplete_cells"]], [1])

    def test_warm_up_is_retried_once_and_says_so(self):
        with StubServer(StubConfig(faults={1: "http500"})) as off, StubServer(StubConfig(invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 2,
                        "--trials", 2, "--warmup", 1, "--max-tokens", 4)
        self.assertEqual(r.code, 0, r)
        self.assertIn("retrying once, as only warm-up may", r.stderr)

    def test_unreachable_arm(self):
        with StubServer() as off:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant",
                        "http://127.0.0.1:%d" % free_port())
        self.assertEqual(r.code, 3)
        self.assertIn("flag-on arm (--invariant)", r.stderr)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1)

class CostArms(TempDirTest):
    def test_two_paths_behind_one_gateway_are_two_servers(self):
        self.assertNotEqual(run.server_address("http://gw:8000/arm-a"), run.server_address("http://gw:8000/arm-b/"))
        self.assertEqual(run.server_address("http://localhost:8000/a"), run.server_address("http://127.0.0.1:8000/a/"))

    def test_with_allow_mismatch_each_arm_is_asked_for_its_own_model(self):
        with StubServer(StubConfig(model="m/off")) as off, StubServer(StubConfig(invariant=True, model="m/on")) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 1, "--trials", 1,
                        "--warmup", 0, "--max-tokens", 2, "--allow-mismatch", "--json")
            off_models = {json.loads(b)["model"] for b in off.generation_bodies()}
            on_models = {json.loads(b)["model"] for b in on.generation_bodies()}
        self.assertEqual(r.code, 0, r)
        self.assertEqual((off_models, on_models), ({"m/off"}, {"m/on"}))


class PrecisionJudgesTheFigureItReports(unittest.TestCase):
    def test_with_different_token_counts_the_interval_judged_is_per_token(self):
        facts = run.ServerFacts("vllm", "m")
        off = run.Arm("off", "--url", "u", None, facts, [1.0] * 8, [100, 50] * 4)
        on = run.Arm("on", "--invariant", "u", None, facts, [1.0] * 8, [100] * 8)
        primary, compared_on = run.primary_overhead(off, on)
        self.assertIn("per output token", compared_on)
        # per trial the pairs are all alike (an interval of 0); per token they are not
        self.assertFalse(run.precise_enough(off, on, 1.0))
        self.assertEqual(run.Overhead.of(off.samples, on.samples).ci95_pct, [0.0, 0.0])


if __name__ == "__main__":
    unittest.main()
