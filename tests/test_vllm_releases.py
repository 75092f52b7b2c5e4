"""vLLM read where each release keeps a setting: 0.33.0 reported the flag's breakable CUDA
graphs in its environment, 0.34.0 in its compilation config (the real arms in
fixtures/vllm-0.34.0/, the practice engine serving as either release)."""

import copy
import os
import re
import unittest

from support import HERE, StubConfig, StubServer, fixture, get, run, run_lab

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
    """The arm's /server_info: the real answer where it was captured (server_info_flag_ARM.json),
    otherwise the real 0.33.0 answer with the settings the real 0.34.0 arm logged and its lab
    read (lab_read_flag_ARM.json: the environment variable false on both arms) written in."""
    captured = os.path.join(HERE, "fixtures", FOLDER_034, "server_info_flag_%s.json" % arm)
    if os.path.exists(captured):
        return fixture(os.path.basename(captured), FOLDER_034)
    info = copy.deepcopy(fixture("server_info_flag_%s.json" % arm, "vllm-0.33.0"))
    mode, breakable = logged_config(arm)
    info["vllm_config"]["compilation_config"]["mode"] = mode
    info["vllm_config"]["compilation_config"]["use_breakable_cudagraph"] = breakable
    read = fixture("lab_read_flag_%s.json" % arm, FOLDER_034)["settings"]
    info["vllm_env"]["VLLM_USE_BREAKABLE_CUDAGRAPH"] = read["breakable CUDA graph"]
    return info


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


if __name__ == "__main__":
    unittest.main()
