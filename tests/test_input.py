# SPDX-License-Identifier: Apache-2.0
"""Bad input, refused before any request: every option, number, file, URL and limit gets one
line on stderr and exit 2, and no request is sent; each error a newcomer makes comes with
its hint."""

import json
import os
import subprocess
import sys
import unittest
from unittest import mock

from support import (RUN_PY, StubConfig, StubServer, TempDirTest, error_lines, fixture, free_port,
                     one_error_line, run, run_lab)


class NumbersThatAreNotNumbers(TempDirTest):
    def test_every_numeric_option_takes_only_a_finite_value_in_range(self):
        with StubServer() as stub:
            cases = [("--timeout", "nan"), ("--timeout", "inf"), ("--timeout", "-1"), ("--temperature", "nan"),
                     ("--temperature", "１"), ("--max-tokens", "٣"), ("--max-tokens", "1e3"), ("--logprobs", "²"),
                     ("--repeat", "3.0"), ("--sizes", "1,²"), ("--sizes", "1,٣"), ("--max-batch", "0x10"),
                     ("--seed", "-1"), ("--max-response-mb", "0"), ("--wait-ready", "nan")]
            for option, value in cases:
                with self.subTest(option=option, value=value):
                    r = run_lab("--mode", "sweep", "--url", stub.url, option, value)
                    one_error_line(self, r, 2, option)
            for option, value in (("--trials", "NaN"), ("--batch", "+inf"), ("--warmup", "-1"), ("--tp", "0"),
                                  ("--prefix-tokens", "1.5")):
                with self.subTest(option=option, value=value):
                    r = run_lab("--mode", "cost", "--url", stub.url, "--invariant", "http://127.0.0.1:9", option, value)
                    one_error_line(self, r, 2, option)
            self.assertEqual(stub.requests, [])


class FilesThatAreNotFiles(TempDirTest):
    def test_devices_fifos_and_folders_are_refused_before_any_request(self):
        fifo = self.path("fifo")
        os.mkfifo(fifo)
        with StubServer() as stub:
            for option, path in (("--prompt-file", "/dev/zero"), ("--prompt-file", fifo), ("--prompt-file", self.tmp),
                                 ("--baseline", "/dev/zero"), ("--baseline", fifo), ("--save", "/dev/null")):
                with self.subTest(option=option, path=path):
                    r = run_lab("--mode", "sweep", "--url", stub.url, option, path)
                    one_error_line(self, r, 2, "is not a regular file")
            self.assertEqual(stub.requests, [])

    def test_a_file_over_the_limit_is_refused_unread(self):
        big = self.path("big.txt")
        with open(big, "wb") as f:
            f.truncate(3 << 20)  # sparse: nothing to read
        with mock.patch.object(run, "MAX_INPUT_FILE_MB", 2), mock.patch("builtins.open", side_effect=AssertionError):
            with self.assertRaises(run.UsageError) as caught:
                run.read_input_file(big, "--prompt-file")
        self.assertIn("larger than 2 MB", str(caught.exception))


class BadArguments(TempDirTest):
    """Every one: exit 2, one line on stderr, no request sent."""

    def setUp(self):
        super().setUp()
        self.stub = StubServer().start()
        with open(self.path("sweep.json"), "w") as f:
            json.dump({"schema": run.SWEEP_SCHEMA, "prompts": []}, f)
        with open(self.path("cost.json"), "w") as f:
            json.dump({"schema": run.COST_SCHEMA, "cells": []}, f)
        with open(self.path("broken.json"), "w") as f:
            f.write('{"schema": ')
        with open(self.path("latin1.txt"), "wb") as f:
            f.write(b"caf\xe9\n")
        open(self.path("empty.txt"), "w").close()

    def tearDown(self):
        self.stub.stop()
        super().tearDown()

    def refused(self, *args, message):
        r = run_lab(*args)
        self.assertEqual(r.code, 2, (args, r))
        self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
        self.assertIn(message, r.stderr)
        self.assertNotIn("Traceback", r.stderr)
        self.assertEqual(self.stub.requests, [], args)

    def test_sweep_arguments(self):
        url = ("--url", self.stub.url)
        cases = [
            (("--sizes", ""), "--sizes"), (("--sizes", "0,1"), "start at 1"), (("--sizes", "-3"), "start at 1"),
            (("--sizes", "1,x"), "not a whole number"), (("--sizes", "1,2,2"), "listed twice"),
            (("--logprobs", "21"), "--logprobs: give 0 to 20"), (("--logprobs", "-1"), "--logprobs"),
            (("--temperature", "-0.5"), "--temperature"), (("--max-tokens", "0"), "--max-tokens"),
            (("--max-batch", "0"), "--max-batch"), (("--timeout", "0"), "--timeout"),
            (("--prompt-file", self.path("missing.txt")), "cannot read"),
            (("--prompt-file", self.path("empty.txt")), "holds no prompt"),
            (("--prompt-file", self.path("latin1.txt")), "not UTF-8"),
            (("--baseline", self.path("missing.json")), "cannot read"),
            (("--baseline", self.path("broken.json")), "not valid JSON"),
            (("--baseline", self.path("cost.json")), "not a sweep result"),
            (("--save", self.path("no/such/dir/s.json")), "does not exist"),
            (("--save", self.path("cost.json")), "refusing to overwrite"),
            (("--save", self.path("broken.json")), "not valid JSON"),
        ]
        for extra, message in cases:
            with self.subTest(args=extra):
                self.refused("--mode", "sweep", *url, *extra, message=message)

    def test_engine_and_url(self):
        self.refused("--mode", "sweep", "--engine", "tgi", message="--engine")
        for url in ("file:///etc/passwd", "ftp://host/x", "http://"):
            with self.subTest(url=url):
                self.refused("--mode", "sweep", "--url", url, message="not an http:// or https:// URL")
        for url in ("localhost:8000", "gpu-box"):  # no scheme: the hint names the URL to give
            with self.subTest(url=url):
                self.refused("--mode", "sweep", "--url", url,
                             message="has no scheme: the lab speaks plain HTTP to engines, so "
                             "give http://" + url)
        self.refused("--mode", "cost", "--url", self.stub.url, "--invariant", "file:///x",
                     message="--invariant")

    def test_cost_arguments(self):
        base = ("--mode", "cost", "--url", self.stub.url)
        self.refused(*base, message="needs --invariant")
        self.refused(*base, "--invariant", self.stub.url + "/", message="the same server")
        port = self.stub.url.rsplit(":", 1)[1]
        self.refused("--mode", "cost", "--url", "http://localhost:" + port, "--invariant",
                     "http://127.0.0.1:" + port, message="the same server")
        self.refused(*base, "--invariant", "http://127.0.0.1:80x", message="port that is not a number")
        self.refused(*base, "--invariant", "http://127.0.0.1:1", "--trials", "0", message="--trials")
        self.refused(*base, "--invariant", "http://127.0.0.1:1", "--batch", "0", message="--batch")
        self.refused(*base, "--invariant", "http://127.0.0.1:1", "--save", self.path("sweep.json"),
                     message="refusing to overwrite")


class InputBoundedBeforeAnyRequest(TempDirTest):
    """Every input is bounded and every URL parsed under guard, with one line and exit 2,
    before any request."""

    def refused(self, *argv, message):
        with StubServer() as stub:
            r = run_lab("--mode", argv[0], "--url", stub.url, *argv[1:])
            self.assertEqual(stub.requests, [], "a request was sent")
        self.assertEqual(r.code, 2, r)
        self.assertEqual(len(error_lines(r)), 1, r.stderr)
        self.assertIn(message, r.stderr)
        return r

    def test_sizes_and_counts_have_upper_bounds(self):
        self.refused("sweep", "--sizes", "1,50000000", message="batch sizes go up to 4096")
        self.refused("sweep", "--max-batch", 10 ** 9, message="give 1 to 4096")
        cost = ("cost", "--invariant", "http://127.0.0.1:1")
        self.refused(*cost, "--prefix-tokens", 10 ** 9, message="give 1 to 1000000")
        self.refused(*cost, "--batch", 5000, message="give 1 to 4096")
        self.refused(*cost, "--concurrency", 5000, message="give 1 to 4096")
        self.refused(*cost, "--concurrency", 8, "--requests", 10 ** 7, message="give 1 to 1000000")

    def test_a_seed_beyond_a_signed_64_bit_int_is_refused(self):
        # what vLLM's completions request takes (its 400 would come only after the check's
        # first request); the largest one is taken, in both modes
        for mode in (("sweep",), ("cost", "--invariant", "http://127.0.0.1:1")):
            with self.subTest(mode=mode[0]):
                self.refused(*mode, "--seed", 2 ** 63, "--temperature", "0.7",
                             message="--seed: give 0 to %d (got %d)" % (2 ** 63 - 1, 2 ** 63))
                self.refused(*mode, "--seed", 10 ** 30, message="--seed: give 0 to")
        self.assertEqual(run.configure(["--mode", "sweep", "--seed", str(2 ** 63 - 1),
                                        "--temperature", "0.7"]).sampling.seed, 2 ** 63 - 1)

    def test_prompt_files_are_bounded_in_count_and_length(self):
        many = self.path("many.txt")
        with open(many, "w") as f:
            f.write("p%d\n" * 100001 % tuple(range(100001)))
        self.refused("sweep", "--prompt-file", many, message="at most 100000 prompts (got 100001)")
        long = self.path("long.txt")
        with open(long, "w") as f:
            f.write("short\n" + "x" * ((1 << 22) + 1) + "\n")
        self.refused("sweep", "--prompt-file", long, message="prompt 2 has 4194305 characters")

    def test_the_limits_are_in_help(self):
        text = subprocess.run([sys.executable, RUN_PY, "--help"], capture_output=True, text=True).stdout
        self.assertIn("limits (larger is refused):", text)
        self.assertRegex(text, r"batch sizes, --max-batch, --batch, --concurrency +at most 4096")
        self.assertRegex(text, r"\n  --seed +at most 9223372036854775807\n")

    def test_malformed_urls_get_a_usage_error_and_a_hint(self):
        for url, message in [
            ("http://[::1", "not a URL the lab can use (Invalid IPv6 URL)"),
            ("http://127.0.0.1:8000/v1/completions",
             "give the server's base URL, not an endpoint: http://127.0.0.1:8000 (the lab sends "
             "to its own paths under it: /v1/completions on vLLM, /generate on SGLang)"),
            ("http://127.0.0.1:8000/v1/chat/completions",  # not the lab's: it says which it uses
             "not an endpoint: http://127.0.0.1:8000 (the lab sends to its own paths under it: "
             "/v1/completions on vLLM"),
            ("http://127.0.0.1:30000/generate", "not an endpoint: http://127.0.0.1:30000"),
            ("http://127.0.0.1:8000 /v1", "the URL has a space in it"),
        ]:
            with self.subTest(url=url):
                r = run_lab("--mode", "sweep", "--url", url)
                self.assertEqual(r.code, 2, r)
                self.assertEqual(len(error_lines(r)), 1, r.stderr)
                self.assertIn(message, r.stderr)

    def test_a_cost_file_of_load_cells_takes_another(self):
        # Load cells have no batch (null): the check of an existing file must know them, or
        # the second cell of an experiment is refused (as it was on a real vLLM).
        save = self.path("cost.json")
        for workload in ("cold", "shared-prefix"):
            with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
                r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--concurrency", 2,
                            "--requests", 2, "--trials", 1, "--warmup", 0, "--max-tokens", 2, "--workload",
                            workload, "--save", save)
            self.assertEqual(r.code, 0, r)
        with open(save) as f:
            self.assertEqual([c["workload"] for c in json.load(f)["cells"]], ["cold", "shared-prefix"])

    def test_labels_that_may_be_null_may_be_missing_from_a_cost_file(self):
        # A file's cell without its TP degree, or a load cell without a batch, is taken: adding
        # this run's cell to it must then work too (it failed once the run had measured).
        cells = []
        for label in ("tp", "batch"):
            cell = fixture("cost-load.json", "saved")["cells"][0]
            del cell[label]
            cells.append(dict(cell, workload="cold" if label == "tp" else "shared-prefix"))
        doc = {"schema": run.COST_SCHEMA, "cells": cells}
        self.assertIsNone(run.cost_file_fault(doc))
        added = run.add_cell(doc, dict(cells[0], tp=None, state="complete"))
        self.assertEqual([c.get("tp", "missing") for c in added["cells"]], [1, None])

    def test_a_cost_file_with_malformed_cells_is_refused_before_any_request(self):
        save = self.path("cost.json")
        with open(save, "w") as f:
            json.dump({"schema": run.COST_SCHEMA, "cells": [{"tp": 1, "workload": "cold"}]}, f)
        r = self.refused("cost", "--invariant", "http://127.0.0.1:1", "--save", save,
                         message="holds cost results the lab cannot add to (cell 1: its model is "
                                 "missing or malformed)")
        self.assertNotIn("Traceback", r.stderr)


class Urls(unittest.TestCase):
    def test_as_people_paste_them(self):
        cases = {"http://127.0.0.1:8000/v1": "http://127.0.0.1:8000",
                 "http://127.0.0.1:8000/v1/": "http://127.0.0.1:8000",
                 "http://0.0.0.0:8000": "http://127.0.0.1:8000",
                 "http://[::]:8000/v1": "http://[::1]:8000",
                 "https://gpu.example/llm/v1": "https://gpu.example/llm",
                 "http://localhost:30000/": "http://localhost:30000"}
        for given, wanted in cases.items():
            with self.subTest(url=given):
                self.assertEqual(run.check_url(given, "--url"), wanted)

    def test_a_port_out_of_range_is_refused_as_such(self):
        for url, port in (("localhost:99999", "99999"), ("http://localhost:99999", "99999"),
                          ("http://127.0.0.1:65536/v1", "65536"), ("http://[::1]:70000", "70000"),
                          ("http://localhost:0", "0"), ("localhost:0", "0"),
                          ("http://localhost:-1", "-1"), ("localhost:-8000", "-8000")):
            with self.subTest(url=url):
                with self.assertRaises(run.UsageError) as caught:
                    run.check_url(url, "--url")
                self.assertEqual(str(caught.exception),
                                 "--url: %r has port %s, out of range: a port is from 1 to "
                                 "65535" % (url, port))
        for url in ("http://localhost:80x", "http://localhost:+80", "http://localhost:٣",
                    "http://[::1]:8o"):
            with self.subTest(url=url):
                with self.assertRaises(run.UsageError) as caught:
                    run.check_url(url, "--url")
                self.assertIn("has a port that is not a number", str(caught.exception))
        for url in ("http://localhost:1", "http://localhost:65535", "http://[::1]:8000"):
            with self.subTest(url=url):
                self.assertEqual(run.check_url(url, "--url"), url)

    def test_a_port_out_of_range_is_one_line_before_any_request(self):
        r = run_lab("--mode", "sweep", "--url", "localhost:99999")
        one_error_line(self, r, 2, "has port 99999, out of range: a port is from 1 to 65535")
        r = run_lab("--mode", "cost", "--url", "http://127.0.0.1:8000", "--invariant",
                    "http://127.0.0.1:0")
        one_error_line(self, r, 2, "--invariant: 'http://127.0.0.1:0' has port 0, out of range")

    def test_a_v1_url_and_the_address_vllm_logs_work(self):
        with StubServer() as stub:
            port = stub.url.rsplit(":", 1)[1]
            for url in ("http://127.0.0.1:%s/v1" % port, "http://0.0.0.0:%s" % port):
                with self.subTest(url=url):
                    r = run_lab("--mode", "sweep", "--url", url, "--sizes", "1,2", "--max-tokens", 4, "--repeat", 1)
                    self.assertEqual(r.code, 0, r)



class TheServersLimits(TempDirTest):
    """What the server's own limits cannot hold is refused before the first generation
    request (exit 2), naming the limit: a completion longer than the model's context would
    otherwise be sent and waited for."""

    def test_max_tokens_beyond_the_model_length(self):
        with StubServer() as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--max-tokens", 1048576)
            sent = stub.generation_bodies()
        self.assertEqual(r.code, 2, r)
        self.assertIn("maximum model length of 2048 tokens", r.stderr)
        self.assertEqual(sent, [])

    def test_a_prompt_to_build_beyond_the_model_length(self):
        with StubServer() as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--prompt-tokens", 1000000)
            sent = stub.generation_bodies()
        self.assertEqual(r.code, 2, r)
        self.assertIn("--prompt-tokens of 1000000 tokens and --max-tokens 64 do not fit", r.stderr)
        self.assertEqual(sent, [])

    def test_a_shared_prefix_beyond_the_model_length(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--workload",
                        "shared-prefix", "--prefix-tokens", 5000, "--max-tokens", 4)
            sent = off.generation_bodies() + on.generation_bodies()
        self.assertEqual(r.code, 2, r)
        self.assertIn("the built prompt (--prefix-tokens 5000 with the lab's preamble and "
                      "question) of ", r.stderr)
        self.assertEqual(sent, [])

    def test_the_built_prompt_counts_its_preamble_and_question(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--workload",
                        "shared-prefix", "--prefix-tokens", 2000, "--max-tokens", 40)
            sent = off.generation_bodies() + on.generation_bodies()
        self.assertEqual(r.code, 2, r)
        self.assertRegex(r.stderr, r"the built prompt \(--prefix-tokens 2000 with the lab's "
                         r"preamble and question\) of 20[0-9][0-9] tokens and --max-tokens 40 "
                         r"do not fit the server's maximum model length of 2048 tokens")
        self.assertEqual(sent, [])

    def test_what_fits_is_sent(self):
        with StubServer() as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--repeat", 1,
                        "--max-tokens", 2000)
        self.assertNotEqual(r.code, 2, r)


class InputsThatOnceEndedInATraceback(TempDirTest):
    def test_a_request_rate_too_low_to_send_is_refused(self):
        r = run_lab("--mode", "sweep", "--traffic", "concurrent", "--request-rate", "1e-300")
        one_error_line(self, r, 2, "--request-rate: at least")

    def test_a_prompt_that_is_not_utf8_is_refused_as_a_prompt_file_is(self):
        p = subprocess.run([sys.executable, RUN_PY, "--mode", "sweep", "--prompt", b"caf\xe9"],
                           capture_output=True)
        self.assertEqual(p.returncode, 2, p)
        self.assertIn(b"not UTF-8 text", p.stderr)


class ErrorsWithTheirHint(TempDirTest):
    def test_connection_refused_suggests_wait_ready(self):
        url = "http://127.0.0.1:%d" % free_port()
        r = run_lab("--mode", "sweep", "--url", url, "--sizes", "1")
        one_error_line(self, r, 3, "connection refused")
        self.assertIn("--wait-ready SECONDS waits for it", r.stderr)

    def test_a_url_without_a_scheme_suggests_http(self):
        r = run_lab("--mode", "sweep", "--url", "localhost:8000")
        one_error_line(self, r, 2, "give http://localhost:8000")

    def test_https_against_plain_http_suggests_http(self):
        with StubServer() as stub:
            url = stub.url.replace("http://", "https://")
            r = run_lab("--mode", "sweep", "--url", url, "--sizes", "1")
        one_error_line(self, r, 3, "TLS with %s failed" % url)
        self.assertIn("try %s" % stub.url, r.stderr)

    def test_401_names_the_key_options(self):
        with StubServer(StubConfig(faults={1: "keyinbody"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1", "--max-tokens", 2,
                        "--repeat", 1, env={k: v for k, v in os.environ.items()
                                            if k != "OPENAI_API_KEY"})
        self.assertEqual(r.code, 3, r.stderr)
        self.assertIn("HTTP 401", r.stderr)
        self.assertIn("give it with --api-key or $OPENAI_API_KEY", r.stderr)
        with StubServer(StubConfig(faults={1: "keyinbody"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1", "--max-tokens", 2,
                        "--repeat", 1, "--api-key", "sk-a-key-of-some-length")
        self.assertIn("the server refused the key given", r.stderr)

    def test_a_mode_given_as_a_word_suggests_the_option(self):
        r = run_lab("sweep", "--url", "http://localhost:8000")
        one_error_line(self, r, 2, "a mode is chosen with --mode: run.py --mode sweep")


if __name__ == "__main__":
    unittest.main()
