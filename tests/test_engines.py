"""The engine found by asking the server: named, detected, refused when two disagree."""

import threading
import json
import unittest
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from support import StubConfig, StubServer, TempDirTest, run_lab


class EngineFoundByItself(TempDirTest):
    def test_no_engine_named(self):
        for engine, label in (("sglang", "SGLang"), ("vllm", "vLLM")):
            with self.subTest(engine=engine):
                with StubServer(StubConfig(engine=engine)) as stub:
                    r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 4,
                                "--repeat", 1, "--save", self.path(engine + ".json"))
                self.assertEqual(r.code, 0, r)
                self.assertTrue(r.stdout.startswith("server: %s " % label), r.stdout[:80])
                self.assertIn("(found by asking the server)", r.stdout.splitlines()[0])
                doc = self.load(engine + ".json")
                self.assertEqual((doc["engine"], doc["engine_detected"]), (engine, True))

    def test_cost_finds_it_on_both_arms(self):
        with StubServer(StubConfig(engine="sglang")) as off, StubServer(StubConfig(engine="sglang", invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 1, "--trials", 1,
                        "--warmup", 0, "--max-tokens", 2, "--json")
        self.assertEqual(r.code, 0, r)
        self.assertEqual(r.json()["engine"], "sglang")

    def test_arms_of_two_engines_are_refused(self):
        with StubServer() as off, StubServer(StubConfig(engine="sglang", invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url)
        self.assertEqual(r.code, 2, r)
        self.assertIn("different engines", r.stderr)

    def test_the_wrong_engine_named_gets_a_hint(self):
        for server, named, hint in (("sglang", "vllm", "answers like SGLang: pass --engine sglang"),
                                    ("vllm", "sglang", "answers like vLLM: pass --engine vllm")):
            with self.subTest(server=server, named=named):
                with StubServer(StubConfig(engine=server)) as stub:
                    r = run_lab("--mode", "sweep", "--engine", named, "--url", stub.url, "--sizes", "1")
                    self.assertEqual(r.code, 3, r)
                    self.assertIn(hint, r.stderr)
                    self.assertEqual(len(r.stderr.strip().splitlines()), 1)
                    self.assertEqual(stub.generation_bodies(), [])

    def test_a_server_that_is_neither(self):
        class NotFound(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
        thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        try:
            r = run_lab("--mode", "sweep", "--url", "http://127.0.0.1:%d" % httpd.server_address[1], "--sizes", "1")
        finally:
            httpd.shutdown()
            httpd.server_close()
        self.assertEqual(r.code, 3, r)
        self.assertIn("cannot tell which engine answers", r.stderr)
        self.assertIn("name it with --engine", r.stderr)



class EverySamplingParameterSent(unittest.TestCase):
    """Both engines fill a sampling parameter left out from the model's generation_config:
    every generation request names each one, in the engine's own words, at the value that
    filters nothing."""

    def test_every_body_names_them(self):
        for engine in ("vllm", "sglang"):
            with self.subTest(engine=engine), StubServer(StubConfig(engine=engine)) as stub:
                r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--repeat", 1,
                            "--max-tokens", 2, "--temperature", "0.7", "--json")
                bodies = [json.loads(b) for b in stub.generation_bodies()]
            self.assertEqual(r.code, 0, r)
            self.assertTrue(bodies)
            for body in bodies:
                params = body if engine == "vllm" else body["sampling_params"]
                self.assertEqual((params["top_p"], params["top_k"], params["min_p"],
                                  params["repetition_penalty"]), (1.0, -1, 0.0, 1.0))
            saved = r.json()["params"]
            self.assertEqual((saved["top_k"], saved["min_p"], saved["repetition_penalty"]),
                             (-1, 0.0, 1.0))

    def test_load_trials_stream_them_too(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--concurrency",
                        2, "--requests", 2, "--trials", 1, "--warmup", 0, "--max-tokens", 2)
            bodies = [json.loads(b) for b in off.generation_bodies()]
        self.assertEqual(r.code, 0, r)
        self.assertTrue(all(b["top_k"] == -1 and b["repetition_penalty"] == 1.0 for b in bodies))


if __name__ == "__main__":
    unittest.main()
