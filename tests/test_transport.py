# SPDX-License-Identifier: Apache-2.0
"""The transport: one deadline from connecting to the last byte of every answer (trickling,
cut and stuck servers, streams, concurrent requests), TLS, proxies and redirects said as
what they are. The hostile servers are loopback servers of this file; their waits are
liveness bounds far above what the lab needs, never timings."""

import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import unittest
from unittest import mock

from support import (ROOT, Result, StubConfig, StubServer, TempDirTest, finish, free_port, one_error_line, run, run_lab, start_lab, wait_for)


class Networks(TempDirTest):
    def test_a_server_trickling_bytes_meets_a_total_deadline(self):
        with StubServer(StubConfig(faults={2: "trickle"})) as stub:
            p = subprocess.Popen([sys.executable, os.path.join(ROOT, "run.py"), "--mode", "sweep", "--url",
                                  stub.url, "--sizes", "1,2", "--timeout", "1", "--repeat", "1", "--max-tokens",
                                  "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:  # a liveness bound: the trickled body alone takes 20 s
                out, err = p.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                raise
        one_error_line(self, Result(p.returncode, out, err), 3, "within 1s (--timeout)")

    def test_a_connection_closed_mid_body_is_dropped_not_invalid_json(self):
        with StubServer(StubConfig(faults={2: "truncate"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--repeat", 1, "--max-tokens", 2)
        one_error_line(self, r, 3, "dropped")


class ProxiesForThisMachine(TempDirTest):
    def test_the_machines_own_name_bypasses_a_dead_proxy(self):
        dead = "http://127.0.0.1:%d" % free_port()
        with StubServer() as stub, mock.patch.object(run.socket, "gethostname", lambda: "gpu-box-7"), \
                mock.patch.object(run.socket, "getaddrinfo", self.resolve_to_loopback(run.socket.getaddrinfo)):
            port = stub.url.rsplit(":", 1)[1]
            env = dict(os.environ, http_proxy=dead, HTTP_PROXY=dead, no_proxy="", NO_PROXY="")
            r = run_lab("--mode", "sweep", "--url", "http://gpu-box-7:%s" % port, "--sizes", "1,2", "--repeat", 1,
                        "--max-tokens", 2, env=env)
        self.assertEqual(r.code, 0, r)

    @staticmethod
    def resolve_to_loopback(real):
        def resolve(host, *args, **kwargs):
            return real("127.0.0.1" if host == "gpu-box-7" else host, *args, **kwargs)
        return resolve


class WholeAnswerDeadline(TempDirTest):
    """One deadline covers an answer from connecting to its last byte, and a stop signal
    abandons a stuck request."""

    def test_a_status_line_trickled_a_byte_at_a_time_is_cut_at_the_timeout(self):
        with StubServer(StubConfig(faults={2: "slowstatus"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                        "--repeat", 1, "--timeout", 1)
        self.assertEqual(r.code, 3, r)
        self.assertIn("no complete answer from %s within 1s (--timeout)" % stub.url, r.stderr)

    def test_sigterm_during_a_stuck_request_saves_and_ends(self):
        # The second request's status line would take 60 s to trickle in, under the default
        # --timeout of 600 s: only abandoning it ends the run (the wait below is a liveness bound).
        with StubServer(StubConfig(faults={2: "slowstatus"})) as stub:
            save = self.path("s.json")
            p = subprocess.Popen([sys.executable, os.path.join(ROOT, "run.py"), "--mode", "sweep", "--url",
                                  stub.url, "--sizes", "1,2", "--max-tokens", "4", "--repeat", "1",
                                  "--save", save], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self.assertTrue(wait_for(lambda: len(stub.generation_bodies()) >= 2, 30), "never sent batch 2")
            p.send_signal(signal.SIGTERM)
            out, err = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 143, err)
        self.assertEqual(self.load("s.json")["summary"]["state"], "terminated")
        self.assertIn("summary:", out)


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


if __name__ == "__main__":
    unittest.main()
