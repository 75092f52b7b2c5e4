"""The stub server: the real wire formats, real float32 divergences with the flag off, and
--slowdown over all of the flag-on arm's time."""

import json
import os
import struct
import threading
import unittest
import urllib.error
import urllib.request
from unittest import mock

from support import FIXTURES, StubConfig, StubServer, fixture, post, run, stub_completion, stub_server

PROMPT = "The lab sends the same prompt at every batch size and counts what comes back:"




def get(url):
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read() or b"null")


def vllm_batch(stub, n, **extra):
    body = {"model": stub.config.model, "prompt": [PROMPT] * n, "max_tokens": 48, "temperature": 0.0,
            "top_p": 1.0, "logprobs": 5, "return_tokens_as_token_ids": True}
    body.update(extra)
    status, answer = post(stub.url + "/v1/completions", body)
    assert status == 200, answer
    return answer["choices"]


def sglang_batch(stub, n, **params):
    sp = {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 48}
    sp.update(params)
    status, answer = post(stub.url + "/generate", {"text": [PROMPT] * n, "sampling_params": sp,
                                                    "return_logprob": True, "top_logprobs_num": 5})
    assert status == 200, answer
    return answer


def key_tree(value):
    """The shape of a JSON value: keys of objects, recursively, without the values."""
    if isinstance(value, dict):
        return {k: key_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [key_tree(value[0])] if value and isinstance(value[0], (dict, list)) else "list"
    return "value"


class VllmWireFormat(unittest.TestCase):
    def test_completions_have_the_real_servers_shape(self):
        real = fixture("completions_two_prompts_logprobs3_token_ids.json")
        with StubServer() as stub:
            status, answer = post(stub.url + "/v1/completions", {
                "model": stub.config.model, "prompt": [PROMPT, PROMPT], "max_tokens": 5,
                "temperature": 0, "logprobs": 3, "return_tokens_as_token_ids": True})
        self.assertEqual(status, 200)
        self.assertEqual(set(answer), set(real))
        self.assertEqual(set(answer["choices"][0]), set(real["choices"][0]))
        self.assertEqual(set(answer["choices"][0]["logprobs"]), set(real["choices"][0]["logprobs"]))
        self.assertEqual(set(answer["usage"]), set(real["usage"]))
        self.assertEqual([c["index"] for c in answer["choices"]], [0, 1])
        lp = answer["choices"][0]["logprobs"]
        self.assertTrue(all(t.startswith("token_id:") for t in lp["tokens"]))
        self.assertTrue(all(len(d) in (3, 4) for d in lp["top_logprobs"]))  # k, or k+1 with the sampled
        self.assertEqual(list(lp["top_logprobs"][0])[0], lp["tokens"][0])
        # text_offset counts the characters of the tokens as sent, as the real server does
        self.assertEqual(lp["text_offset"][1], len(lp["tokens"][0]))

    def test_errors_read_like_the_real_server(self):
        with StubServer() as stub:
            status, answer = post(stub.url + "/v1/completions", {
                "model": stub.config.model, "prompt": [PROMPT], "logprobs": 21})
            self.assertEqual(status, 400)
            self.assertEqual(answer, fixture("error_logprobs_21.json"))
            status, answer = post(stub.url + "/v1/completions", {"model": "nope", "prompt": "x"})
            self.assertEqual(status, 404)
            self.assertEqual(answer, fixture("error_unknown_model.json"))

    def test_info_endpoints(self):
        with StubServer(StubConfig(invariant=True)) as stub:
            self.assertEqual(get(stub.url + "/version"), {"version": "0.26.0"})
            self.assertEqual(get(stub.url + "/v1/models")["data"][0]["id"], stub.config.model)
            info = get(stub.url + "/server_info?config_format=json")
            self.assertIs(info["vllm_env"]["VLLM_BATCH_INVARIANT"], True)
            self.assertEqual(set(info["vllm_config"]), set(fixture("server_info_flag_on.json")["vllm_config"]))
            urllib.request.urlopen(stub.url + "/health", timeout=10).close()
        with StubServer(StubConfig(dev_mode=False)) as stub:
            with self.assertRaises(urllib.error.HTTPError):
                get(stub.url + "/server_info")


    def test_the_cache_block_is_said_in_metrics_and_served_whole(self):
        """--block-size: /metrics says it as vLLM 0.34.0 does (vllm:cache_config_info), and
        copies of a prompt share the cache in whole blocks of it, never the last token; from
        0.34.0 on 64 tokens; an earlier release's practice engine says none."""
        prompt = " ".join(["word"] * 39)  # 40 tokens by the practice engine's count
        for config, block, served in ((StubConfig(block_size=16), 16, 32),
                                      (StubConfig(version="0.34.0"), 64, 0),
                                      (StubConfig(), None, 39)):
            with self.subTest(block=block), StubServer(config) as stub:
                text = urllib.request.urlopen(stub.url + "/metrics", timeout=10).read().decode()
                said = [line for line in text.splitlines()
                        if line.startswith("vllm:cache_config_info{")]
                self.assertEqual(said, [] if block is None else [
                    'vllm:cache_config_info{block_size="%d",cache_dtype="auto",'
                    'enable_prefix_caching="True",engine="0",hash_block_size="None"} 1.0'
                    % block])
                _, answer = post(stub.url + "/v1/completions", {
                    "model": config.model, "prompt": [prompt, prompt], "max_tokens": 1})
                self.assertEqual(answer["usage"]["prompt_tokens"], 80)
                self.assertEqual(stub.httpd.state.counters()[1], served)


class SglangWireFormat(unittest.TestCase):
    def test_generate_shape(self):
        with StubServer(StubConfig(engine="sglang")) as stub:
            answer = sglang_batch(stub, 2)
        self.assertEqual(len(answer), 2)
        item = answer[0]
        self.assertEqual(set(item), {"text", "output_ids", "meta_info"})
        meta = item["meta_info"]
        for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                    "output_token_logprobs", "output_top_logprobs"):
            self.assertIn(key, meta)
        first = meta["output_token_logprobs"][0]
        self.assertEqual((type(first[0]), type(first[1]), first[2]), (float, int, None))
        self.assertEqual(len(meta["output_top_logprobs"][0]), 5)
        self.assertEqual(meta["finish_reason"]["type"], "length")

    def test_unknown_sampling_key_is_rejected_as_0_5_23_does(self):
        with StubServer(StubConfig(engine="sglang")) as stub:
            status, answer = post(stub.url + "/generate", {"text": ["x"], "sampling_params": {"seed": 1}})
        self.assertEqual(status, 400)
        self.assertTrue(answer["error"].startswith("unknown field `seed`, expected one of "), answer)

    def test_server_info_and_flush(self):
        with StubServer(StubConfig(engine="sglang", invariant=True)) as stub:
            info = get(stub.url + "/server_info")
            for key in ("attention_backend", "enable_deterministic_inference", "tp_size", "model_path", "version"):
                self.assertIn(key, info)
            self.assertEqual(info["cuda_graph_config"]["decode"]["bs"], [1, 2, 4, 8, 12, 16, 24, 32])
            self.assertTrue(info["enable_deterministic_inference"])
            req = urllib.request.Request(stub.url + "/flush_cache", b"", method="POST")
            with urllib.request.urlopen(req, timeout=10) as resp:
                self.assertEqual(resp.status, 200)


class Divergence(unittest.TestCase):
    """Flag off: some sizes flip tokens, some move only logprobs. Flag on: nothing moves."""

    def classify(self, runs):
        base = runs[1]
        kinds = {}
        for n, (ids, lps) in runs.items():
            if ids != base[0]:
                kinds[n] = "tokens"
            elif lps != base[1]:
                kinds[n] = "logprobs"
            else:
                kinds[n] = "same"
        return kinds

    def sweep(self, engine, invariant, sizes=(1, 2, 3, 4, 8, 16, 17, 24, 25, 32)):
        runs = {}
        with StubServer(StubConfig(engine=engine, invariant=invariant)) as stub:
            for n in sizes:
                if engine == "vllm":
                    choices = vllm_batch(stub, n)
                    c = choices[-1]
                    runs[n] = (c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"])
                else:
                    item = sglang_batch(stub, n)[-1]
                    runs[n] = (item["output_ids"], [e[0] for e in item["meta_info"]["output_token_logprobs"]])
        return self.classify(runs)

    def test_flag_off_shows_both_kinds_on_both_wire_formats(self):
        for engine in ("vllm", "sglang"):
            with self.subTest(engine=engine):
                kinds = self.sweep(engine, False)
                self.assertIn("tokens", kinds.values())
                self.assertIn("logprobs", kinds.values())

    def test_flag_on_shows_neither(self):
        for engine in ("vllm", "sglang"):
            with self.subTest(engine=engine):
                kinds = self.sweep(engine, True)
                self.assertEqual(set(kinds.values()), {"same"})

    def test_copies_can_come_back_in_two_runs_as_real_engines_answered_them(self):
        # vLLM 0.26.0 and SGLang 0.5.17, flag off, answered copies in two runs of alike values
        for engine, invariant in (("vllm", False), ("sglang", False), ("vllm", True), ("sglang", True)):
            with self.subTest(engine=engine, invariant=invariant), \
                    StubServer(StubConfig(engine=engine, invariant=invariant, copies_split=3)) as stub:
                if engine == "vllm":
                    runs = [c["logprobs"]["token_logprobs"] for c in vllm_batch(stub, 8)]
                else:
                    runs = [[e[0] for e in i["meta_info"]["output_token_logprobs"]] for i in sglang_batch(stub, 8)]
                self.assertEqual(runs[:3], [runs[0]] * 3)
                self.assertEqual(runs[3:], [runs[3]] * 5)
                self.assertEqual(runs[3] == runs[0], invariant)  # flag on: every copy alike

    def test_logprobs_are_float32_values(self):
        ids, lps, tops, _ = stub_completion("vllm", PROMPT, 17, 16, 5)
        for x in lps:
            self.assertEqual(struct.unpack("<f", struct.pack("<f", x))[0], x)

    def test_seeded_sampling_is_reproducible_per_request(self):
        with StubServer(StubConfig(invariant=True)) as stub:
            a = vllm_batch(stub, 3, temperature=0.8, seed=7)
            b = vllm_batch(stub, 3, temperature=0.8, seed=7)
            c = vllm_batch(stub, 3, temperature=0.8, seed=8)
        self.assertEqual([x["text"] for x in a], [x["text"] for x in b])
        self.assertEqual(len({x["text"] for x in a}), 1)  # one seed for every prompt of the list
        self.assertNotEqual(a[0]["text"], c[0]["text"])

    def test_seeded_sampling_still_diverges_with_the_flag_off(self):
        texts = {stub_completion("vllm", PROMPT, n, 64, 5, temperature=0.6, seed=42)[3]
                 for n in (1, 2, 4, 8, 16, 17, 24, 25, 32)}
        self.assertGreater(len(texts), 1)


class Lifecycle(unittest.TestCase):
    def test_stops_cleanly_without_leaking_threads_or_sockets(self):
        before = set(threading.enumerate())
        stub = StubServer().start()
        get(stub.url + "/version")
        stub.stop()
        self.assertEqual(set(threading.enumerate()) - before, set())
        self.assertEqual(stub.httpd.socket.fileno(), -1)

    def test_faults_hit_the_kth_generation_request_only(self):
        with StubServer(StubConfig(faults={2: "http500"})) as stub:
            vllm_batch(stub, 1)
            status, answer = post(stub.url + "/v1/completions", {"model": stub.config.model, "prompt": ["x"]})
            self.assertEqual(status, 500)
            self.assertIn("message", answer["error"])
            vllm_batch(stub, 1)

    def test_standalone_arguments(self):
        with self.assertRaises(SystemExit):
            stub_server.parse_faults(["x=http500"])
        self.assertEqual(stub_server.parse_faults(["3=drop"]), {3: "drop"})


class StreamLikeVllm(unittest.TestCase):
    def test_the_lab_reads_the_real_stream_token_by_token(self):
        with open(os.path.join(FIXTURES, "stream_usage.body"), encoding="utf-8") as f:
            data = [line[6:] for line in f.read().splitlines() if line.startswith("data: ")]
        self.assertEqual(data[-1], "[DONE]")
        events = [json.loads(d) for d in data[:-1]]
        counts = [run.ADAPTERS["vllm"].streamed_tokens(e) for e in events]
        self.assertEqual(counts[:-1], list(range(1, len(counts))))  # one token an event ...
        self.assertEqual(events[-1]["choices"], [])                   # ... then the usage alone
        self.assertTrue(run.token_by_token(counts[0], len(counts) - 1, counts[-1]))
        stub = stub_server.stream_events("vllm", stub_server.vllm_completions(
            StubConfig(), {"prompt": ["x"], "max_tokens": 3, "temperature": 0}, stub_server.EngineState(StubConfig())))
        self.assertEqual(set(stub[0]) - {"usage"}, set(events[0]) - {"usage"})
        self.assertEqual(stub[-1]["choices"], [])


if __name__ == "__main__":
    unittest.main()


class EmulatedTime:
    """The practice engine's `time`, on a clock of its own: sleeping advances it, nothing else
    does, so what a request took is what the engine meant it to take, whatever the machine."""

    def __init__(self, real):
        self.real, self.now = real, 0.0
        self.lock = threading.Lock()

    def perf_counter(self):
        return self.now

    def sleep(self, seconds):
        with self.lock:
            self.now += max(0.0, seconds)

    def __getattr__(self, name):
        return getattr(self.real, name)


class SlowdownStretchesTheBatchingWindow(unittest.TestCase):
    """With --slowdown F, all of the flag-on arm's own time is F times the flag-off arm's,
    its batching window included (a window left unslowed made a 25 % slowdown read as +9.4 %
    in a cost run). The benchmark tests/bench_slowdown.py times the same on real clocks."""

    def took(self, config):
        """The emulated seconds one request of 4 prompts took, from its headers to its answer."""
        emulated = EmulatedTime(stub_server.time)
        with StubServer(config) as stub, mock.patch.object(stub_server, "time", emulated):
            before = emulated.now
            vllm_batch(stub, 4, max_tokens=16)
            return emulated.now - before

    def test_the_flag_on_arm_takes_the_stated_factor_of_window_and_steps(self):
        window = dict(step_delay=0.002, scheduler_window=0.05)
        off = self.took(StubConfig(**window))
        on = self.took(StubConfig(invariant=True, slowdown=1.25, **window))
        self.assertGreater(off, 0.05)  # the window, then the steps
        self.assertAlmostEqual(on, 1.25 * off)
