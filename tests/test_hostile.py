# SPDX-License-Identifier: Apache-2.0
"""The fourth round of hostile input, a class per test class: secrets a saved file must survive,
saves that cannot lose a finished result, server text that cannot forge a line, answers of the
wrong shape that must not be compared, and inputs that once ended in a traceback."""

import io
import json
import math
import os
import socket
import subprocess
import sys
import threading
import unittest

from support import (ROOT, RUN_PY, StubConfig, StubServer, TempDirTest, one_error_line, run,
                     run_lab)


class KeysHiddenByValue(TempDirTest):
    def test_a_key_that_is_a_json_word_leaves_every_saved_file_valid_json(self):
        for key in ("null", "0", "64"):
            with self.subTest(key=key), StubServer(StubConfig(invariant=True)) as stub:
                path = self.path("s%s.json" % key)
                r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                            "--repeat", 1, "--api-key", key, "--save", path)
                self.assertEqual(r.code, 0, r)
                with open(path, encoding="utf-8") as f:
                    doc = json.load(f)  # standard JSON, whatever the key
                self.assertEqual(doc["summary"]["total_completions"], 3)

    def test_the_placeholder_key_empty_leaves_the_word_empty_alone(self):
        prompt = "Say why an empty queue is empty:"
        with StubServer(StubConfig(invariant=True)) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                        "--repeat", 1, "--prompt", prompt, "--save", self.path("s.json"),
                        env={"OPENAI_API_KEY": "EMPTY"})
        self.assertEqual(r.code, 0, r)
        self.assertEqual(self.load("s.json")["prompts"][0]["prompt"], prompt)

    def test_a_key_with_a_line_break_is_refused_before_any_request(self):
        with StubServer() as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--api-key", "abc\r\nX-Injected: 1")
            self.assertEqual(stub.requests, [])
        one_error_line(self, r, 2, "no HTTP header can carry it")
        self.assertNotIn("X-Injected", r.stderr)

    def test_the_start_of_a_key_a_server_echoes_is_hidden(self):
        secrets = run.Secrets()
        secrets.keep("zq7-secretvalue-991")
        self.assertEqual(secrets.hide("got ZQ7-SECRETVALU in the header"), "got [api key] in the header")
        self.assertEqual(secrets.hide("zq7-sec is too short to tell"), "zq7-sec is too short to tell")


class SavesThatCannotLoseAResult(TempDirTest):
    def test_a_link_to_a_missing_folder_is_refused_before_any_request(self):
        os.symlink(os.path.join(self.path("nowhere"), "s.json"), self.path("link.json"))
        with StubServer() as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--save", self.path("link.json"))
            self.assertEqual(stub.requests, [])
        one_error_line(self, r, 2, "a link to")

    def test_a_read_only_file_is_refused_before_any_request(self):
        with open(self.path("ro.json"), "w") as f:
            json.dump({"schema": run.COST_SCHEMA, "cells": []}, f)
        os.chmod(self.path("ro.json"), 0o444)
        with StubServer() as stub, StubServer(StubConfig(invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", stub.url, "--invariant", on.url,
                        "--save", self.path("ro.json"))
        one_error_line(self, r, 2, "is read-only")

    def test_a_file_another_run_wrote_meanwhile_is_not_overwritten(self):
        path = self.path("s.json")
        saves = run.ThrottledSave(path, exclusive=True)
        saves.write(lambda p: run.write_json_atomic(p, {"run": "mine", "n": 1}))
        run.write_json_atomic(path, {"run": "theirs"})  # another run, into the same file
        saves.write(lambda p: run.write_json_atomic(p, {"run": "mine", "n": 2}))
        self.assertEqual(self.load("s.json"), {"run": "theirs"})
        self.assertIsNotNone(saves.moved_to)
        with open(saves.moved_to, encoding="utf-8") as f:
            self.assertEqual(json.load(f), {"run": "mine", "n": 2})
        out = io.StringIO()
        code = run.report_save(run.Config("sweep", save=path), saves, 0, run.Out(out, out))
        self.assertEqual(code, run.EXIT_SERVER)
        self.assertIn("written by another run", out.getvalue())


class ServerTextOnOneLine(unittest.TestCase):
    def test_escape_sequences_and_line_breaks_are_written_as_escapes(self):
        body = json.dumps({"error": {"message": "bad\n\x1b[31mrun.py: expect invariant: held"}}).encode()
        message = run.server_message(body)
        self.assertNotIn("\n", message)
        self.assertNotIn("\x1b", message)
        self.assertIn("\\x1b[31m", message)
        self.assertEqual(run.plain_scalar("model\rX"), "model\\rX")


def sse_server(payload):
    """A loopback server that answers one request with an event stream of these bytes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def serve():
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
                         + payload)
        listener.close()

    threading.Thread(target=serve, daemon=True).start()
    return "http://127.0.0.1:%d" % listener.getsockname()[1]


class EventStreams(unittest.TestCase):
    def events(self, payload):
        client = run.HttpClient(sse_server(payload), None, 10, 1 << 20)
        post = run.Exchange(client, "POST", "/v1/completions", {"stream": True})
        post.connect()
        post.send()
        return list(post.events())

    def test_an_event_of_several_data_lines_is_one_event(self):
        events = self.events(b'data: {"a":\r\ndata: 1}\r\n\r\ndata: {"b": 2}\n\ndata: [DONE]\n\n')
        self.assertEqual(events, [{"a": 1}, {"b": 2}])

    def test_a_byte_order_mark_at_the_start_is_dropped(self):
        events = self.events(b'\xef\xbb\xbfdata: {"a": 1}\n\n: a comment\nevent: x\ndata: [DONE]\n\n')
        self.assertEqual(events, [{"a": 1}])


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


class NoTraceback(TempDirTest):
    def test_a_request_rate_too_low_to_send_is_refused(self):
        r = run_lab("--mode", "sweep", "--traffic", "concurrent", "--request-rate", "1e-300")
        one_error_line(self, r, 2, "--request-rate: at least")

    def test_a_prompt_that_is_not_utf8_is_refused_as_a_prompt_file_is(self):
        p = subprocess.run([sys.executable, RUN_PY, "--mode", "sweep", "--prompt", b"caf\xe9"],
                           capture_output=True)
        self.assertEqual(p.returncode, 2, p)
        self.assertIn(b"not UTF-8 text", p.stderr)

    def test_stdout_closed_before_the_start(self):
        for argv in (["--version"], ["--mode", "harness"]):
            with self.subTest(argv=argv):
                p = subprocess.run([sys.executable, RUN_PY] + argv, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                   preexec_fn=lambda: os.close(1))
                self.assertNotIn("Traceback", p.stderr)
                self.assertIn(p.returncode, (0, run.EXIT_OUTPUT))

    def test_a_prefill_logprob_far_above_the_decodes_is_an_infinite_kl_term(self):
        kl = run.KlEstimate()
        kl.add([-2000.0], [-0.5], ())
        self.assertEqual((kl.divergent, kl.largest), (1, math.inf))

    def test_compare_and_the_plots_refuse_files_they_did_not_write_in_one_line(self):
        odd = self.path("odd.json")
        with open(odd, "w") as f:
            json.dump({"schema": run.SWEEP_SCHEMA, "prompts": [{"sizes": "x"}], "summary": 3}, f)
        p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "compare.py"), odd, odd],
                           capture_output=True, text=True)
        self.assertEqual(p.returncode, 2, p)
        self.assertNotIn("Traceback", p.stderr)


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
