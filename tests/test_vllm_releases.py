"""vLLM read where each release keeps a setting: 0.33.0 reported the flag's breakable CUDA
graphs in its environment, 0.34.0 in its compilation config (the real arms in
fixtures/vllm-0.34.0/, the practice engine serving as either release)."""

import os
import re
import unittest

from support import HERE, StubConfig, StubServer, fixture, get, run, run_lab, sent_batch

FOLDER_034 = "vllm-0.34.0"


def logged_config(arm):
    """(compilation mode, use_breakable_cudagraph) as the real 0.34.0 arm's engine logged the
    config it runs (its "Initializing a V1 LLM engine (v0.34.0) with config" line)."""
    path = os.path.join(HERE, "fixtures", FOLDER_034, "server_log_flag_%s.txt" % arm)
    with open(path, encoding="utf-8") as f:
        line = next(row for row in f if "Initializing a V1 LLM engine (v0.34.0)" in row)
    mode = int(re.search(r"'mode': <CompilationMode\.[A-Z_]+: (\d+)>", line).group(1))
    breakable = re.search(r"'use_breakable_cudagraph': (True|False)", line).group(1) == "True"
    return mode, breakable


def server_info_034(arm):
    """The real 0.34.0 arm's /server_info?config_format=json (system_env cut short)."""
    return fixture("server_info_flag_%s.json" % arm, FOLDER_034)


def facts(version, arm, info=None):
    models = fixture("v1_models.json", "vllm-0.33.0")
    info = server_info_034(arm) if info is None else info
    return run.ADAPTERS["vllm"].facts(version, models, info, None).checked()


class BreakableGraphsWhereTheReleaseKeepsThem(unittest.TestCase):
    def test_the_real_0_34_0_arms_as_they_logged_and_reported_themselves(self):
        self.assertEqual(logged_config("off"), (3, False))
        self.assertEqual(logged_config("on"), (0, True))
        for arm in ("off", "on"):  # what the lab at 4ae5a4c read: the environment, false
            self.assertIs(fixture("lab_read_flag_%s.json" % arm, FOLDER_034)["settings"]
                          ["breakable CUDA graph"], False)

    def test_the_flag_on_arm_of_0_34_0_runs_them_set_by_the_flag(self):
        off, on = facts("0.34.0", "off"), facts("0.34.0", "on")
        self.assertIs(off.settings["breakable CUDA graph"], False)
        self.assertIs(on.settings["breakable CUDA graph"], True)
        self.assertEqual(on.flag_sets, {"breakable CUDA graph": True, "compilation mode": 0})
        self.assertEqual(run.SettingDifference.between(off, on, ("off", "on"), flag_own=True), [])

    def test_0_33_0_is_still_read_from_its_environment(self):
        on = facts("0.33.0", "on", fixture("server_info_flag_on.json", "vllm-0.33.0"))
        self.assertNotIn("use_breakable_cudagraph",
                         fixture("server_info_flag_on.json", "vllm-0.33.0")["vllm_config"]
                         ["compilation_config"])
        self.assertIs(on.settings["breakable CUDA graph"], True)

    def test_an_unresolved_config_value_leaves_the_environment_s(self):
        # null: vLLM's own readers then fall back to the environment variable, and so does the lab
        info = server_info_034("on")
        info["vllm_config"]["compilation_config"]["use_breakable_cudagraph"] = None
        info["vllm_env"]["VLLM_USE_BREAKABLE_CUDAGRAPH"] = True
        self.assertIs(facts("0.34.0", "on", info).settings["breakable CUDA graph"], True)

    def test_the_cost_header_against_the_practice_engine_serving_as_0_34_0(self):
        with StubServer(StubConfig(version="0.34.0")) as off, \
                StubServer(StubConfig(version="0.34.0", invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 1,
                        "--trials", 1, "--warmup", 0, "--max-tokens", 2)
        self.assertEqual(r.code, 0, r)
        row = next(line for line in r.stdout.splitlines()
                   if line.startswith("breakable CUDA graph"))
        self.assertEqual(row.split()[3:], ["false", "true", "(set", "by", "the", "flag)"], row)

    def test_the_practice_engine_reports_it_where_each_release_does(self):
        for version, env_on, config_on in (("0.33.0", True, None), ("0.34.0", False, True)):
            with self.subTest(version=version):
                with StubServer(StubConfig(version=version, invariant=True)) as stub:
                    info = get(stub.url + "/server_info?config_format=json")
                self.assertIs(info["vllm_env"]["VLLM_USE_BREAKABLE_CUDAGRAPH"], env_on)
                self.assertIs(info["vllm_config"]["compilation_config"]
                              .get("use_breakable_cudagraph"), config_on)


class CopiesOnTheReal034(unittest.TestCase):
    """Four copies of a 256-token prompt in one request, a fresh cache_salt, on the real
    vLLM 0.34.0 flag-off arm (fixtures/vllm-0.34.0/: the counters read before and after)."""

    def counters(self, name):
        with open(os.path.join(HERE, "fixtures", FOLDER_034, name), encoding="utf-8") as f:
            text = f.read()
        adapter = run.ADAPTERS["vllm"]
        return run.CacheCounters(int(run.metric_sums(text, adapter.COUNTER_QUERIES)),
                                 int(run.metric_sums(text, adapter.COUNTER_HITS)), "metrics")

    def test_copies_share_the_cache_and_the_answer_counts_one_copy(self):
        answer = fixture("copies_one_request.json", FOLDER_034)
        count = run.ADAPTERS["vllm"].cached_tokens(answer)
        self.assertEqual(count, 256)  # one copy's worth of 64-token blocks
        found = run.cache_evidence(self.counters("metrics_before.txt"),
                                   self.counters("metrics_after.txt"), [count],
                                   answer["usage"]["prompt_tokens"])
        self.assertEqual(found.verdict, run.CACHE_COUNTED_AND_SERVED)
        self.assertEqual(found.served, 768)  # the other three copies, 256 tokens each
        self.assertEqual(found.counted, 256)

    def test_the_sweep_reads_every_copy_as_served(self):
        # the answer's one count covers one copy; the counters saw the other three served:
        # the batch compares nothing, whichever copy its count belongs to
        answer = fixture("copies_one_request.json", FOLDER_034)
        adapter = run.ADAPTERS["vllm"]
        prompts = ["the same prompt"] * 4
        count = adapter.cached_tokens(answer)
        seen = run.cache_evidence(self.counters("metrics_before.txt"),
                                  self.counters("metrics_after.txt"), [count],
                                  adapter.prompt_tokens(answer))
        self.assertTrue(seen.uncounted)
        self.assertEqual(seen.note(), "the server's counters: 768 prompt tokens served from "
                         "the cache, the answers counted 256")
        # three of the four copies served one whole 64-token block short of each prompt's
        # last token (3 x 256), the answer counting one copy's 256: one copy was computed
        # cold, which one is not known
        batch = sent_batch(adapter.completions(answer, 4, False), count,
                           adapter.cached_per_prompt(answer, prompts),
                           prompt_tokens=adapter.prompt_tokens(answer), seen=seen, copies=4,
                           block=64)
        self.assertEqual([s.state for s in batch.states], [run.CACHE_NOT_KNOWN] * 4)
        self.assertEqual(batch.cold_copies, 1)
        # the same batch had its count said 0: the counters still mark every copy served
        said_none = sent_batch(batch.completions, 0, [0] * 4, seen=seen, copies=4, block=64)
        self.assertEqual([s.state for s in said_none.states], [run.CACHE_SERVED] * 4)

    def test_0_34_0_caches_in_blocks_of_64_tokens(self):
        # vllm/config/cache.py line 185 (0.34.0): DEFAULT_BLOCK_SIZE = 64; a prompt shorter
        # than one block is never served from the prefix cache, shared or not
        for arm in ("off", "on"):
            self.assertEqual(server_info_034(arm)["vllm_config"]["cache_config"]["block_size"],
                             64)


if __name__ == "__main__":
    unittest.main()
