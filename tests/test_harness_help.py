"""--mode harness (offline), --mode help, --help and the argument-free default."""

import os
import socket
import subprocess
import sys
import unittest
from unittest import mock

from support import ROOT, run, run_lab

# Lines that must survive in the harness output: one per excerpt, its provenance, the commands.
EXCERPT_LINES = {
    "vllm": [
        "def enable_batch_invariant_mode(monkeypatch: pytest.MonkeyPatch):",
        'monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")',
        "def test_logprobs_without_batch_invariance_should_fail(",
        "The test will FAIL if everything matches (suggesting batch invariance isn't needed).",
        "# CRITICAL: Disable batch invariance for this test",
        'DEFAULT_MODEL = "Qwen/Qwen3-1.7B"',
        'TEST_MODEL = os.getenv("VLLM_TEST_MODEL", DEFAULT_MODEL)',
        '"temperature": 0.6,',
        '"--max-num-seqs=32",',
        "with RemoteOpenAIServer(TEST_MODEL, server_args) as server:",
        'f"Prompt {i} Step {t}: Bitwise mismatch "',
        "baseline_text = baseline_out[0].outputs[0].text",
        "assert needle_output.prompt == needle_prompt",
    ],
    "sglang": [
        'if args.test_mode == "single":',
        'print(f"Total samples: {len(texts)}, Unique samples: {len(set(texts))}")',
        'DEFAULT_MODEL = "Qwen/Qwen3-8B"',
        '"--cuda-graph-max-bs-decode",',
        "Attention backend not specified. Falling back to '{backend}' for deterministic inference.",
        "return {\"attention_backend\": backend}",
    ],
}
PROVENANCE = {
    "vllm": [
        "tests/v1/determinism/conftest.py, lines 8-12, vLLM 0.34.0",
        "tests/v1/determinism/test_batch_invariance.py, lines 507-520",
        "tests/v1/determinism/utils.py, lines 43-44",
        "tests/v1/determinism/test_online_batch_invariance.py, lines 144-162",
        "tests/v1/determinism/test_online_batch_invariance.py, lines 126-133",
        "benchmarks/benchmark_batch_invariance.py, lines 147-150 and 189-190",
    ],
    "sglang": [
        "python/sglang/test/test_deterministic.py, lines 460-471, SGLang 0.5.23",
        "python/sglang/test/test_deterministic_utils.py, lines 12-18",
        "python/sglang/srt/arg_groups/overrides.py, lines 1112-1123",
    ],
}
COMMANDS = {
    "vllm": [
        'pytest -v -s tests/v1/determinism/test_batch_invariance.py -k "bs1_vs_bsN and 16-16-FLASH_ATTN"',
        'pytest -v -s tests/v1/determinism/test_batch_invariance.py -k "without_batch_invariance and TRITON_ATTN"',
        "VLLM_TEST_MODEL=Qwen/Qwen3-1.7B VLLM_TP_SIZE=1 pytest -v -s "
        'tests/v1/determinism/test_online_batch_invariance.py -k "FLASH_ATTN and not MLA"',
        "VLLM_BENCH_MODEL=Qwen/Qwen3-1.7B VLLM_BENCH_BACKEND=FLASH_ATTN python benchmarks/benchmark_batch_invariance.py",
        "VLLM_TEST_TP_SIZE",
        "python3 run.py --mode sweep --engine vllm --url http://localhost:8000",
        "python3 run.py --mode cost --url http://localhost:8000",
    ],
    "sglang": [
        "python3 -m sglang.launch_server --model-path Qwen/Qwen3-8B",
        "--attention-backend triton --cuda-graph-max-bs-decode 32 \\\n      --enable-deterministic-inference",
        "python3 -m sglang.test.test_deterministic --n-trials 50 --test-mode single",
        "--model-path Qwen/Qwen3-8B --port 30000 \\\n      --attention-backend triton --cuda-graph-max-bs-decode 32\n",
        "--model-path Qwen/Qwen3-8B --port 30001 \\\n      --attention-backend triton --cuda-graph-max-bs-decode 32 \\\n"
        "      --enable-deterministic-inference",
        "--test-mode single --port 30000", "--test-mode single --port 30001",
        "python3 run.py --mode sweep --engine sglang --url http://localhost:30000",
        "--sizes 1,15,16,17,23,24,25 --temperature 0.0",
        "python3 run.py --mode cost --engine sglang",
    ],
}
NOTES = [
    "has to switch it off itself",
    "baseline_text is printed but never compared",
    "holds by construction",
    "FIRST completion of each batch",
    "In 0.5.18 to 0.5.23 (the releases read from their wheels)",
    "with the flag off SGLang ignores it",
    "no logprobs",
    "above 32 there is no graph to pad into",
    "A comparison hazard",
    "match none of the releases checked",
    "L1879-1883",
    ".buildkite/test_areas/misc.yaml",
    ":nvidia: (B200) Batch Invariance\" (lines 994-1017)",
    "compilation_config.use_breakable_cudagraph",
]


def no_network(*args, **kwargs):
    raise AssertionError("harness mode tried to open a socket")


class Harness(unittest.TestCase):
    def test_prints_every_excerpt_provenance_and_command_with_no_network(self):
        with mock.patch.object(socket, "socket", no_network), \
                mock.patch.object(socket, "create_connection", no_network):
            r = run_lab("--mode", "harness")
        self.assertEqual(r.code, 0, r)
        for engine in ("vllm", "sglang"):
            for line in EXCERPT_LINES[engine] + PROVENANCE[engine] + COMMANDS[engine]:
                with self.subTest(engine=engine, line=line):
                    self.assertIn(line, r.stdout)
        for note in NOTES:
            with self.subTest(note=note):
                self.assertIn(note, r.stdout)

    def test_excerpts_are_marked_as_quotations_under_their_header(self):
        r = run_lab("--mode", "harness")
        lines = r.stdout.splitlines()
        for ex in run.HARNESS_EXCERPTS:
            with self.subTest(excerpt=ex.title):
                header = next(i for i, line in enumerate(lines) if ex.source in line)
                self.assertTrue(lines[header].startswith("Quoted from "))
                first = ex.text.splitlines()[0]
                self.assertEqual(lines[header + 2], "    > " + first)

    def test_engine_filter(self):
        r = run_lab("--mode", "harness", "--engine", "sglang")
        self.assertEqual(r.code, 0)
        self.assertIn(EXCERPT_LINES["sglang"][0], r.stdout)
        self.assertNotIn(EXCERPT_LINES["vllm"][0], r.stdout)
        r = run_lab("--mode", "harness", "--engine", "vllm")
        self.assertNotIn(EXCERPT_LINES["sglang"][0], r.stdout)

    def test_plain_text_unless_a_terminal(self):
        r = run_lab("--mode", "harness")
        self.assertNotIn("\033[", r.stdout)

    def test_colour_on_a_terminal_but_not_with_no_color(self):
        class Tty:
            def isatty(self):
                return True
        with mock.patch.dict(os.environ, {}, clear=False):
            os.environ.pop("NO_COLOR", None)
            self.assertTrue(run.Out(Tty(), Tty()).colour)
            os.environ["NO_COLOR"] = "1"
            self.assertFalse(run.Out(Tty(), Tty()).colour)

    def test_runs_in_a_fresh_process_with_no_proxy_or_network_settings(self):
        env = {"PATH": os.environ.get("PATH", ""), "http_proxy": "http://10.255.255.1:9"}
        p = subprocess.run([sys.executable, os.path.join(ROOT, "run.py"), "--mode", "harness"],
                           env=env, capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("CRITICAL: Disable batch invariance", p.stdout)


class TwoServersOnOneGpu(unittest.TestCase):
    def test_the_vllm_serve_lines_each_pass_the_memory_share_the_text_asks_for(self):
        out = run_lab("--mode", "harness", "--engine", "vllm").stdout
        self.assertIn("two servers on one GPU must each pass --gpu-memory-utilization", out)
        joined = out.replace("\\\n", " ")
        serves = [line for line in joined.splitlines() if " vllm serve " in line]
        self.assertEqual(len(serves), 2, out)
        for line in serves:
            self.assertRegex(line, r"--gpu-memory-utilization 0\.\d+\b")


class HelpAndDefaults(unittest.TestCase):
    OPTIONS = ("--mode", "--engine", "--url", "--model", "--api-key", "--max-tokens", "--save", "--json",
               "--timeout", "--max-response-mb", "--sizes", "--max-batch", "--prompt", "--prompt-file",
               "--temperature", "--seed", "--logprobs", "--baseline", "--expect", "--invariant", "--batch",
               "--trials", "--warmup", "--workload", "--prefix-tokens", "--tp", "--allow-mismatch", "--color")

    def test_help_names_every_mode_option_and_exit_code(self):
        text = run.build_parser().format_help()
        for word in ("harness", "sweep", "cost", "help") + self.OPTIONS:
            with self.subTest(word=word):
                self.assertIn(word, text)
        for title, _ in run.MODE_GROUPS:  # which options belong to which mode
            self.assertIn("\n%s:\n" % title, text)
        for code in ("0", "1", "2", "3", "130", "141"):
            self.assertRegex(text, r"\n  %s +\S" % code)

    def test_the_guide_names_each_check_with_what_it_answers(self):
        guide = run_lab("--mode", "help").stdout
        section = guide[guide.index("THE CHECKS A SWEEP CAN RUN"):guide.index("KNOWN HAZARDS")]
        for option, question, expect in (
                ("--prefill-check", "does a prefill read back equal the decode's logprobs?",
                 "prefill-equal"),
                ("--cache-check", "does a prefix-cache hit equal its cold prefill?", "cache-equal"),
                ("--neighbours L,..", "does batch 1 hold while others prefill L tokens",
                 "neighbours-equal"),
                ("--observer-check", "does asking for logprobs leave the text unchanged?",
                 "observer-equal")):
            with self.subTest(option=option):
                entry = section[section.index("  " + option + " "):].split("\n  --")[0]
                self.assertIn(question, entry)
                self.assertIn(expect, entry)
        for check in run.SWEEP_CHECKS:  # every check the sweep switches on is named there
            option = getattr(check, "OPTION", "")
            if option:
                self.assertIn("  " + option + " ", section, option)

    def test_the_guide_says_what_changes_between_vllm_releases(self):
        guide = " ".join(run_lab("--mode", "help").stdout.split())
        self.assertIn("TP costs of vLLM 0.33 and 0.34 are not comparable", guide)
        self.assertIn("FlashInfer's sampler, sliding windows before 0.34.0 on vLLM", guide)

    def test_exit_codes_read_the_same_in_help_and_guide(self):
        guide = run_lab("--mode", "help").stdout
        helptext = run.build_parser().format_help()
        for line in ("130  interrupted by Ctrl-C", "3    the server or network failed"):
            self.assertIn(line, guide)
            self.assertIn(line, helptext)

    def test_dash_dash_help_exits_zero_in_a_process(self):
        p = subprocess.run([sys.executable, os.path.join(ROOT, "run.py"), "--help"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0)
        for word in ("--mode", "--invariant", "--sizes", "--expect", "--workload", "exit codes"):
            self.assertIn(word, p.stdout)

    def test_no_arguments_is_the_guide(self):
        self.assertEqual(run_lab().stdout, run_lab("--mode", "help").stdout)

    def test_guide_covers_what_a_reader_needs(self):
        r = run_lab("--mode", "help")
        self.assertEqual(r.code, 0)
        for phrase in ("Unique completions across batch sizes, flag OFF", "flag ON", "costs",
                       "ULP", "weaker claim", "--mode harness", "--mode sweep", "--mode cost",
                       "confident", "same kernel configuration or the same CUDA-graph bucket",
                       "max-num-seqs", "already on", "fused-MoE", "top-k stays unsorted", "Mamba",
                       "TP=1 x cold", "TP=k x shared-prefix", "single-channel NCCL", "prefix-cache",
                       "report all four or none"):
            with self.subTest(phrase=phrase):
                self.assertIn(phrase, r.stdout)
        self.assertLess(len(r.stdout.split()), 1400)  # five minutes of reading

    def test_unknown_mode_is_a_usage_error(self):
        r = run_lab("--mode", "nope")
        self.assertEqual(r.code, 2)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1)
        self.assertIn("--mode", r.stderr)



class OptionsBelongToTheirMode(unittest.TestCase):
    """An option given to a mode that does not use it is refused, naming the mode it belongs
    to: a CI gate of --mode cost --expect invariant would otherwise check nothing."""

    CASES = [
        (("--mode", "cost", "--expect", "invariant"), "--expect belongs to --mode sweep"),
        (("--mode", "sweep", "--trials", "3"), "--trials belongs to --mode cost"),
        (("--mode", "sweep", "--batch", "4"), "--batch belongs to --mode cost"),
        (("--mode", "sweep", "--workload", "cold"), "--workload belongs to --mode cost"),
        (("--mode", "sweep", "--invariant", "http://x:1"), "--invariant belongs to --mode cost"),
        (("--mode", "sweep", "--concurrency", "4"), "--concurrency belongs to --mode cost"),
        (("--mode", "sweep", "--tp", "2"), "--tp belongs to --mode cost"),
        (("--mode", "cost", "--sizes", "1,2"), "--sizes belongs to --mode sweep"),
        (("--mode", "cost", "--repeat", "3"), "--repeat belongs to --mode sweep"),
        (("--mode", "cost", "--traffic", "copies"), "--traffic belongs to --mode sweep"),
        (("--mode", "cost", "--prefill-check"), "--prefill-check belongs to --mode sweep"),
        (("--mode", "cost", "--rep", "3"), "--repeat belongs to --mode sweep"),  # abbreviated
        (("--mode", "harness", "--save", "h.json"), "--save belongs to --mode sweep and"),
        (("--mode", "help", "--url", "http://x:1"), "--url belongs to --mode sweep and"),
        (("--sizes", "1,2"), "--sizes needs a --mode"),
        (("--mode", "cost", "--invariant", "http://x:1", "--batch", "4", "--concurrency", "2"),
         "give one of them"),
    ]

    def test_each_is_refused_with_one_line(self):
        for argv, words in self.CASES:
            with self.subTest(argv=argv):
                r = run_lab(*argv)
                self.assertEqual(r.code, 2, r)
                self.assertIn(words, r.stderr)
                self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)

    def test_an_option_given_its_default_is_still_given(self):
        r = run_lab("--mode", "sweep", "--trials", str(run.DEFAULT_TRIALS))
        self.assertEqual(r.code, 2, r)

    def test_what_every_mode_takes_is_taken(self):
        self.assertEqual(run_lab("--mode", "harness", "--engine", "sglang").code, 0)
        self.assertEqual(run_lab().code, 0)  # nothing at all: the guide


if __name__ == "__main__":
    unittest.main()
