"""A sweep knows what it measured, and a baseline travels: every saved sweep records the
model as served, its tokenizer's fingerprint, every sampling parameter sent, the engine and
release, and the machine as the server reports it; --baseline FILE compares across machines,
releases and engines, naming both sides in its verdict, and refuses a file of another
tokenizer (or model, prompt, sampling) with one line and exit 2. Two "machines" here are two
practice engines that report other GPUs, one of them reducing in another order
(rotation_offset: another kernel build)."""

import json

from support import StubConfig, StubServer, TempDirTest, one_error_line, run, run_lab

H100 = {("system_env", "nvidia_gpu_models"): "GPU 0: NVIDIA H100 80GB HBM3"}
H200 = {("system_env", "nvidia_gpu_models"): "GPU 0: NVIDIA H200"}


class BaselineAcrossMachines(TempDirTest):
    def saved_on_h100(self, *extra):
        with StubServer(StubConfig(invariant=True, info_overrides=H100)) as h100:
            r = run_lab("--mode", "sweep", "--url", h100.url, "--sizes", "1,4", "--max-tokens", 16,
                        "--repeat", 2, "--save", self.path("h100.json"), *extra)
        self.assertEqual(r.code, 0, r)
        return self.load("h100.json")

    def against(self, config, *extra):
        with StubServer(config) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,4", "--max-tokens", 16,
                        "--repeat", 2, "--baseline", self.path("h100.json"),
                        "--save", self.path("other.json"), *extra)
        return r, stub

    def test_every_sweep_records_what_it_measured(self):
        doc = self.saved_on_h100()
        under = doc["measured_under"]
        self.assertEqual(under["model"]["name"], "stub/tiny-f32")
        self.assertEqual(under["model"]["reported"]["served model"], "stub/tiny-f32")
        probe = under["tokenizer"]["probe"]
        # the practice engine tokenizes a byte at a time, from 1000 (tests/stub_server.py)
        self.assertEqual(under["tokenizer"]["tokens"], [1000 + b for b in probe.encode("utf-8")])
        self.assertEqual(len(under["tokenizer"]["sha256"]), 16)
        self.assertEqual(under["sampling"], {"temperature": 0.0, "top_p": 1.0, "max_tokens": 16,
                                             "logprobs": 5, "seed": None, "top_k": -1,
                                             "min_p": 0.0, "repetition_penalty": 1.0})
        self.assertEqual(under["engine"], {"engine": "vllm", "release": "0.26.0"})
        machine = under["machine"]
        self.assertEqual(machine["GPUs"], "1 x NVIDIA H100 80GB HBM3")
        self.assertEqual(machine["GPU driver"], "580.159.04")  # the real 0.26.0 answer's
        self.assertEqual(machine["torch"], "2.11.0+cu130")
        self.assertEqual(machine["CUDA (torch's build)"], "13.0")

    def test_a_baseline_that_holds_across_machines_and_releases(self):
        self.saved_on_h100()
        r, _ = self.against(StubConfig(invariant=True, info_overrides=H200, version="0.34.0"),
                            "--expect", "invariant")
        self.assertEqual(r.code, 0, r)
        verdict = self.load("other.json")["baseline"]["verdict"]
        self.assertTrue(verdict.startswith(
            "flag on: the same tokens and logprobs as the baseline measured on 1 x NVIDIA H100 "
            "80GB HBM3, vLLM 0.26.0 (this sweep: 1 x NVIDIA H200, vLLM 0.34.0; 0 of 10 computed "
            "completions moved, 95% CI 0-31%, wide)"), verdict)
        self.assertIn(verdict, r.stdout)
        self.assertEqual(self.load("other.json")["baseline"]["measured_under"]["machine"]["GPUs"],
                         "1 x NVIDIA H100 80GB HBM3")

    def test_a_baseline_that_moves_across_machines(self):
        self.saved_on_h100()
        r, _ = self.against(StubConfig(invariant=True, info_overrides=H200, rotation_offset=3),
                            "--expect", "invariant")
        self.assertEqual(r.code, 1, r)  # batch 1 itself moved against the other machine's
        verdict = self.load("other.json")["baseline"]["verdict"]
        self.assertTrue(verdict.startswith(
            "flag on: differs from the baseline measured on 1 x NVIDIA H100 80GB HBM3, vLLM "
            "0.26.0 (this sweep: 1 x NVIDIA H200, vLLM 0.26.0; 10 of 10 computed completions "
            "moved"), verdict)
        self.assertTrue(verdict.endswith("first: logprobs at batch 1, step 1"), verdict)
        self.assertIn(verdict, r.stdout)

    def test_a_baseline_of_another_tokenizer_is_refused(self):
        self.saved_on_h100()
        r, stub = self.against(StubConfig(invariant=True, info_overrides=H200,
                                          tokenizer_probe_differs=run.TOKENIZER_PROBE))
        one_error_line(self, r, 2, "was measured with another tokenizer: the probe text's "
                                   "token ids differ from position 0 on (1066 there, 1067 here)")
        generated = [p for m, p, _ in stub.requests if m == "POST" and p != "/tokenize"]
        self.assertEqual(generated, [])  # refused before any completion was asked for

    def test_a_file_saved_without_a_fingerprint_is_not_refused_for_it(self):
        doc = self.saved_on_h100()
        del doc["measured_under"]
        with open(self.path("h100.json"), "w", encoding="utf-8") as f:
            json.dump(doc, f)
        r, _ = self.against(StubConfig(invariant=True, tokenizer_probe_differs=run.TOKENIZER_PROBE))
        self.assertEqual(r.code, 0, r)
        self.assertIn("as the baseline measured on an unreported machine, vLLM 0.26.0", r.stdout)
        # accepted, and said: the two tokenizers were not held together
        self.assertIn("the tokenizers not compared: the file records no fingerprint", r.stdout)

    def test_a_file_that_contradicts_itself_is_refused(self):
        doc = self.saved_on_h100()
        doc["measured_under"]["sampling"]["top_p"] = 0.9
        with open(self.path("h100.json"), "w", encoding="utf-8") as f:
            json.dump(doc, f)
        r, _ = self.against(StubConfig(invariant=True))
        one_error_line(self, r, 2, "contradicts itself: its params and its measured_under "
                       "record other top_p")

    def test_a_server_without_tokenize_has_no_fingerprint_and_is_not_refused_for_it(self):
        self.saved_on_h100()
        r, _ = self.against(StubConfig(invariant=True, no_tokenize=True))
        self.assertEqual(r.code, 0, r)
        tokenizer = self.load("other.json")["measured_under"]["tokenizer"]
        self.assertIsNone(tokenizer["tokens"])
        self.assertIn("404", tokenizer["why"])
        self.assertIn("flag on: the same tokens and logprobs as the baseline", r.stdout)
        self.assertIn("the tokenizers not compared: this server gave none", r.stdout)

    def test_another_model_or_sampling_is_still_refused(self):
        self.saved_on_h100()
        r, _ = self.against(StubConfig(invariant=True, model="other/served"))
        one_error_line(self, r, 2, "this server serves other/served")
        r, _ = self.against(StubConfig(invariant=True), "--logprobs", "3")
        one_error_line(self, r, 2, "logprobs=5, this sweep uses 3")


class BaselineAcrossEngines(TempDirTest):
    def test_a_vllm_file_against_an_sglang_arm_of_the_same_model(self):
        with StubServer(StubConfig(invariant=True, info_overrides=H100)) as vllm:
            r = run_lab("--mode", "sweep", "--url", vllm.url, "--sizes", "1,4", "--max-tokens", 16,
                        "--repeat", 2, "--save", self.path("vllm.json"))
        self.assertEqual(r.code, 0, r)
        with StubServer(StubConfig(engine="sglang", invariant=True, prefix_caching=False)) as sgl:
            r = run_lab("--mode", "sweep", "--url", sgl.url, "--sizes", "1,4", "--max-tokens", 16,
                        "--repeat", 2, "--baseline", self.path("vllm.json"), "--metadata",
                        "gpu=H100", "--save", self.path("sglang.json"), "--expect", "invariant")
        self.assertEqual(r.code, 0, r)
        doc = self.load("sglang.json")
        self.assertEqual(doc["measured_under"]["engine"]["engine"], "sglang")
        self.assertIsNone(doc["measured_under"]["machine"])  # SGLang reports none
        self.assertEqual(doc["measured_under"]["tokenizer"]["tokens"],
                         self.load("vllm.json")["measured_under"]["tokenizer"]["tokens"])
        self.assertTrue(doc["baseline"]["verdict"].startswith(
            "flag on: the same tokens and logprobs as the baseline measured on 1 x NVIDIA H100 "
            "80GB HBM3, vLLM 0.26.0 (this sweep: H100 (as --metadata gpu says), SGLang "
            "0.5.23+stub; 0 of 10 computed completions moved"), doc["baseline"]["verdict"])


class Machine(TempDirTest):
    def test_the_machine_as_vllm_reports_it(self):
        # one reading of system_env, VllmAdapter.machine: what a cost cell's identity and a
        # sweep's measured_under both hold
        env = {"nvidia_gpu_models": "GPU 0: NVIDIA H100 80GB HBM3\nGPU 1: NVIDIA H100 80GB HBM3",
               "nvidia_driver_version": "580.1", "cuda_runtime_version": "12.9",
               "cuda_compiled_version": "13.0", "torch_version": "2.14.0+cu130"}
        adapter = run.ADAPTERS["vllm"]
        self.assertEqual(adapter.machine({"system_env": env}),
                         {"GPUs": "2 x NVIDIA H100 80GB HBM3", "GPU driver": "580.1",
                          "CUDA (torch's build)": "13.0", "CUDA toolkit (nvcc)": "12.9",
                          "torch": "2.14.0+cu130"})
        self.assertEqual(adapter.machine({"system_env": {"os": "Ubuntu"}}), {})
        self.assertEqual(adapter.machine({}), {})


if __name__ == "__main__":
    import unittest
    unittest.main()
