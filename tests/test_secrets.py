# SPDX-License-Identifier: Apache-2.0
"""Secrets: the API key is never printed or saved, wherever a server echoes it; credentials in
a URL are refused without being repeated; saves are atomic."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

from support import (ROOT, StubConfig, StubServer, TempDirTest, free_port, one_error_line, run,
                     run_lab)
from test_launch import Experiment


KEY = "zq7-secretvalue-991"  # distinctive: no other text the lab prints holds its pieces


class Secrets(TempDirTest):
    def test_credentials_in_a_url_are_refused_and_never_printed(self):
        for url in ("http://alice:s3cret-pw@127.0.0.1:8000", "http://alice:s3cret-pw@127.0.0.1:80x/v1"):
            with self.subTest(url=url):
                r = run_lab("--mode", "sweep", "--url", url)
                one_error_line(self, r, 2, "password in the URL is not accepted")
                self.assertNotIn("s3cret", r.stderr + r.stdout)

    def test_a_key_the_server_echoes_is_redacted(self):
        with StubServer(StubConfig(faults={2: "echokey"})) as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--repeat", 1, "--max-tokens", 2,
                        "--api-key", "sk-very-secret-77", "--save", self.path("s.json"))
            with open(self.path("s.json")) as f:
                saved = f.read()
        one_error_line(self, r, 3, "HTTP 401")
        self.assertIn("[api key]", r.stderr)
        self.assertNotIn("sk-very-secret-77", r.stderr + r.stdout + saved)


# Keys that are also the lab's own words and numbers: none may rewrite what the lab saves
SHORT_KEYS = ("0", "1", "2", "true", "null", "EMPTY", "stub", "tin", "-k3y!")
VARYING = {"created", "ended", "seconds", "send_spread_s", "url", "lab"}


def steady(value):
    """A saved document without what differs from run to run by nature."""
    if isinstance(value, dict):
        return {k: steady(v) for k, v in value.items() if k not in VARYING}
    if isinstance(value, list):
        return [steady(v) for v in value]
    return value


def timeless(table):
    """A printed table without its seconds column, which differs from run to run."""
    return re.sub(r"\b\d+\.\d\d\b", "S", table)


class KeysKeptOutByStructure(TempDirTest):
    """The key is kept out of what the lab writes by where it stands (the command line's
    value), never by rewriting the lab's own values: a key that is also a number, a word of
    the schema, of the prompt or of the model's name changes nothing saved or printed."""

    def sweep(self, stub, name, *key):
        r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--repeat", 1,
                    "--max-tokens", 4, "--prompt", "an EMPTY box, true or null: 0 1 2",
                    "--save", self.path(name), *key)
        return r, self.load(name)

    def test_short_keys_change_nothing_the_lab_saves_or_prints(self):
        with StubServer(StubConfig(invariant=True)) as stub:
            plain, expected = self.sweep(stub, "plain.json")
            for key in SHORT_KEYS:
                with self.subTest(key=key):
                    given = "--api-key=" + key  # a key that starts with "-" needs the "=" form
                    if os.path.exists(self.path("k.json")):
                        os.remove(self.path("k.json"))
                    r, doc = self.sweep(stub, "k.json", given)
                    self.assertEqual(r.code, 0, r)
                    self.assertEqual(steady(doc), steady(expected))
                    self.assertEqual(doc["schema"], "batch-invariance-lab/sweep/2")
                    self.assertEqual(doc["lab"]["command"][-1], "--api-key=[api key]")
                    self.assertEqual(timeless(r.stdout), timeless(plain.stdout))
                    self.assertIn("fewer than 8 characters", r.stderr)
                    # it reads back as a baseline, and compare.py reads it
                    back = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2",
                                   "--repeat", 1, "--max-tokens", 4, "--prompt",
                                   "an EMPTY box, true or null: 0 1 2", "--baseline",
                                   self.path("k.json"), given)
                    self.assertEqual(back.code, 0, back)

    def test_short_keys_change_nothing_a_cost_file_holds(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            for key in ("1", "true", "0"):
                with self.subTest(key=key):
                    r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url,
                                "--batch", 1, "--trials", 1, "--warmup", 0, "--max-tokens", 2,
                                "--api-key", key, "--save", self.path(key + ".json"))
                    self.assertEqual(r.code, 0, r)
                    doc = self.load(key + ".json")
                    self.assertEqual(doc["schema"], "batch-invariance-lab/cost/1")
                    self.assertNotIn("[api key]", json.dumps(doc["cells"][0]["off"]))
                    self.assertNotIn("[api key]", r.stdout)

    def test_every_spelling_of_the_key_option_is_recorded_without_the_key(self):
        options = list(run.build_parser()._option_string_actions)
        for argv in (["--api-key", KEY], ["--api-key=" + KEY], ["--api", KEY], ["--api=" + KEY],
                     ["--api-k", KEY]):
            with self.subTest(argv=argv):
                recorded = run.key_free_command(["--mode", "sweep"] + argv, options)
                self.assertNotIn(KEY, " ".join(recorded))
                self.assertIn("[api key]", " ".join(recorded))
        # past "--" nothing is an option
        self.assertEqual(run.key_free_command(["--", "--api-key", "x"], options),
                         ["--", "--api-key", "x"])

    def test_an_abbreviated_key_option_is_neither_printed_nor_saved(self):
        with StubServer() as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--repeat", 1,
                        "--max-tokens", 2, "--api", KEY, "--save", self.path("s.json"))
            with open(self.path("s.json")) as f:
                saved = f.read()
        self.assertEqual(r.code, 0, r)
        self.assertNotIn(KEY, r.stdout + r.stderr + saved)

    def test_an_echo_with_non_word_edges_is_hidden_when_the_key_is_long(self):
        key = "-k3y!-long-enough"
        secrets = run.Secrets()
        secrets.keep(key)
        self.assertEqual(secrets.hide("bad key %s." % key), "bad key [api key].")


class KeysHiddenInWhatServersSay(TempDirTest):
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

    def test_a_key_of_thousands_of_characters_is_hidden_whole_and_cut_short(self):
        # Bearer tokens (JWTs) run to a few thousand characters; such a key once failed every
        # run before its first request (a pattern nested a group a character).
        key = "eyJ" + "aB3-" * 1000
        secrets = run.Secrets()
        secrets.keep(key)
        echoed = "a %s b %s c %sQ" % (key.upper(), key[:40], key[:600].lower())
        self.assertEqual(secrets.hide(echoed), "a [api key] b [api key] c [api key]Q")
        with StubServer() as stub:
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1,2", "--max-tokens", 2,
                        "--repeat", 1, "--api-key", key)
        self.assertEqual(r.code, 0, r)

    def test_a_url_with_a_query_string_is_refused_without_echoing_it(self):
        r = run_lab("--mode", "sweep", "--url", "http://127.0.0.1:8000/v1?api-key=" + KEY)
        self.assertEqual(r.code, 2, r)
        self.assertIn("without a query string or fragment", r.stderr)
        self.assert_no_key(r.stdout, r.stderr)


class FilesAndSecurity(TempDirTest):
    def test_atomic_write_leaves_the_old_file_whole_on_failure(self):
        target = self.path("s.json")
        run.write_json_atomic(target, {"schema": run.SWEEP_SCHEMA, "n": 1})
        with mock.patch.object(run.os, "replace", side_effect=OSError(28, "No space left on device")):
            with self.assertRaises(run.SaveError):
                run.write_json_atomic(target, {"schema": run.SWEEP_SCHEMA, "n": 2})
        self.assertEqual(self.load("s.json")["n"], 1)
        self.assertEqual(os.listdir(self.tmp), ["s.json"])

    def test_a_redirect_to_another_server_is_refused_and_names_it(self):
        with StubServer() as target, StubServer(StubConfig(redirect_get_to=None)) as front:
            front.config.redirect_get_to = target.url
            r = run_lab("--mode", "sweep", "--url", front.url, "--sizes", "1", "--max-tokens", 4,
                        "--api-key", "key-abc")
            self.assertEqual(r.code, 3, r)
            self.assertIn("redirecting to %s" % target.url, r.stderr)
            self.assertIn("follows no redirect away from the server it was given", r.stderr)
            self.assertEqual(target.requests, [])  # the key never went there, nor anything else
            self.assertTrue(all(h.get("Authorization") == "Bearer key-abc" for _, _, h in front.requests))

    def test_key_never_printed_or_saved_in_cost(self):
        with StubServer() as off, StubServer(StubConfig(invariant=True)) as on:
            r = run_lab("--mode", "cost", "--url", off.url, "--invariant", on.url, "--batch", 1,
                        "--trials", 1, "--warmup", 0, "--max-tokens", 2, "--save", self.path("c.json"),
                        env=dict(os.environ, OPENAI_API_KEY="sekret-cost-key"))
        self.assertEqual(r.code, 0, r)
        with open(self.path("c.json")) as f:
            self.assertNotIn("sekret", f.read())
        self.assertNotIn("sekret", r.stdout + r.stderr)

    def test_loopback_bypasses_the_proxy_and_other_hosts_use_it(self):
        dead_proxy = "http://127.0.0.1:%d" % free_port()
        with StubServer() as stub:
            env = dict(os.environ, http_proxy=dead_proxy, HTTP_PROXY=dead_proxy, no_proxy="", NO_PROXY="")
            r = run_lab("--mode", "sweep", "--url", stub.url, "--sizes", "1", "--max-tokens", 2, env=env)
            self.assertEqual(r.code, 0, r)
            # the stub as the proxy: a far host's requests arrive there with absolute URLs
            env = dict(os.environ, http_proxy=stub.url, HTTP_PROXY=stub.url, no_proxy="", NO_PROXY="")
            r = run_lab("--mode", "sweep", "--url", "http://gpu-box.example:8000", "--sizes", "1",
                        "--max-tokens", 2, env=env)
            self.assertEqual(r.code, 0, r)
            self.assertTrue(any(p.startswith("http://gpu-box.example:8000/") for _, p, _ in stub.requests))


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


if __name__ == "__main__":
    unittest.main()


class KeysKeptOutOfTheExperiment(Experiment):
    """examples/experiment.sh holds the key the arms and the lab use (OPENAI_API_KEY,
    VLLM_API_KEY, an --api-key in a serve command): it is in no line said and no file the run
    writes, the engines' logs included, which the experiment writes itself as they come."""

    def files_holding(self, key):
        """The run's files whose bytes hold the key."""
        found = []
        for folder, _, names in os.walk(self.path("out")):
            for name in names:
                with open(os.path.join(folder, name), "rb") as f:
                    if key.encode() in f.read():
                        found.append(os.path.join(folder, name))
        return found

    def test_an_engine_that_logs_its_arguments_keeps_no_key_in_its_log(self):
        """SGLang 0.5.23 logs server_args, 'api_key' among them: the stand-in does too. The
        key is short (below what run.py looks for anywhere): it is found where it stands."""
        self.engine = "sglang"
        key = "k3y9q"
        code, out, err = self.finish(self.start(EXTRA_ARGS="--api-key " + key,
                                                OPENAI_API_KEY=key))
        self.assertEqual(code, 0, err)
        log = self.load_run("tp1", "server_off.log")
        self.assertIn("'api_key': '[api key]'", log)  # the line is kept, its key is not
        self.assertEqual(self.files_holding(key), [])
        self.assertNotIn(key, out + err)

    def key_forms(self, key):
        """Every form a key takes in what an engine or a shell writes: as given, quoted for
        the shell (Python's shlex and bash's printf %q, as the launch scripts log a command),
        as Python writes it (both quote styles: SGLang's logged server_args) and as JSON
        writes it, each with and without its quotes."""
        def literal(quote):
            return quote + "".join("\\" + c if c == quote else repr(c)[1:-1]
                                   for c in key) + quote
        printf = subprocess.run(["bash", "-c", 'printf %q "$1"', "-", key],
                                capture_output=True, text=True, check=True).stdout
        forms = {key, shlex.quote(key), printf, repr(key), literal("'"), literal('"'),
                 json.dumps(key)}
        return sorted(forms | {f[1:-1] for f in forms if f[:1] in "'\"" and f[-1:] == f[:1]})

    def test_every_form_of_a_key_with_quotes_and_backslashes_is_kept_out(self):
        """SGLang 0.5.23 logs its arguments as Python writes them (server_args={...
        'api_key': "q'uo\\\\te" ...}), and a launch line quotes them for the shell
        (--api-key q\\'uo\\\\te): the key is kept out in every form it takes, a short key
        with a quote (given to both arms in EXTRA_ARGS, as the launch scripts pass it) and a
        long one with a double quote and a space (in serve commands of one's own)."""
        self.engine = "sglang"
        launch = ("python3 -m sglang.launch_server --model-path stub/tiny-f32 --port {port} "
                  "--api-key %s")
        short, long = "q'uo\\te", 's3"cr t\\k-19'
        serve = {"SERVE_OFF": launch.format(port="{off}") % shlex.quote(long),
                 "SERVE_ON": launch.format(port="{on}") % shlex.quote(long)
                 + " --enable-deterministic-inference"}
        for key, variables in (
                (short, {"EXTRA_ARGS": "--api-key " + short, "OPENAI_API_KEY": short}),
                # known from EXTRA_ARGS alone, as the launch scripts pass it (not shell words)
                (short, {"EXTRA_ARGS": "--api-key " + short}),
                (long, dict(serve, OPENAI_API_KEY=long))):
            with self.subTest(key=key, given=sorted(variables)):
                code, out, err = self.finish(self.start(**variables))
                self.assertEqual(code, 0, err)
                logs = self.load_run("tp1", "server_off.log") + self.load_run(
                    "tp1", "server_on.log")
                self.assertEqual(logs.count("'api_key': "), 2, logs)  # each line is kept
                quote = repr(key)[0]  # the quotes Python writes it with stay
                self.assertIn("'api_key': %s[api key]%s" % (quote, quote), logs)
                for form in self.key_forms(key):
                    self.assertEqual(self.files_holding(form), [], form)
                    self.assertNotIn(form, out + err)
                shutil.rmtree(self.path("out"))

    def test_a_key_set_for_the_engine_in_a_serve_command_is_not_printed(self):
        """vLLM's documented variable, set in a serve command of one's own, the same key in
        OPENAI_API_KEY: the report's launch lines show it as [api key]."""
        key = "vk-2026-secret-key-for-both-arms"
        stub = "env VLLM_API_KEY=%s python3 %s --port {port}" % (
            key, os.path.join(ROOT, "tests", "stub_server.py"))
        code, out, err = self.finish(self.start(
            OPENAI_API_KEY=key, VLLM_API_KEY=key, SERVE_OFF=stub.format(port="{off}"),
            SERVE_ON=stub.format(port="{on}") + " --invariant --prefill-agrees",
            COST_ARGS="--batch 2 --trials 6 --warmup 0 --max-tokens 4 --allow-mismatch"))
        self.assertEqual(code, 0, err)
        self.assertIn("VLLM_API_KEY=[api key]", self.load_run("REPORT.md"))
        self.assertEqual(self.files_holding(key), [])
        self.assertNotIn(key, out + err)

    def test_the_lab_sends_the_key_the_arms_were_started_with(self):
        sys.path.insert(0, os.path.join(ROOT, "examples"))
        import experiment
        step = experiment.step_environment({"VLLM_API_KEY": "k1", "PATH": "/bin"})
        self.assertEqual(step["OPENAI_API_KEY"], "k1")
        step = experiment.step_environment({"VLLM_API_KEY": "k1", "OPENAI_API_KEY": "k2"})
        self.assertEqual(step["OPENAI_API_KEY"], "k2")  # the one given for the lab wins
        self.assertNotIn("OPENAI_API_KEY", experiment.step_environment({}))

    def test_keys_are_hidden_where_they_stand_in_what_an_engine_writes(self):
        sys.path.insert(0, os.path.join(ROOT, "examples"))
        import experiment
        keys = experiment.Keys({"OPENAI_API_KEY": "2",
                                "SERVE_ON": "env VLLM_API_KEY=abc vllm serve m --api-key zz9"})
        self.assertEqual(
            keys.engine_text("[2026-12-02 10:22:12] server_args={'model_path': '/m/2', "
                             "'api_key': '2', 'port': 30002, 'note': 'zz9'}"),
            "[2026-12-02 10:22:12] server_args={'model_path': '/m/2', "
            "'api_key': '[api key]', 'port': 30002, 'note': 'zz9'}")
        self.assertEqual(
            keys.engine_text("VLLM_API_KEY=abc --api-key zz9 --api-key=2 Bearer 2 abcd 22"),
            "VLLM_API_KEY=[api key] --api-key [api key] --api-key=[api key] Bearer [api key] "
            "abcd 22")
        self.assertEqual(keys.line("env VLLM_API_KEY=abc vllm serve m --api-key zz9", True),
                         "env 'VLLM_API_KEY=[api key]' vllm serve m --api-key '[api key]'")

    def test_a_key_is_hidden_where_an_abbreviated_option_or_a_tuple_holds_it(self):
        # an engine that logs its arguments as given (--api-k, argparse's abbreviation) or
        # its settings as a tuple; and a long key URL-encoded, wherever it stands
        sys.path.insert(0, os.path.join(ROOT, "examples"))
        import experiment
        keys = experiment.Keys({"OPENAI_API_KEY": "k3y9",
                                "SERVE_ON": "vllm serve m --api-k 'k D4'"})
        self.assertEqual(keys.engine_text("argv: serve m --api-k k D4 --port 1"),
                         "argv: serve m --api-k [api key] --port 1")
        self.assertEqual(keys.engine_text("settings: api_key=('k3y9',)"),
                         "settings: api_key=('[api key]',)")
        long = experiment.Keys({"OPENAI_API_KEY": "Ab/c+d=EFGH12345xyz"})
        self.assertEqual(long.engine_text("GET /v1/x?key=Ab%2Fc%2Bd%3DEFGH12345xyz done"),
                         "GET /v1/x?key=[api key] done")


# `vllm serve`, as an engine that logs the arguments it parsed: vLLM's own parser rules (an
# underscore in an option's name is a dash, --api-key takes several keys), its keys logged as
# vLLM logged its non-default args, then the practice engine
LOGGING_VLLM = r'''#!/usr/bin/env python3
import argparse, os, sys
argv = ["--" + a[2:].split("=", 1)[0].replace("_", "-") + a[2:][len(a[2:].split("=", 1)[0]):]
        if a.startswith("--") else a for a in sys.argv[2:]]
p = argparse.ArgumentParser(prog="vllm")
p.add_argument("model")
p.add_argument("--port", type=int, default=8000)
p.add_argument("--api-key", nargs="+")
args, _ = p.parse_known_args(argv)
key = os.environ.get("VLLM_API_KEY")
print("INFO non-default args: %%r" %% {"model": args.model, "port": args.port,
      "api_key": args.api_key or ([key] if key else None)}, file=sys.stderr, flush=True)
on = os.environ.get("VLLM_BATCH_INVARIANT") == "1"
os.execv(sys.executable, [sys.executable, %r, "--port", str(args.port),
         "--prompt-tokens-details"] + (["--invariant", "--prefill-agrees"] if on else []))
''' % os.path.join(ROOT, "tests", "stub_server.py")


class KeysInEngineCommands(Experiment):
    """Keys as an engine's command gives them: several after one --api-key, --api_key, in
    the string a shell runs; and a short key a server repeats after "Bearer "."""

    files_holding = KeysKeptOutOfTheExperiment.files_holding

    def logging_vllm(self):
        """PATH with a `vllm` that logs its keys first."""
        folder = self.path("bin")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "vllm"), "w") as f:
            f.write(LOGGING_VLLM)
        os.chmod(os.path.join(folder, "vllm"), 0o755)
        return folder + os.pathsep + os.environ["PATH"]

    def assert_kept_out(self, out, err, *keys):
        for key in keys:
            self.assertEqual(self.files_holding(key), [], key)
            self.assertNotIn(key, out + err)

    def test_every_key_of_several_after_one_option_is_kept_out(self):
        """vLLM's --api-key takes several keys (api_key is list[str],
        vllm/entrypoints/common/cli_args.py, 0.34.0 line 336): the second one, short, is a
        key too, in the report, the launch lines and the engine's logged arguments."""
        code, out, err = self.finish(self.start(
            PATH=self.logging_vllm(), EXTRA_ARGS="--api-key Zq9xFIRST k2q"))
        self.assertEqual(code, 0, err)
        report = self.load_run("REPORT.md")
        self.assertIn("EXTRA_ARGS=--api-key '[api key]' '[api key]',", report)
        self.assertEqual(report.count("--api-key '[api key]' '[api key]'\n"), 2, report)
        log = self.load_run("tp1", "server_on.log")
        self.assertIn("'api_key': ['[api key]', '[api key]']", log)
        self.assert_kept_out(out, err, "Zq9xFIRST", "k2q")

    def test_a_key_option_with_an_underscore_is_kept_out(self):
        """vLLM reads --api_key as --api-key (FlexibleArgumentParser, vllm/utils/
        argparse_utils.py, 0.34.0 lines 378-391)."""
        code, out, err = self.finish(self.start(
            PATH=self.logging_vllm(), EXTRA_ARGS="--api_key Zq9xUNDERSCORE"))
        self.assertEqual(code, 0, err)
        self.assertIn("EXTRA_ARGS=--api_key '[api key]',", self.load_run("REPORT.md"))
        self.assertIn("'api_key': ['[api key]']", self.load_run("tp1", "server_on.log"))
        self.assert_kept_out(out, err, "Zq9xUNDERSCORE")

    def test_keys_and_the_port_in_the_string_a_shell_runs(self):
        """sh -c '... --api-key K', bash -c 'VLLM_API_KEY=K exec ...': the keys are kept out,
        the rest of each command is shown, and the arm's --port in it is where the lab asks
        (no ON_PORT, no ON_URL)."""
        stub = os.path.join(ROOT, "tests", "stub_server.py")
        code, out, err = self.finish(self.start(
            PATH=self.logging_vllm(), OFF_URL="", ON_URL="",
            SERVE_OFF="bash -c 'VLLM_API_KEY=zk5 exec python3 %s --port {off}'" % stub,
            SERVE_ON="sh -c 'VLLM_BATCH_INVARIANT=1 exec vllm serve m --port {on} "
                     "--api-key Zq9xSHKEY2'",
            OFF_PORT="{off}", COST_ARGS="--batch 2 --trials 6 --warmup 0 --max-tokens 4 "
                                        "--allow-mismatch"))
        self.assertEqual(code, 0, err)
        report = self.load_run("REPORT.md")
        self.assertIn("bash -c 'VLLM_API_KEY=\"[api key]\" exec python3 %s --port %d'"
                      % (stub, self.ports[0]), report)
        self.assertIn("sh -c 'VLLM_BATCH_INVARIANT=1 exec vllm serve m --port %d --api-key "
                      "\"[api key]\"'" % self.ports[1], report)
        self.assertIn("--url http://localhost:%d" % self.ports[1], report)
        self.assertIn("'api_key': ['[api key]']", self.load_run("tp1", "server_on.log"))
        self.assert_kept_out(out, err, "Zq9xSHKEY2", "zk5")

    def test_a_shell_string_that_is_not_shell_words_is_refused_before_anything_starts(self):
        code, out, err = self.finish(self.start(
            SERVE_ON="sh -c 'exec vllm serve m --api-key \"Zq9xUNCLOSED'"))
        self.assertEqual(code, 2, err)
        self.assertIn("SERVE_ON: the string its shell runs (-c) is not shell words", err)
        self.assertEqual(self.runs(), [])
        self.assertNotIn("Zq9xUNCLOSED", out + err)

    def test_a_short_key_a_server_repeats_after_bearer_is_kept_out(self):
        """A short key (under run.py's length for searching server text) that a server echoes
        in an error (HTTP 401 ... invalid key Bearer K) is hidden where it stands: in the
        step's files, the report's first line and Steps table, and what is said."""
        stub = "python3 %s --port {on} --invariant --prefill-agrees --fault 3=echokey" % (
            os.path.join(ROOT, "tests", "stub_server.py"))
        code, out, err = self.finish(self.start(OPENAI_API_KEY="shk9x7", SERVE_ON=stub))
        self.assertNotEqual(code, 0, err)
        self.assertIn("Bearer [api key]", self.load_run("REPORT.md"))
        self.assert_kept_out(out, err, "shk9x7")

    def test_a_key_no_request_could_carry_is_refused_before_any_arm_starts(self):
        for name in ("VLLM_API_KEY", "OPENAI_API_KEY"):
            with self.subTest(name=name):
                key = "Zq9x\u00e9\u20ac\u00fcn\u00ef"
                code, out, err = self.finish(self.start(**{name: key}))
                self.assertEqual(code, 2, err)
                self.assertEqual(len(err.strip().splitlines()), 1, err)
                self.assertIn("%s: the API key" % name, err)
                self.assertIn("nothing was started", err)
                self.assertEqual(self.runs(), [])
                self.assertNotIn("Zq9x", out + err)

    def test_several_keys_given_to_the_lab_are_not_printed_in_its_refusal(self):
        code, out, err = self.finish(self.start(SWEEP_ARGS="--api-key Zq9xONE Zq9xTWO"))
        self.assertEqual(code, 2, err)
        self.assertIn("unrecognized arguments: [api key]", err)
        self.assertNotIn("Zq9x", out + err)
        r = run_lab("--mode", "sweep", "--api-key", "Zq9xONE", "Zq9xTWO", "--sizes", "1")
        one_error_line(self, r, 2, "unrecognized arguments: [api key]")
        self.assertNotIn("Zq9x", r.stdout + r.stderr)

    def test_a_launch_line_bash_quotes_in_octal_is_kept_out(self):
        """Under LC_ALL=C bash's printf %q writes a key beyond ASCII as $'Zq9x\\303\\251...'."""
        key = "Zq9x\u00e9\u00a0\u03a9tail"
        octal = subprocess.run(["bash", "-c", 'printf %q "$1"', "-", key], capture_output=True,
                               env=dict(os.environ, LC_ALL="C"), check=True).stdout.decode()
        self.assertTrue(octal.startswith("$'Zq9x\\303\\251"), octal)
        code, out, err = self.finish(self.start(LC_ALL="C", EXTRA_ARGS="--api-key " + key))
        self.assertEqual(code, 0, err)
        for form in (key, octal, octal[2:-1]):
            self.assert_kept_out(out, err, form)
        sys.path.insert(0, os.path.join(ROOT, "examples"))
        import experiment
        keys = experiment.Keys({"EXTRA_ARGS": "--api-key " + key})
        self.assertEqual(keys.engine_text("the key %s was refused" % octal),
                         "the key $'[api key]' was refused")


class KeysInCommandsByStructure(unittest.TestCase):
    """How a command's keys are found, where they stand, without running anything."""

    def setUp(self):
        sys.path.insert(0, os.path.join(ROOT, "examples"))
        import experiment
        self.experiment = experiment

    def test_an_engine_command_is_read_as_vllm_reads_its_key_option(self):
        shown = run.key_free_command(
            ["vllm", "serve", "m", "--api-key", "K1", "K2", "--port", "1", "--api_key", "K3",
             "--api_key=K4"], [], engine=True)
        self.assertEqual(shown, ["vllm", "serve", "m", "--api-key", "[api key]", "[api key]",
                                 "--port", "1", "--api_key", "[api key]",
                                 "--api_key=[api key]"])
        # run.py's own --api-key takes one key: its next word is its own
        self.assertEqual(run.key_free_command(["--api-key", "K1", "K2"], []),
                         ["--api-key", "[api key]", "K2"])

    def test_the_port_in_the_string_a_shell_runs_is_followed(self):
        e = self.experiment
        settings = e.read_settings(["vllm", "/tmp/x"], {
            "SERVE_ON": "sh -c 'VLLM_BATCH_INVARIANT=1 exec vllm serve m --port 18601'",
            "SERVE_OFF": "env X=1 bash -ec \"exec vllm serve m --port=18600\""})
        self.assertEqual(settings.urls, {"off": "http://localhost:18600",
                                         "on": "http://localhost:18601"})
        # a port the shell expands: known from ON_PORT, else refused with one line
        shell = {"SERVE_ON": "sh -c 'exec vllm serve m --port $P'"}
        settings = e.read_settings(["vllm", "/tmp/x"], dict(shell, ON_PORT="18602"))
        self.assertEqual(settings.urls["on"], "http://localhost:18602")
        with self.assertRaisesRegex(e.UsageError, "SERVE_ON: its --port is the shell's to "
                                                  "expand: give the port in ON_PORT too"):
            e.read_settings(["vllm", "/tmp/x"], shell)

    def test_the_rest_of_a_shell_string_is_shown(self):
        keys = self.experiment.Keys({})
        self.assertEqual(
            keys.line("bash -c 'VLLM_API_KEY=K exec python3 s.py --port 5'", launch=True),
            "bash -c 'VLLM_API_KEY=\"[api key]\" exec python3 s.py --port 5'")

    def test_a_failure_line_quoting_a_short_key_after_bearer_hides_it(self):
        e = self.experiment
        folder = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, folder)
        err = os.path.join(folder, "s.err")
        with open(err, "w") as f:
            f.write("run.py: HTTP 401 from /v1/completions: invalid key Bearer shk9x7\n")
        saved = e.KEYS
        e.KEYS = e.Keys({"OPENAI_API_KEY": "shk9x7"})
        try:
            reason = e.failure_reason(os.devnull, err)
        finally:
            e.KEYS = saved
        self.assertEqual(reason, "run.py: HTTP 401 from /v1/completions: invalid key Bearer "
                                 "[api key]")
        secrets = run.Secrets()
        secrets.keep("shk9x7")
        self.assertEqual(secrets.hide("invalid key bearer SHK9X7, Bearer shk9x7x"),
                         "invalid key bearer [api key], Bearer shk9x7x")
