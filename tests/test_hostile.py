"""Reliability against hostile servers and hostile input: no answer holds the lab past its
deadline, no signal waits on a stuck request, no input or value crashes it, no key leaks,
no message blames the wrong thing. Each test names the class of fault it pins; the waits in
them are liveness bounds far above what the lab needs (the faults would hold it for a minute
or more), never timings."""

import inspect
import io
import json
import os
import re
import resource
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import unittest
from unittest import mock

from support import ROOT, StubConfig, StubServer, TempDirTest, run, run_lab, wait_for

RUN_PY = os.path.join(ROOT, "run.py")
KEY = "zq7-secretvalue-991"  # distinctive: no other text the lab prints holds its pieces


def error_lines(r):
    """stderr's lines besides progress and the save notice."""
    return [line for line in r.stderr.splitlines() if line.strip()
            and not line.startswith(("run.py: progress: ", "run.py: saved "))]


def finish(p, timeout=30):
    """(stdout, stderr) of a lab process once it ends; one still running after timeout
    seconds (a liveness bound: the faults would hold it a minute or more) is killed."""
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise


def start_lab(*argv, **kwargs):
    streams = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return subprocess.Popen([sys.executable, RUN_PY] + [str(a) for a in argv], text=True,
                            **dict(streams, **kwargs))


class Deadlines(TempDirTest):
    """One deadline covers a whole answer in every traffic shape: the status line, the
    headers and every line of a stream."""

    def test_a_concurrent_request_trickling_its_status_line_is_cut_at_the_timeout(self):
        # Requests 2 and 3 are batch 2's two concurrent requests; one trickles for 68 s.
        with StubServer(StubConfig(faults={2: "slowstatus"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                        "--repeat", 1, "--traffic", "concurrent", "--timeout", 1)
        self.assertEqual(r.code, 3, r)
        self.assertIn("no complete answer from %s within 1s (--timeout)" % stub.url, r.stderr)
        self.assertIn("(1 of 2 concurrent requests failed)", r.stderr)

    def cost_under_load(self, fault, *extra):
        with StubServer(StubConfig(faults={1: fault})) as off, \
                StubServer(StubConfig(invariant=True)) as on:
            return run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url,
                           "--concurrency", 1, "--requests", 1, "--trials", 1, "--warmup", 0,
                           "--max-tokens", 4, *extra)

    def test_a_stream_line_that_never_ends_is_cut_at_the_timeout(self):
        with StubServer(StubConfig(faults={1: "endlessline"})) as off, \
                StubServer(StubConfig(invariant=True)) as on:
            p = start_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--concurrency", 1,
                          "--requests", 1, "--trials", 1, "--warmup", 0, "--max-tokens", 4, "--timeout", 1)
            _, err = finish(p, 30)  # the line ends after 60 s, when the stub hangs up
        self.assertEqual(p.returncode, 3, err)
        self.assertIn("within 1s (--timeout)", err)
        self.assertNotIn("Traceback", err)

    def test_a_stream_line_longer_than_any_event_is_named_as_such(self):
        r = self.cost_under_load("longline")
        self.assertEqual(r.code, 3, r)
        self.assertIn("a stream line from /v1/completions is longer than 1 MiB", r.stderr)

    def test_sigterm_abandons_a_stuck_concurrent_request_and_saves(self):
        save = self.path("s.json")
        with StubServer(StubConfig(faults={2: "slowstatus"})) as stub:
            p = start_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                          "--repeat", 1, "--traffic", "concurrent", "--save", save)
            self.assertTrue(wait_for(lambda: len(stub.generation_bodies()) >= 3, 30), "no batch 2")
            p.send_signal(signal.SIGTERM)
            out, err = finish(p, 30)  # the stuck request alone would take 68 s
        self.assertEqual(p.returncode, 143, err)
        self.assertEqual(self.load("s.json")["summary"]["state"], "terminated")
        self.assertNotIn("Traceback", err)

    def test_sigterm_abandons_a_stuck_stream(self):
        with StubServer(StubConfig(faults={1: "endlessline"})) as off, \
                StubServer(StubConfig(invariant=True)) as on:
            p = start_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--concurrency", 1,
                          "--requests", 1, "--trials", 1, "--warmup", 0, "--max-tokens", 4)
            self.assertTrue(wait_for(lambda: len(off.generation_bodies()) >= 1, 30), "no request")
            p.send_signal(signal.SIGTERM)
            out, err = finish(p, 30)  # the endless line alone would take 60 s
        self.assertEqual(p.returncode, 143, err)
        self.assertIn("terminated", err)
        self.assertNotIn("Traceback", err)


class TricklingServer:
    """A loopback server that answers every connection with a status line a byte every
    0.2 s, for a minute: no single read ever times out."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = "http://127.0.0.1:%d" % self.sock.getsockname()[1]
        self.stopping = threading.Event()
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.trickle, args=(conn,), daemon=True).start()

    def trickle(self, conn):
        with conn:
            for byte in b"HTTP/1.1 200 OK\r\n" * 18:
                if self.stopping.wait(0.2):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.sock.close()


class CuttingServer(TricklingServer):
    """Answers every connection with a JSON answer cut off half way, then hangs up."""

    def trickle(self, conn):
        with conn:
            try:
                conn.recv(65536)  # the request, read so that the hang-up is no reset
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 200\r\n\r\n{\"version\": \"0.2")
            except OSError:
                pass


class UntrustedTlsServer:
    """An HTTPS server on loopback whose certificate is self-signed (made with openssl when
    the test runs): what a gateway in front of an engine often is."""

    def __init__(self, folder):
        cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-subj", "/CN=127.0.0.1", "-keyout", key, "-out", cert],
                       check=True, capture_output=True)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = "https://127.0.0.1:%d" % self.sock.getsockname()[1]
        self.context = context
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            try:
                with self.context.wrap_socket(conn, server_side=True):
                    pass  # the client refuses the certificate in the handshake
            except (OSError, ssl.SSLError):
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.sock.close()


class WaitingForServers(TempDirTest):
    @unittest.skipUnless(shutil.which("openssl"), "openssl is not installed")
    def test_an_untrusted_certificate_is_named_not_a_dropped_connection(self):
        with UntrustedTlsServer(self.tmp) as server:
            r = run_lab("--mode", "sweep", "--url", server.url, "--engine", "vllm", "--sizes", 1)
        self.assertEqual(r.code, 3, r)
        self.assertIn("the TLS certificate of %s is not trusted here" % server.url, r.stderr)
        self.assertNotIn("dropped", r.stderr)

    def test_an_answer_cut_off_is_a_dropped_connection_not_a_wrong_shape(self):
        with CuttingServer() as server:
            r = run_lab("--mode", "sweep", "--url", server.url, "--engine", "vllm", "--sizes", 1)
        self.assertEqual(r.code, 3, r)
        self.assertIn("dropped in the middle of an answer", r.stderr)
        self.assertNotIn("wrong shape", r.stderr)
        self.assertNotIn("invalid JSON", r.stderr)

    def test_wait_ready_is_bounded_by_its_own_limit_against_a_trickling_server(self):
        with TricklingServer() as server:
            p = start_lab("--mode", "sweep", "--url", server.url, "--engine", "vllm", "--wait-ready", 2)
            out, err = finish(p, 30)  # a trickled answer alone would take 60 s
        self.assertEqual(p.returncode, 3, err)
        self.assertIn("was not ready within 2s (--wait-ready)", err)


class ValuesFromServers(TempDirTest):
    """Every value a server sends is checked for range as well as type before arithmetic."""

    def test_a_token_count_no_float_holds_is_refused(self):
        with StubServer(StubConfig(faults={1: "hugeusage"})) as off, \
                StubServer(StubConfig(invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 1,
                        "--trials", 1, "--warmup", 0, "--max-tokens", 4)
        self.assertEqual(r.code, 3, r)
        self.assertIn("usage.completion_tokens is 1%s, out of range" % ("0" * 29), r.stderr)
        self.assertLess(len(r.stderr), 1000)  # the number is cut, not printed whole

    def test_a_streamed_token_count_no_float_holds_is_refused(self):
        with StubServer(StubConfig(engine="sglang", faults={1: "hugeusage"})) as off, \
                StubServer(StubConfig(engine="sglang", invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--concurrency", 1,
                        "--requests", 1, "--trials", 1, "--warmup", 0, "--max-tokens", 4)
        self.assertEqual(r.code, 3, r)
        self.assertIn("completion_tokens is 1000000", r.stderr)
        self.assertIn("out of range", r.stderr)

    def test_token_ids_in_digits_that_are_not_ascii_are_not_ids(self):
        with StubServer(StubConfig(faults={1: "unicodeids"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", 1, "--max-tokens", 4,
                        "--repeat", 1, "--prefill-check")
        self.assertEqual(r.code, 3, r)
        self.assertIn("the prefill check needs token ids, and the server's tokens are not ids", r.stderr)
        self.assertNotIn("Traceback", r.stderr)


class FaultsOfTheLabsOwn(TempDirTest):
    """Whatever still escapes ends the run with one line, exit 70 (never 1, the code of a
    failed --expect), and what was measured saved."""

    def test_an_exception_in_a_load_worker_thread_ends_the_run_as_in_the_main_thread(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on, \
                mock.patch.object(run.VllmAdapter, "streamed_tokens", side_effect=RuntimeError("boom")):
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--concurrency", 2,
                        "--requests", 2, "--trials", 1, "--warmup", 0, "--max-tokens", 4)
        self.assertEqual(r.code, 70, r)
        self.assertIn("internal error (RuntimeError at run.py line", r.stderr)
        self.assertIn("boom); please report it", r.stderr)
        self.assertNotIn("Traceback", r.stderr)

    def test_an_internal_error_mid_sweep_saves_what_was_measured(self):
        real = run.compare_batch
        calls = []

        def fails_second_time(*args):
            calls.append(1)
            if len(calls) == 2:
                raise ZeroDivisionError("a bug")
            return real(*args)

        with StubServer() as stub, mock.patch.object(run, "compare_batch", fails_second_time):
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2,3", "--max-tokens", 4,
                        "--repeat", 1, "--save", self.path("s.json"))
        self.assertEqual(r.code, 70, r)
        doc = self.load("s.json")
        self.assertEqual(doc["summary"]["state"], "stopped: internal error")
        self.assertEqual([s["batch_size"] for s in doc["prompts"][0]["sizes"]], [1])
        self.assertIn("sweep stopped: internal error (ZeroDivisionError", r.stderr)


    def test_the_line_named_is_the_labs_own_when_a_library_raised(self):
        """The error rose inside the standard library (statistics.median of nothing): the line
        to report is where run.py called it, not the library's line under run.py's name."""
        try:
            run.statistics.median([])  # no frame of run.py at all: no line to name
        except run.statistics.StatisticsError as err:
            message = run.internal_error(err)
        self.assertEqual(message, "internal error (StatisticsError: no median for empty data); "
                                  "please report it")
        timing = run.RequestTiming(None, 1.0, 4, None, 1)
        with mock.patch.object(run, "percentile", lambda values, share: run.statistics.median([])):
            try:
                run.LoadStats([[timing]], [1.0], [4]).spread("latency")
            except run.statistics.StatisticsError as err:
                message = run.internal_error(err)
        source, first = inspect.getsourcelines(run.LoadStats.spread)
        named = int(re.search(r"run\.py line (\d+)", message).group(1))
        self.assertIn("percentile(", source[named - first])

    def test_trials_shorter_than_the_clock_resolution_leave_no_rate_and_no_crash(self):
        timing = run.RequestTiming(0.0, 0.0, 4, 0.0, 4)
        stats = run.LoadStats([[timing], [timing]], [0.0, 0.0], [4, 4])
        record = stats.to_record()
        self.assertIsNone(record["median_tokens_per_s"])
        self.assertIsNone(record["median_requests_per_s"])
        out = io.StringIO()
        unmeasured = {name: run.Overhead(None, None, False) for name in run.LOAD_FIGURES}
        cell = mock.Mock(load={"off": stats, "on": stats}, overheads=unmeasured,
                         compared_on="time per trial")
        run.print_load_report(cell, run.Out(out, out))
        self.assertIn("flag off ? tokens/s, ? requests/s", out.getvalue())


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

    def test_malformed_urls_get_a_usage_error_and_a_hint(self):
        for url, message in [
            ("http://[::1", "not a URL the lab can use (Invalid IPv6 URL)"),
            ("http://127.0.0.1:8000/v1/completions",
             "give the server's base URL, not an endpoint: http://127.0.0.1:8000 (the lab adds "
             "/v1/completions itself)"),
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

    def test_a_cost_file_with_malformed_cells_is_refused_before_any_request(self):
        save = self.path("cost.json")
        with open(save, "w") as f:
            json.dump({"schema": run.COST_SCHEMA, "cells": [{"tp": 1, "workload": "cold"}]}, f)
        r = self.refused("cost", "--invariant", "http://127.0.0.1:1", "--save", save,
                         message="holds cost results the lab cannot add to (cell 1: its model is "
                                 "missing or malformed)")
        self.assertNotIn("Traceback", r.stderr)


class OutputThatCannotBeWritten(TempDirTest):
    """stdout or stderr full or closed: one line where one can be written, exit 74 (or 141 for
    a closed pipe), and what was measured saved."""

    def test_stdout_on_a_full_disk(self):
        with StubServer() as stub, open("/dev/full", "w") as full:
            p = start_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                          "--repeat", 1, stdout=full)
            _, err = finish(p, 60)
        self.assertEqual(p.returncode, 74, err)
        self.assertEqual(err.strip().splitlines(),
                         ["run.py: cannot write to stdout (No space left on device); the run ended there"])

    def test_stderr_on_a_full_disk_mid_run_saves_what_was_measured(self):
        save = self.path("s.json")
        with StubServer() as stub, open("/dev/full", "w") as full:
            p = subprocess.Popen([sys.executable, RUN_PY, "--mode", "sweep", "--url", stub.url, "--sizes",
                                  "1,2", "--max-tokens", "4", "--repeat", "1", "--save", save],
                                 stdout=subprocess.PIPE, stderr=full, text=True)
            out, _ = finish(p, 60)
        self.assertEqual(p.returncode, 74, out)
        self.assertEqual(self.load("s.json")["summary"]["state"], "stopped: output failed")
        self.assertIn("unique completions", out)

    def test_stdout_closed_mid_run_saves_what_was_measured(self):
        save = self.path("s.json")
        with StubServer(StubConfig(step_delay=0.01)) as stub:
            p = start_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2,3,4,5,6", "--max-tokens",
                          4, "--repeat", 1, "--save", save)
            next(line for line in p.stdout if re.match(r" +1 ", line))  # batch 1's row is out
            p.stdout.close()  # as `| head` does
            with p.stderr:
                err = p.stderr.read()
            p.wait(timeout=60)
        self.assertEqual(p.returncode, 141, err)
        self.assertEqual(self.load("s.json")["summary"]["state"], "stopped: output failed")
        self.assertNotIn("Traceback", err)


class Secrets(TempDirTest):
    """The key is never printed or saved: in any case, whole or cut, wherever it turns up."""

    def assert_no_key(self, *texts):
        for text in texts:
            self.assertNotIn(KEY[:5].lower(), text.lower())

    def test_a_key_a_plain_text_error_echoes_is_hidden_before_the_body_is_cut(self):
        with StubServer(StubConfig(faults={2: "keyinbody"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                        "--repeat", 1, "--api-key", KEY)
        self.assertEqual(r.code, 3, r)
        self.assertIn("HTTP 401", r.stderr)
        self.assert_no_key(r.stdout, r.stderr)

    def test_a_key_in_the_facts_the_server_reports_is_neither_printed_nor_saved(self):
        model = "org/%s-instruct" % KEY.upper()
        with StubServer(StubConfig(model=model)) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                        "--repeat", 1, "--api-key", KEY, "--save", self.path("s.json"))
            sent = stub.generation_bodies()
        self.assertEqual(r.code, 0, r)
        self.assertEqual(json.loads(sent[0])["model"], model)  # the server still gets its own id
        with open(self.path("s.json")) as f:
            self.assert_no_key(r.stdout, r.stderr, f.read())
        self.assertIn("[api key]", r.stdout)

    def test_a_url_with_a_query_string_is_refused_without_echoing_it(self):
        r = run_lab("--mode", "sweep", "--url", "http://127.0.0.1:8000/v1?api-key=" + KEY)
        self.assertEqual(r.code, 2, r)
        self.assertIn("without a query string or fragment", r.stderr)
        self.assert_no_key(r.stdout, r.stderr)


class MessagesSayWhatHappened(TempDirTest):
    def test_the_clients_own_open_file_limit_is_not_blamed_on_the_server(self):
        def few_files():
            resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))

        with StubServer() as stub:
            p = start_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,64", "--max-tokens", 2,
                          "--repeat", 1, "--traffic", "concurrent", preexec_fn=few_files)
            out, err = finish(p, 60)
        self.assertEqual(p.returncode, 3, err)
        self.assertIn("this machine ran out of open files", err)
        self.assertNotIn("dropped", err)

    def test_a_server_that_answers_like_both_engines_must_be_named(self):
        with StubServer(StubConfig(info_overrides={("model_path",): "m"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", 1)
        self.assertEqual(r.code, 2, r)
        self.assertIn("answers like vLLM and like SGLang at once", r.stderr)

    def test_a_save_through_a_symbolic_link_writes_its_target(self):
        target, link = self.path("target.json"), self.path("link.json")
        os.symlink(target, link)
        with StubServer() as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", 1, "--max-tokens", 2,
                        "--repeat", 1, "--save", link)
        self.assertEqual(r.code, 0, r)
        self.assertTrue(os.path.islink(link))
        self.assertEqual(self.load("target.json")["summary"]["state"], "complete")

    def test_nan_on_both_sides_is_no_run_to_run_control_not_a_failed_one(self):
        with StubServer(StubConfig(faults={1: "nanlogprobs", 3: "nanlogprobs"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                        "--repeat", 2, "--save", self.path("s.json"))
        self.assertIn("no run-to-run control (batch 1's logprobs hold NaN", r.stdout)
        self.assertNotEqual(self.load("s.json")["summary"]["verdict"], run.NOT_REPEATABLE)

    def test_a_run_stopped_in_its_first_pass_says_so(self):
        with StubServer(StubConfig(faults={2: "http500"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                        "--repeat", 3)
        self.assertEqual(r.code, 3, r)
        self.assertIn("no run-to-run control (stopped before a second pass)", r.stdout)

    def test_tpot_of_one_token_requests_says_why_it_is_unmeasured(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--concurrency", 1,
                        "--requests", 1, "--trials", 2, "--warmup", 0, "--max-tokens", 1)
        self.assertEqual(r.code, 0, r)
        self.assertIn("TPOT     unmeasured: time per output token needs at least two tokens", r.stdout)

    def test_a_prefill_nan_is_shown_with_its_note(self):
        with StubServer(StubConfig(faults={2: "nanlogprobs"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", 1, "--max-tokens", 4,
                        "--repeat", 1, "--prefill-check")
        self.assertRegex(r.stdout, r"prefill check: max ULP [0-9]+\*")
        self.assertIn("* %s" % run.ULP_NOTE_TEXT["non-finite"], r.stdout)

    def test_a_cell_without_a_known_tp_is_shown_where_it_was_measured(self):
        with StubServer(StubConfig(dev_mode=False)) as off, \
                StubServer(StubConfig(invariant=True, dev_mode=False)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 1,
                        "--trials", 2, "--warmup", 0, "--max-tokens", 2, "--allow-mismatch",
                        "--save", self.path("c.json"))
        self.assertEqual(r.code, 0, r)
        row = next(line for line in r.stdout.splitlines() if line.strip().startswith("TP=?"))
        self.assertNotIn("missing", row.split()[1])


if __name__ == "__main__":
    unittest.main()
