#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The whole experiment for one engine, in one command: start both arms, sweep the flag-off
arm (expecting a difference) and the flag-on arm (expecting none), check decode against
prefill, time the flag on a cold and a shared-prefix workload at every TP degree asked for,
draw the pictures, and write REPORT.md. Started through experiment.sh:

    GPUS=0 TP=1 examples/experiment.sh vllm results/          # one GPU
    GPUS=0,1,2,3 TP=1,2 examples/experiment.sh sglang results/  # the 2x2 cost table

Each run writes into a folder of its own, OUTPUT/YYYYmmdd-HHMMSS/: REPORT.md (also printed at
the end), cost.json/.txt (every cell of every TP degree), and per degree tpN/ with both
servers' logs, the sweeps (.json and .txt) and sweep.png; cost.png with matplotlib.

How it runs the arms, and why:
  - Arms that share a device start one after the other, the second once the first answers
    its health check: on one real H200 a vLLM arm whose memory profiling ran while the other
    was still loading counted that memory as its own and exited. Arms on separate devices
    start together. placement.sh decides which devices each arm gets.
  - Each arm is swept as soon as it is ready: on one device the flag-off arm while the
    flag-on arm loads, on their own devices both at once (a sweep compares answers, not
    times). The cost cells run once both arms are ready and every sweep is done, alone.
  - Each arm's port must be free before anything starts: the lab must measure its own
    servers, not a leftover one.
  - Both arms are watched from launch to the end. An arm that exits stops every step at once,
    with one line naming it, its exit status and the end of its log.
  - Each step says when it starts (step k of n, its TP degree, what it measures), where a
    long one stands every 15 s, and when it ends; REPORT.md says when each arm started and
    was ready, and when each step started and how long it took.
  - TERM, INT and HUP stop the running steps (the lab saves what it measured, marked with the
    signal's state) and both arms within seconds; the exit code is the signal's.
  - Between TP degrees both arms are restarted. A degree that GPUS cannot hold is skipped with
    one line; the others still run.

The sweeps, per TP degree: each arm with concurrent requests, a cache key each, so that no
request is served from another's prefix cache (vLLM's copies of one request share it whatever
the key: a copies sweep's divergence is not batching alone), with the prefill check; then
each arm with copies in one request, the upstream tests' shape, kept as its own labelled
sweep. Flag off expects a difference, flag on none. On vLLM an arm's copies sweep runs only
where its copies compare cold prefills: the prompt, as the arm counts it, shorter than one of
the arm's cache blocks (block_size of vllm:cache_config_info in its /metrics); where it is not,
the sweep is left out with a line in REPORT.md saying why; where the arm says no block size,
it runs, and a flag-on copies sweep that compared nothing (the cache served its copies) is
named in REPORT.md but leaves the verdict to the concurrent sweeps where they compared.

Variables (all optional), with their defaults:
  GPUS=0                the devices, a comma list; placement.sh gives each arm its own where
                        there are enough, else both share them (MEM: each arm's memory share,
                        0.45 when they share)
  TP=1                  the TP degrees, a comma list (TP=1,2: the 2x2 cost table)
  MODEL, BACKEND, MAX_MODEL_LEN, RADIX_CACHE
                        the launch scripts' settings (their defaults: vllm_serve.sh and
                        sglang_serve.sh; MAX_MODEL_LEN: the model's own)
  EXTRA_ARGS=           more engine flags, the same for both arms
  SERVE_OFF, SERVE_ON   the commands that start each arm (default: this folder's launch
                        script for the engine, with PORT set); the practice engine, for a
                        dry run: SERVE_OFF="python3 tests/stub_server.py --port 8000"
                        SERVE_ON="python3 tests/stub_server.py --port 8001 --invariant
                        --prefill-agrees" (its decode and prefill agree, as a real flag-on arm's)
  OFF_PORT, ON_PORT     the arms' ports: the launch scripts listen there, the lab asks there
                        (default: a --port in SERVE_OFF/SERVE_ON, in a sh -c string too,
                        else 8000 and 8001 for vllm, 30000 and 30001 for sglang)
  OFF_URL, ON_URL       where the arms answer, for arms behind another address (default
                        http://localhost:PORT; their port is the launch scripts' too)
  WAIT=900              seconds an arm may take to answer its health check
  COPIES=on             also sweep each arm with copies in one request, the upstream tests'
                        shape; off: the concurrent sweeps only
  OVERLAP=on            sweep an arm while the other still loads; off: no sweep before both
                        arms are ready (an engine whose start-up cannot share its device)
  SWEEP_ARGS=, COST_ARGS=
                        extra run.py options for every sweep and for each cost cell
  BASELINE=             an earlier run's folder (OUTPUT/YYYYmmdd-HHMMSS, another machine's,
                        engine's or release's): each flag-on sweep is run again against the
                        matching one there (tpN/sweep_on.json, tpN/copies_on.json) as its
                        --baseline, and REPORT.md says what that comparison found

Every variable is checked before any arm starts: each step's options by run.py's own
configuration, the options the experiment sets itself refused in any spelling, COST_ARGS
whose --trials are fewer than run.py's overhead needs for an interval (6), URLs as run.py
checks them (and neither https:// nor a path after the port such as /v1: the arms serve
plain HTTP, their /health at the root), one address in two spellings, ports against the serve
commands, GPUS as CUDA reads it.

Exit codes: 0 every step ran, every --expect held, the flag-on arm moved in no shape and no
check, and every flag-on sweep and check compared something (as the saved results say);
otherwise the first failing step's code (run.py's: 1 an --expect did not hold, 3 a server
failed, ...), or 1 where every step ran but a saved result breaks the claim (the flag-on arm
moved, a step saved no whole result); 2 a malformed variable or a busy port (nothing was
started); 4 an arm exited, could not be started, or was not ready within WAIT; 5 every step
ran, but a TP degree was skipped (GPUS could not hold it); 6 every step ran and nothing
moved, but a flag-on sweep or check compared nothing (the cache served every request above
batch 1 of a concurrent sweep, or of a copies sweep where the concurrent one compared nothing
too; the server could not serve the check; the servers report another TP than asked;
an --expect that failed only there included): the claim is not shown; 74 the output folder
could not take what the run wrote (a full disk, or a folder that may not be written: a step's
results or REPORT.md; no server failed, and the report is printed all the same); 129, 130,
143 stopped by SIGHUP, SIGINT or SIGTERM (one that comes while the arms stop after the last
step leaves a whole run whole: every step had ended).

REPORT.md's first line says which: "complete" (exit 0); INCOMPLETE (a step failed or did not
finish, an arm exited, a degree was skipped, a signal); NOT AS EXPECTED (every step ran to
its end, and an --expect did not hold or the flag-on arm moved); INCONCLUSIVE (every step
ran and nothing moved, but a flag-on result compared nothing: each named by its step and
check).
"""

import dataclasses
import errno
import http.client
import ipaddress
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import run as lab  # noqa: E402  (the lab's exit codes, their meanings and its saved schemas)

# ----------------------------------------------------------------------------
# Constants

ENGINE_PORTS = {"vllm": (8000, 8001), "sglang": (30000, 30001)}  # the launch scripts' ports
DEFAULT_WAIT_S = 900.0  # an arm's time to become healthy (a real vLLM took 60-130 s)
HEALTH_TIMEOUT_S = 2.0  # one health check; an engine still loading may hold the connection
POLL_S = 0.2  # how often the arms and the running step are looked at
STEP_GRACE_S = 2.0  # a first TERM stops the lab after its request, a second one at once
STOP_GRACE_S = 10.0  # an arm's process group gets this long after TERM, then KILL
LOG_DRAIN_S = 2.0  # how long an exited arm's last output may take to reach its log
LOG_TAIL_LINES = 5  # lines of a dead arm's log quoted in its one-line message
PROGRESS_EVERY_S = 15.0  # a running step's newest progress line is said at most this often

EXIT_ARM = 4  # an arm exited, could not be started, or was not ready within WAIT
EXIT_SKIPPED = 5  # every step ran, but a TP degree was skipped: the report is not whole
EXIT_UNCOMPARED = 6  # every step ran, none moved, but a flag-on result compared nothing
# the run's own folder could not take what was written there (run.py's EX_IOERR, whose
# stdout and stderr are files in that folder here): the disk, never a server
EXIT_DISK = lab.EXIT_OUTPUT
SIGNAL_EXITS = {
    signal.SIGINT: lab.EXIT_INTERRUPTED,
    signal.SIGTERM: lab.EXIT_TERMINATED,
    signal.SIGHUP: lab.EXIT_HANGUP,
}  # what each stop signal exits with, as run.py
EXIT_MEANINGS = dict(lab.EXIT_CODES)  # exit code -> what it means, the lab's and the experiment's
EXIT_MEANINGS[EXIT_ARM] = "an arm exited, could not be started, or was not ready in time"
EXIT_MEANINGS[EXIT_SKIPPED] = "a TP degree was skipped"
EXIT_MEANINGS[EXIT_UNCOMPARED] = "every step ran, but a flag-on result compared nothing"
EXIT_MEANINGS[EXIT_DISK] = ("the output folder could not take what the run wrote (a full disk, "
                            "or a folder that may not be written): no server failed")
for _signum, _code in SIGNAL_EXITS.items():  # the experiment's own words: each step saved
    EXIT_MEANINGS[_code] = "stopped by %s; each step saved what it had measured" % (
        "Ctrl-C (SIGINT)" if _signum == signal.SIGINT else _signum.name)
# The sweeps of one degree: (file stem, arm, --traffic, --expect, what the report calls it).
# Concurrent requests carry a cache key each, so the bypass holds on vLLM too; copies in one
# request are the upstream tests' shape, whose cache hits the lab reports where they happen.
SWEEPS = [
    ("sweep_off", "off", "concurrent", "variant", "concurrent requests"),
    ("sweep_on", "on", "concurrent", "invariant", "concurrent requests"),
    ("copies_off", "off", "copies", None, "copies in one request"),
    # no --expect on either copies sweep: vLLM's copies of one request share its prefix cache,
    # and a request the cache served compares nothing, so the finding says what was compared
    ("copies_on", "on", "copies", None, "copies in one request"),
]


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def exit_meaning(code: int) -> str:
    if code < 0:
        return "killed by %s" % signal.Signals(-code).name
    return EXIT_MEANINGS.get(code, "exit %d" % code)


class UsageError(Exception):
    """A malformed variable or a busy port: nothing has been started."""


class ArmFailed(Exception):
    """An arm exited, or did not become ready in time."""


class Stopped(Exception):
    def __init__(self, signum: int):
        name = signal.Signals(signum).name
        super().__init__("Ctrl-C (SIGINT)" if signum == signal.SIGINT else name)
        self.signum = signum


# ----------------------------------------------------------------------------
# Configuration: the variables, checked before anything starts


@dataclasses.dataclass
class Settings:
    engine: str
    output: str
    degrees: List[int]  # TP degrees, in the order asked for
    serve: Dict[str, List[str]]  # arm -> its command
    urls: Dict[str, str]  # arm -> where it answers
    wait_s: float
    sweep_args: List[str]
    cost_args: List[str]
    copies: bool  # COPIES: the copies-in-one-request sweeps too
    overlap: bool  # OVERLAP: an arm is swept while the other still loads
    baseline: Optional[str] = None  # BASELINE: an earlier run's folder, its flag-on sweeps
    # the arms started by the launch script, which reads MODEL: an arm started by a
    # SERVE_OFF/SERVE_ON of one's own serves what its command says, whatever MODEL is
    model_arms: Tuple[str, ...] = ("off", "on")


def split_words(name: str, env: Dict[str, str]) -> List[str]:
    try:
        return shlex.split(env.get(name, ""))
    except ValueError as err:
        raise UsageError("%s: %s" % (name, err)) from None


# The shells whose -c string is a command of its own: a serve command may be one
# (SERVE_ON="sh -c 'VLLM_BATCH_INVARIANT=1 exec vllm serve ...'"), its key and its --port in it
SHELLS = ("sh", "bash", "dash", "zsh", "ksh")


def shell_string_at(words: List[str]) -> Optional[int]:
    """Where, in a command's words, the string a shell runs stands (sh -c '...',
    bash -ec '...', env X=1 bash -o pipefail -c '...'); None where the command runs none."""
    at = next((i for i, w in enumerate(words) if os.path.basename(w) in SHELLS), None)
    if at is None:
        return None
    i = at + 1
    while i < len(words) and words[i][:1] in "-+" and words[i] not in ("-", "--", "+"):
        word = words[i]
        if not word.startswith("--") and "c" in word[1:]:
            return i + 1 if i + 1 < len(words) else None
        i += 2 if word in ("-o", "+o", "-O", "+O") else 1  # an option with its argument
    return None


def shell_words(words: List[str]) -> List[str]:
    """A command's words with the string a shell runs read as the words it holds (sh -c
    strings within sh -c strings too): where its keys and its --port stand. A string that is
    not shell words raises ValueError."""
    at = shell_string_at(words)
    if at is None:
        return list(words)
    return words[:at] + shell_words(shlex.split(words[at])) + words[at + 1:]


# The run.py options the experiment sets itself in its steps, by what run.py's parser makes of
# them (an option's dest: --base-url is --url, --exp=variant is --expect): given in SWEEP_ARGS
# or COST_ARGS they would undo a step (a flag-off sweep's negative control replaced, the flag-on
# sweep sent to the flag-off arm, the same workload timed twice), so they are refused before
# any arm starts. The sweeps bypass the prefix cache (--prefix-cache bypass): with it kept, a
# request the cache served compares nothing, and both sweeps' --expect would fail having
# measured nothing, once the arms had loaded
OWNED_DESTS = {
    "SWEEP_ARGS": ("mode", "engine", "url", "save", "json_out", "traffic", "expect",
                   "prefill_check", "baseline", "wait_ready", "invariant", "prefix_cache"),
    "COST_ARGS": ("mode", "engine", "url", "invariant", "save", "json_out", "workload", "tp",
                  "wait_ready"),
}
# Options with which run.py ends at once, measuring nothing (exit 0): a step given one would
# "run, and every --expect held" having compared nothing
ENDING_DESTS = ("help", "version")


def option_action(parser, word: str):
    """The parser's option a command-line word names, as argparse reads it: the exact
    spelling, else the one long option it abbreviates (--exp=variant is --expect); None for
    a value, an unknown or an ambiguous option (run.py's own check then refuses those)."""
    if not word.startswith("-") or word == "-" or lab.parse_whole(word) is not None:
        return None
    actions = parser._option_string_actions
    given = word.split("=", 1)[0] if word.startswith("--") else word[:2]
    if given in actions:
        return actions[given]
    if not word.startswith("--"):
        return None
    found = {id(a): a for o, a in actions.items() if o.startswith(given)}
    return next(iter(found.values())) if len(found) == 1 else None


def refuse_owned_options(name: str, words: List[str]) -> None:
    """An option of the experiment's own, or one with which run.py measures nothing, in a
    variable is refused, in any spelling run.py takes (an alias, abbreviated, with "=")."""
    parser = lab.build_parser()
    for word in words:
        if word == "--":
            return
        action = option_action(parser, word)
        if action is None:
            continue
        # its own name: the first long spelling (--url, not its alias --base-url)
        option = next((o for o in action.option_strings if o.startswith("--")),
                      action.option_strings[0])
        spelled = word if word == option else "%s (%s)" % (word, option)
        if action.dest in ENDING_DESTS:
            raise UsageError("%s: %s makes run.py print and exit, measuring nothing; leave it "
                             "out (python3 run.py %s shows it)" % (name, spelled, option))
        if action.dest in OWNED_DESTS[name]:
            owned = [next(o for o in a.option_strings if o.startswith("--"))
                     for a in parser._actions if a.dest in OWNED_DESTS[name]]
            raise UsageError(
                "%s: %s is the experiment's own (it sets %s in its steps); leave it out"
                % (name, spelled, ", ".join(owned)))


USAGE = "usage: examples/experiment.sh vllm|sglang OUTPUT_FOLDER (--help: the variables)"


def read_settings(argv: List[str], env: Dict[str, str]) -> Settings:
    if len(argv) != 2 or argv[0] not in ENGINE_PORTS:
        raise UsageError(USAGE)
    engine, output = argv
    entries = env.get("TP", "1").split(",")
    if not all(e.isdigit() and e.isascii() and int(e) > 0 for e in entries):
        raise UsageError(
            "TP=%s: a positive integer or a comma list of them (TP=1,2)" % env.get("TP")
        )
    try:
        wait_s = float(env.get("WAIT", DEFAULT_WAIT_S))
    except ValueError:
        raise UsageError("WAIT=%s is not a number of seconds" % env.get("WAIT")) from None
    urls, serve = {}, {}
    model_arms: List[str] = []
    for arm, port in zip(("off", "on"), ENGINE_PORTS[engine]):
        name = arm.upper()
        command = split_words("SERVE_" + name, env)
        try:  # a command of one's own's --port, in the string a shell runs too
            listens = serve_port(shell_words(command), "SERVE_" + name,
                                 expands=shell_string_at(command) is not None)
        except ValueError as err:
            raise UsageError("SERVE_%s: the string its shell runs (-c) is not shell words (%s)"
                             % (name, err)) from None
        if listens == SHELL_PORT:  # sh -c '... --port $P': the shell's, known as N_PORT only
            if not env.get(name + "_PORT"):
                raise UsageError("SERVE_%s: its --port is the shell's to expand: give the port "
                                 "in %s_PORT too (the lab asks there)" % (name, name))
            listens = None
        if env.get(name + "_PORT"):
            port = whole_port(env[name + "_PORT"], name + "_PORT")
            if listens is not None and listens != port:
                raise UsageError(
                    "%s_PORT=%d, but SERVE_%s listens on --port %d: the lab would wait at %d "
                    "for an arm serving at %d; give one port (leave %s_PORT out, or change "
                    "the command's --port)" % (name, port, name, listens, port, listens, name))
        elif listens is not None:
            port = listens
        url = env.get(name + "_URL")
        if url:
            lab_check(lab.check_url, url, name + "_URL")
            refuse_unanswerable_url(url, name + "_URL")
            if local_host(url) and url_port(url) != port and (
                    listens is not None or env.get(name + "_PORT")):
                raise UsageError(
                    "%s_URL=%s asks at port %d of this machine, but the arm listens on %d "
                    "(%s): give one port" % (name, url, url_port(url), port,
                                             "SERVE_%s --port" % name if listens is not None
                                             else name + "_PORT"))
        urls[arm] = url or "http://localhost:%d" % port
        default = "env PORT=%d bash %s %s" % (
            url_port(urls[arm]),  # the launch script listens where the lab will ask
            shlex.quote(os.path.join(HERE, engine + "_serve.sh")),
            arm,
        )
        serve[arm] = command or shlex.split(default)
        # an arm the launch script starts reads MODEL, whoever wrote its command
        if not command or any(os.path.basename(word) in ("vllm_serve.sh", "sglang_serve.sh")
                              for word in command):
            model_arms.append(arm)
    if url_port(urls["off"]) == url_port(urls["on"]) and one_host(urls["off"], urls["on"]):
        raise UsageError("the flag-off and flag-on arms would both listen at %s%s: give them "
                         "ports of their own (OFF_PORT, ON_PORT)"
                         % (urls["off"], "" if urls["off"] == urls["on"]
                            else " (%s is the same address)" % urls["on"]))
    for name in OWNED_DESTS:
        refuse_owned_options(name, split_words(name, env))
    return Settings(
        engine=engine,
        output=output,
        degrees=list(dict.fromkeys(int(e) for e in entries)),
        serve=serve,
        urls=urls,
        wait_s=wait_s,
        sweep_args=split_words("SWEEP_ARGS", env),
        cost_args=split_words("COST_ARGS", env),
        copies=on_or_off("COPIES", env),
        overlap=on_or_off("OVERLAP", env),
        baseline=baseline_folder(env),
        model_arms=tuple(model_arms),
    )


def baseline_folder(env: Dict[str, str]) -> Optional[str]:
    """BASELINE=DIR: an earlier run's folder, holding at least one flag-on sweep to compare
    with (tpN/STEM.json of a flag-on sweep of SWEEPS)."""
    folder = env.get("BASELINE")
    if not folder:
        return None
    if not os.path.isdir(folder):
        raise UsageError("BASELINE=%s is not a folder: give an earlier run's (OUTPUT/"
                         "YYYYmmdd-HHMMSS)" % folder)
    if not earlier_sweeps(folder):
        raise UsageError("BASELINE=%s holds no flag-on sweep (tpN/sweep_on.json or "
                         "tpN/copies_on.json): give an earlier run's folder" % folder)
    return os.path.abspath(folder)


def earlier_sweeps(folder: str) -> List[Tuple[int, str]]:
    """(TP degree, file stem) of every flag-on sweep an earlier run's folder holds."""
    found = []
    for name in sorted(os.listdir(folder)):
        match = re.fullmatch(r"tp([0-9]+)", name)
        if match:
            for stem, key, *_ in SWEEPS:
                if key == "on" and os.path.isfile(os.path.join(folder, name, stem + ".json")):
                    found.append((int(match.group(1)), stem))
    return found


def earlier_sweep(s: "Settings", tp: int, stem: str) -> Optional[str]:
    """The earlier run's flag-on sweep that matches one of this run's (same degree, same
    traffic), where BASELINE holds it."""
    if not s.baseline:
        return None
    path = os.path.join(s.baseline, "tp%d" % tp, stem + ".json")
    return path if os.path.isfile(path) else None


def refuse_unanswerable_url(url: str, name: str) -> None:
    """An arm's URL the experiment could never reach an arm at, refused before any arm
    loads (else the arm loads, and the lab waits all of WAIT for a health check that cannot
    answer): https:// (the launch scripts start the engines with no certificate: they serve
    plain HTTP) and a path after the port (the experiment asks for /health at the arm's
    root, and run.py adds /v1 itself). Both said in one line."""
    parts = urllib.parse.urlsplit(url)
    faults = []
    if parts.scheme == "https":
        faults.append("https:// (the engines the experiment starts serve plain HTTP: they "
                      "have no certificate)")
    if parts.path.strip("/"):
        faults.append("a path after the port, %s (the experiment asks for the arm's /health "
                      "at its root, and run.py adds /v1 itself)" % parts.path)
    if faults:
        raise UsageError("%s=%s: %s; give http://%s, and nothing was started"
                         % (name, url, "; and ".join(faults), parts.netloc))


def lab_check(check, *args):
    """One of run.py's own checks; what it refuses is a UsageError here, in its words."""
    try:
        return check(*args)
    except lab.UsageError as err:
        raise UsageError(str(err)) from None


SHELL_PORT = -1  # a --port a shell expands ($PORT in an sh -c string): not known here


def serve_port(command: List[str], name: str, expands: bool = False) -> Optional[int]:
    """The --port a serve command of one's own gives its engine (--port N or --port=N; the
    last one, as the engines' parsers take it), SHELL_PORT for one a shell expands (expands:
    the command runs a shell's string), or None."""
    port = None
    for i, word in enumerate(command):
        value = (command[i + 1] if word == "--port" and i + 1 < len(command)
                 else word.split("=", 1)[1] if word.startswith("--port=") else None)
        if value is not None:
            port = (SHELL_PORT if expands and "$" in value
                    else whole_port(value, name + " --port"))
    return port


def addresses(url: str) -> set:
    """The addresses a URL's host stands for (empty where it does not resolve)."""
    host = urllib.parse.urlsplit(url).hostname or ""
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return set()


def local_host(url: str) -> bool:
    """Is the URL's host this machine: a loopback address, or every address (0.0.0.0, as an
    engine logs where it listens)?"""
    found = [ipaddress.ip_address(a.split("%")[0]) for a in addresses(url)]
    return bool(found) and all(a.is_loopback or a.is_unspecified for a in found)


def one_host(first: str, second: str) -> bool:
    """Two URLs' hosts are one machine in two spellings (localhost and 127.0.0.1 and
    0.0.0.0 are; a server listens on a port of every address, as the engines do)."""
    hosts = [urllib.parse.urlsplit(u).hostname for u in (first, second)]
    if hosts[0] == hosts[1]:
        return True
    return bool(addresses(first) & addresses(second)) or (local_host(first)
                                                          and local_host(second))


def on_or_off(name: str, env: Dict[str, str]) -> bool:
    """A switch variable: on (its default) or off."""
    value = env.get(name, "on")
    if value not in ("on", "off"):
        raise UsageError("%s=%s: on or off" % (name, value))
    return value == "on"


def whole_port(text: str, name: str) -> int:
    if not (text.isdigit() and text.isascii() and 0 < int(text) < 65536):
        raise UsageError("%s=%s is not a port (1 to 65535)" % (name, text))
    return int(text)


def placement(arm: str, tp: int, env: Dict[str, str]) -> Optional[Dict[str, str]]:
    """placement.sh's answer for one arm at one degree: its variables, or None when GPUS
    cannot hold the degree. A malformed variable is a UsageError."""
    p = subprocess.run(
        ["bash", os.path.join(HERE, "placement.sh"), arm],
        env=dict(env, TP=str(tp)),
        capture_output=True,
        text=True,
    )
    if p.returncode == 3:
        return None
    if p.returncode != 0:
        raise UsageError(
            p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "placement.sh failed"
        )
    return dict(line.split("=", 1) for line in p.stdout.splitlines() if "=" in line)


def url_port(url: str) -> int:
    try:
        parts = urllib.parse.urlsplit(url)
        return parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as err:
        raise UsageError("%s: %s" % (url, err)) from None


def port_free(port: int) -> bool:
    """Can a server bind this port (as uvicorn does, on every address)?"""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return False
            raise
    return True


# ----------------------------------------------------------------------------
# The arms


@dataclasses.dataclass
class Arm:
    key: str  # "off" or "on"
    command: List[str]
    url: str
    env: Dict[str, str]  # with the placement's CUDA_VISIBLE_DEVICES
    log_path: str
    process: Optional[subprocess.Popen] = None
    started_at: Optional[float] = None  # time.time() when its command was started
    writer: Optional[threading.Thread] = None  # writes its output into its log
    ready_at: Optional[float] = None  # when it first answered its health check

    @property
    def name(self) -> str:
        return "the flag-%s arm" % self.key

    @property
    def devices(self) -> set:
        return set(self.env.get("CUDA_VISIBLE_DEVICES", "").split(","))

    def start(self) -> None:
        self.started_at = time.time()
        open(self.log_path, "wb").close()  # there from the start, empty or not
        # A process group of its own: stopping it reaches the launch script, the engine
        # and the engine's workers; the terminal's Ctrl-C reaches only the experiment.
        try:
            self.process = subprocess.Popen(
                self.command,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        except OSError as err:  # a command that does not exist, or may not run
            os.unlink(self.log_path)  # nothing ran: no log to point to
            raise ArmFailed(
                "%s could not be started (%s: %s)"
                % (self.name, " ".join(self.command[:1]), err.strerror or err)
            ) from None
        self.writer = threading.Thread(target=self.write_log, args=(self.process.stdout,),
                                       daemon=True)
        self.writer.start()

    def write_log(self, output) -> None:
        """The engine's output into its log, a line at a time as it comes, each line with the
        keys hidden (KEYS.engine_text): an engine that logs its own arguments (SGLang's
        server_args) never puts its key in the file. Bytes that are not UTF-8 pass as they
        came."""
        try:
            with open(self.log_path, "ab") as log:
                for raw in iter(output.readline, b""):
                    text = raw.decode("utf-8", "surrogateescape")
                    if KEYS is not None:
                        text = (KEYS.launch_line(text) if text.startswith("launch: ")
                                else KEYS.engine_text(text))
                    log.write(text.encode("utf-8", "surrogateescape"))
                    log.flush()
        except OSError:  # a full disk: the engine's output is still read, so that it never
            for _ in iter(output.readline, b""):  # blocks on a full pipe, and goes nowhere
                pass
        output.close()

    def log_written(self) -> None:
        """Wait, briefly, for the engine's last lines to reach its log (workers that outlive
        the engine may hold its output open: not for ever)."""
        if self.writer is not None:
            self.writer.join(timeout=LOG_DRAIN_S)

    def exit_status(self) -> Optional[int]:
        return None if self.process is None else self.process.poll()

    def healthy(self) -> bool:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a local server
        try:
            with opener.open(self.url.rstrip("/") + "/health", timeout=HEALTH_TIMEOUT_S) as answer:
                return answer.status == 200
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def failure(self, what: str) -> ArmFailed:
        self.log_written()
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                lines = [line.strip() for line in f.read().splitlines() if line.strip()]
            tail = lines[-LOG_TAIL_LINES:]
        except OSError:
            tail = []
            lines = []
        cause = root_cause(lines)
        shown = cause or " | ".join(tail) or "(empty)"
        if KEYS is not None:  # an engine's log may print its own --api-key
            shown = KEYS.engine_text(shown)
        return ArmFailed("%s (%s) %s; %s %s: %s"
                         % (self.name, self.url, what, "the cause in" if cause else "the end of",
                            self.log_path, shown))

    def check_running(self) -> None:
        status = self.exit_status()
        if status is not None:
            raise self.failure("exited with status %d" % status)

    def stop(self) -> None:
        """TERM the whole group, give it STOP_GRACE_S to go, then KILL what is left (an
        engine's workers can outlive the process that started them)."""
        if self.process is None:
            return
        signal_group(self.process, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while signal_group(self.process, 0) and time.monotonic() < deadline:
            try:  # back at once when the leader goes (reaped, so that only live members count)
                self.process.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                continue
            if signal_group(self.process, 0):  # members outlive the leader: look again soon
                time.sleep(POLL_S)
        signal_group(self.process, signal.SIGKILL)
        self.process.wait()
        self.log_written()


# What an engine puts before each line of its log: a process tag, the level, the time and the
# source line, as vLLM's workers log ("(EngineCore pid=1752) ERROR 12-04 15:51:23 [core.py:1757]")
LOG_PREFIX = re.compile(r"^(?:\([^)]*\)\s*)?(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+)?"
                        r"(?:\[?[\d-]+ [\d:.,]+\]?\s*)?(?:\[[^\]]*\]\s*)?")
ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception)):(.*)$")
WRAPPER = re.compile(r"(?i)see (the )?(root cause|error|log)s? above")
# An error that names a thing that is not there: the cause whatever follows it
MISSING = re.compile(r"ModuleNotFoundError|ImportError|FileNotFoundError|No module named|"
                     r"No such file|not found|cannot open shared object")


def root_cause(lines: List[str]) -> str:
    """Why an engine died, from its log: the first line that names a missing thing (a
    module, a file, a library, the engine's own command), else the first error of the log's
    last traceback (an engine that reraises ends its log with a wrapper, "Engine core
    initialization failed. See root cause above"); "" where the log holds no error line."""
    bare = [LOG_PREFIX.sub("", line).strip() for line in lines]
    errors = [(i, line) for i, line in enumerate(bare) if ERROR_LINE.match(line)]
    for _, line in errors:
        if MISSING.search(line):
            return line[:300]
    for line in bare:  # a shell's "exec: vllm: not found": the engine is not installed
        if MISSING.search(line) and not line.startswith("launch: "):
            return line[:300]
    if not errors:
        return ""
    # an error that points elsewhere for its cause is the cause only where there is no other
    causes = [(i, line) for i, line in errors if not WRAPPER.search(line)] or errors
    starts = [i for i, line in enumerate(bare) if line.startswith("Traceback (most recent")]
    last = starts[-1] if starts else 0
    # the last traceback's errors; its first one is the cause (later ones: "During handling
    # of the above exception, another exception occurred")
    after = [line for i, line in causes if i > last] or [causes[-1][1]]
    return after[0][:300]


def launch_lines(arm: Arm) -> List[str]:
    """How an arm was started: the launch script's own "launch:" line (the engine's command
    as it ran), else the command the experiment gave."""
    try:
        with open(arm.log_path, encoding="utf-8", errors="replace") as f:
            found = [line[len("launch: ") :].strip() for line in f if line.startswith("launch: ")]
    except OSError:
        found = []
    return found or [" ".join(shlex.quote(w) for w in arm.command)]


ASK_TIMEOUT_S = 10.0  # one question to an arm beside the steps (/metrics, one completion)


def ask_arm(url: str, path: str, body: Optional[dict] = None,
            api_key: Optional[str] = None) -> Optional[bytes]:
    """An arm's answer to one GET (or POST of body), standard library only, or None where it
    gave none (no answer, not 200, not readable)."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if api_key:
        headers["Authorization"] = "Bearer " + api_key
    request = urllib.request.Request(
        url.rstrip("/") + path, headers=headers,
        data=None if body is None else json.dumps(body).encode("utf-8"))
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the arm itself
    try:
        with opener.open(request, timeout=ASK_TIMEOUT_S) as answer:
            return answer.read(1 << 22) if answer.status == 200 else None
    except (OSError, ValueError, urllib.error.URLError, http.client.HTTPException):
        return None


# vLLM's cache settings as its /metrics says them: a gauge whose labels are the settings,
# block_size among them (0.34.0: vllm:cache_config_info{...,block_size="64",...} 1.0)
CACHE_CONFIG = re.compile(r'^vllm:cache_config_info\{([^}]*)\}', re.M)
BLOCK_SIZE_LABEL = re.compile(r'(?:^|,)block_size="(\d+)"')


def cache_block_size(url: str) -> Optional[int]:
    """The tokens of one prefix-cache block, as a vLLM arm says it in /metrics; None where it
    says none (or /metrics does not answer)."""
    text = (ask_arm(url, "/metrics") or b"").decode("utf-8", "replace")
    config = CACHE_CONFIG.search(text)
    found = BLOCK_SIZE_LABEL.search(config.group(1)) if config else None
    return int(found.group(1)) if found and int(found.group(1)) > 0 else None


def prompt_token_count(url: str, prompt: str, api_key: Optional[str]) -> Optional[int]:
    """A prompt's tokens as a vLLM arm counts them where a sweep sends it (usage.prompt_tokens
    of a one-token greedy completion, with a cache key of its own so that no sweep's request
    meets it in the cache); None where it did not say."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0,
            "cache_salt": "experiment-%s" % os.urandom(8).hex()}
    try:
        answer = json.loads(ask_arm(url, "/v1/completions", body, api_key) or b"null")
    except ValueError:
        return None
    usage = answer.get("usage") if isinstance(answer, dict) else None
    count = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def signal_group(process: subprocess.Popen, signum: int) -> bool:
    """Send signum to the process's group; False when no member of it is left."""
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member that changed its user; it is still there
        return True
    return True


class Startup:
    """The arms' start-up at one degree, advanced one poll at a time (poll) so that steps run
    meanwhile. Arms on separate devices start together. Arms that share one start one after
    the other, the flag-on arm once the flag-off arm answers its health check: on one real
    H200 a vLLM arm whose memory profiling ran while the other was still loading counted that
    memory as its own and exited. Each arm has WAIT seconds from its own start."""

    def __init__(self, arms: List[Arm], wait_s: float):
        off, on = arms
        self.arms, self.wait_s = arms, wait_s
        self.shared = sorted(off.devices & on.devices)
        self.queued = [on] if self.shared else []  # to start once the one before is ready
        self.loading = [off] if self.shared else [off, on]  # started, not ready yet
        if self.shared:
            say("the arms share device(s) %s: the flag-on arm starts once the flag-off arm is "
                "ready, and the flag-off arm is swept while the flag-on arm loads"
                % ",".join(self.shared))
        for arm in self.loading:
            arm.start()

    def ready(self, key: str) -> bool:
        return any(arm.key == key and arm.ready_at is not None for arm in self.arms)

    @property
    def done(self) -> bool:
        return not self.loading and not self.queued

    def poll(self) -> None:
        """Look once at every arm still loading: a ready one is said (and the next queued arm
        started), one past WAIT fails the run; an arm that exits fails it (check_arms)."""
        for arm in list(self.loading):
            if arm.healthy():
                arm.ready_at = time.time()
                say("%s is ready at %s, %.0f s after its start"
                    % (arm.name, arm.url, arm.ready_at - arm.started_at))
                self.loading.remove(arm)
            elif time.time() - arm.started_at > self.wait_s:
                raise arm.failure("was not ready within %gs (WAIT)" % self.wait_s)
        if self.queued and not self.loading:
            arm = self.queued.pop(0)
            arm.start()
            self.loading.append(arm)


# ----------------------------------------------------------------------------
# Steps: the lab's runs, watched


@dataclasses.dataclass
class Step:
    name: str
    tp: int  # 0: not of one degree
    lab: bool = True  # a run.py step (its exit codes), or a picture
    exit_code: Optional[int] = None  # None: not run to the end
    note: str = ""
    outputs: List[str] = dataclasses.field(default_factory=list)
    argv: List[str] = dataclasses.field(default_factory=list)  # the command, as run
    reason: str = ""  # a failed step's own last line: why it failed
    what: str = ""  # what it measures, said as it starts
    number: int = 0  # its place in the run, from 1
    started: Optional[float] = None  # time.time()
    ended: Optional[float] = None
    arm: str = ""  # the arm it measures alone ("off" or "on"); "" for both or neither

    def title(self) -> str:
        return "%s%s" % (self.name, " (TP %d)" % self.tp if self.tp else "")


@dataclasses.dataclass
class Job:
    """A step to run: its command and where its output goes; once started, its process and
    how far its stderr has been read for progress lines."""

    step: Step
    argv: List[str]
    stdout_path: str
    process: Optional[subprocess.Popen] = None
    files: List = dataclasses.field(default_factory=list)  # its stdout and stderr, open
    said_at: float = 0.0  # time.monotonic() of its last progress line said
    read_to: int = 0  # bytes of its stderr read so far
    # asked once it is due, its arm ready: why it is left out ("": it runs)
    left_out: Optional[Callable[[], str]] = None

    @property
    def err_path(self) -> Optional[str]:
        """Its stderr beside its stdout (a .txt); a picture's goes nowhere."""
        if not self.stdout_path.endswith(".txt"):
            return None
        return self.stdout_path[: -len(".txt")] + ".err"


ARM_STOPPED = "stopped: an arm exited"  # the note of a step an arm's exit stopped
DISK_NOTE = "the output folder could not take its results: the disk, not the server"
SAVE_FAILED = "--save: cannot write"  # run.py's words where its --save file could not be written
DISK_ROOM = 1 << 20  # bytes free below which a disk is taken for full


def disk_full(folder: str) -> bool:
    """Has the disk that holds folder (about) no room left for anyone but root?"""
    try:
        found = os.statvfs(folder)
    except OSError:
        return False
    return found.f_bavail * found.f_frsize < DISK_ROOM


# The cost cells of each degree, in order
WORKLOADS = ("cold", "shared-prefix")


def sweep_options(s: Settings, key: str, traffic: str, expect: Optional[str],
                  save: Optional[str]) -> List[str]:
    """run.py's options for one sweep of one arm (save None: as checked before any arm
    starts, with nothing to save to yet)."""
    words = ["--mode", "sweep", "--engine", s.engine, "--url", s.urls[key], "--wait-ready", "60",
             "--traffic", traffic, "--prefix-cache", "bypass"]
    words += ["--save", save] if save else []
    words += ["--prefill-check"] if traffic == "concurrent" else []
    words += ["--expect", expect] if expect else []
    return words + s.sweep_args


def versus_options(s: Settings, baseline: Optional[str], save: Optional[str]) -> List[str]:
    """run.py's options for the flag-on arm's batch 1 against the first degree's (baseline:
    its saved sweep; None before any arm starts)."""
    words = ["--mode", "sweep", "--engine", s.engine, "--url", s.urls["on"], "--wait-ready", "60",
             *s.sweep_args]
    words += ["--baseline", baseline] if baseline else []
    words += ["--sizes", "1", "--repeat", "2", "--expect", "invariant"]
    return words + (["--save", save] if save else [])


def against_earlier_options(s: Settings, traffic: str, earlier: str,
                            save: Optional[str]) -> List[str]:
    """run.py's options for a flag-on sweep run again against the earlier run's matching one
    (BASELINE): the same sweep, its baseline that file's batch 1, no --expect (what it found
    is reported, not expected)."""
    return sweep_options(s, "on", traffic, None, save) + ["--baseline", earlier]


def cost_options(s: Settings, workload: str, tp: int, save: Optional[str]) -> List[str]:
    """run.py's options for one cost cell."""
    words = ["--mode", "cost", "--engine", s.engine, "--url", s.urls["off"], "--invariant",
             s.urls["on"], "--wait-ready", "60", "--workload", workload, "--tp", str(tp)]
    return words + (["--save", save] if save else []) + s.cost_args


def check_steps(s: Settings, sweeps: List[Tuple[str, str, str, Optional[str], str]]) -> None:
    """Every step's options through run.py's own configuration (its parser and every check
    that needs no server), before any arm starts: an option a step would refuse costs no GPU
    time. A refusal names the variable it came from and the step."""
    steps = [("SWEEP_ARGS", "the flag-%s sweep, %s" % (key, shape),
              sweep_options(s, key, traffic, expect, None))
             for _, key, traffic, expect, shape in sweeps]
    if len(s.degrees) > 1:
        steps.append(("SWEEP_ARGS", "TP against TP, batch 1", versus_options(s, None, None)))
    # the earlier run's files are read by run.py's own checks: another model, prompt or
    # sampling is refused here, before any arm starts
    steps += [("BASELINE", "the flag-on sweep, %s, against %s" % (shape, earlier),
               against_earlier_options(s, traffic, earlier, None))
              for tp in s.degrees for stem, key, traffic, _, shape in sweeps
              if key == "on" for earlier in [earlier_sweep(s, tp, stem)] if earlier]
    steps += [("COST_ARGS", "the %s cost cell" % workload, cost_options(s, workload, tp, None))
              for tp in s.degrees[:1] for workload in WORKLOADS]
    for name, step, words in steps:
        try:
            cfg = lab.configure(words)
        except lab.UsageError as err:
            raise UsageError("%s: run.py refuses it in %s: %s" % (name, step, err)) from None
        # a cost cell of fewer trial pairs than run.py's overhead needs for its interval
        # would be timed whole and then say "no interval": refused before the arms load
        if cfg.cost is not None and cfg.cost.trials < lab.MIN_PAIRS_FOR_INTERVAL:
            raise UsageError(
                "%s: --trials %d can give no interval in %s: run.py's cost mode needs at least "
                "%d trial pairs for the overhead's 95 %% interval; give --trials %d or more "
                "(run.py's default: %d)" % (name, cfg.cost.trials, step,
                                            lab.MIN_PAIRS_FOR_INTERVAL,
                                            lab.MIN_PAIRS_FOR_INTERVAL, lab.DEFAULT_TRIALS))


def step_environment(env) -> Dict[str, str]:
    """A lab step's environment: its output goes to files the experiment reads as UTF-8,
    whatever the terminal's encoding (a model path in another script under an ISO-8859-1
    locale); and the arms started with VLLM_API_KEY (inherited from the experiment) want that
    key, which run.py takes from OPENAI_API_KEY, where that is not set."""
    step = dict(env, PYTHONIOENCODING="utf-8")
    if env.get("VLLM_API_KEY") and not env.get("OPENAI_API_KEY"):
        step["OPENAI_API_KEY"] = env["VLLM_API_KEY"]
    return step


class Experiment:
    def __init__(self, settings: Settings, env: Dict[str, str], run_dir: str):
        self.settings, self.env, self.run_dir = settings, env, run_dir
        self.steps: List[Step] = []
        self.skipped: List[str] = []
        self.arms: List[Arm] = []
        self.running: List[Job] = []  # the steps running now
        self.planned = 0  # the steps the run means to take: "step k of n"
        self.arm_times: List[Tuple[int, Arm]] = []  # (TP, arm) of every arm started: the report
        self.started = time.time()
        self.ended: Optional[float] = None
        self.exit_code = 0
        self.stopped_by: Optional[str] = None
        self.stopped_steps: List[Step] = []  # the steps running when a stop signal came
        self.stopped_during = ""  # what the run was doing then, where no step was running
        self.late_stop = ""  # a stop signal that came as the arms stopped after the last step
        self.failure: str = ""  # what ended the run early (an arm, the disk), in one line
        self.unwritten = ""  # why REPORT.md could not be written, in one line ("": it was)
        self.first_tp: Optional[int] = None  # the first degree measured: the others against it
        self.launched: Dict[str, List[str]] = {}  # arm -> how it was started, as logged
        self.environment: List[Tuple[str, str]] = []  # (what, value) for the report
        self.judged: List[str] = []  # what the saved files say moved with the flag on (judge)
        self.unsaved: List[str] = []  # steps that exited 0 and saved no whole result (judge)
        self.uncompared: List[str] = []  # flag-on results that compared nothing (judge)
        self.left_out: List[str] = []  # steps left out, each with why (copies_left_out)
        self.copies_compared: List[str] = []  # copies sweeps known to compare cold prefills
        # copies sweeps that compared nothing where the concurrent sweeps compared (judge):
        # named, not counted in the verdict
        self.aside: List[str] = []

    def described_env(self) -> Dict[str, str]:
        """The variables as the report describes the run by them: MODEL only where a launch
        script started an arm with it (beside SERVE_OFF and SERVE_ON of one's own it names no
        model served)."""
        if self.settings.model_arms:
            return self.env
        return {k: v for k, v in self.env.items() if k != "MODEL"}

    def lab(self, *args: str) -> List[str]:
        return [sys.executable, os.path.join(ROOT, "run.py")] + list(args)

    def run_step(self, step: Step, argv: List[str], stdout_path: str) -> None:
        """Run one step alone, the arms watched while it runs."""
        self.run_lanes([[Job(step, argv, stdout_path)]])

    def run_lanes(self, lanes: List[List[Job]], startup: Optional[Startup] = None,
                  gates: Optional[List[str]] = None) -> None:
        """Run each lane's jobs one after the other and the lanes side by side, watching the
        arms all the while: with a startup, a lane starts its next job only once the arm its
        gate names is ready, and the run goes on until every arm is. A step's reason, when it
        fails, is its last line on stderr; an arm that exits stops every running step."""
        lanes = [list(lane) for lane in lanes]
        running: List[Optional[Job]] = [None] * len(lanes)
        try:
            while any(lanes) or any(running) or (startup is not None and not startup.done):
                self.check_arms()
                if startup is not None:
                    startup.poll()
                for i, lane in enumerate(lanes):
                    job = running[i]
                    if job is not None and job.process.poll() is not None:
                        self.finish_job(job)
                        running[i] = job = None
                    gate_open = startup is None or gates is None or startup.ready(gates[i])
                    if job is None and lane and gate_open:
                        due = lane.pop(0)
                        why = due.left_out() if due.left_out is not None else ""
                        if why:  # said, and in the report; the lane goes on at the next look
                            self.leave_out(due.step, why)
                        else:
                            running[i] = self.begin_job(due)
                    elif job is not None:
                        self.relay_progress(job)
                if any(lanes) or any(running) or (startup is not None and not startup.done):
                    time.sleep(POLL_S)
        except ArmFailed:
            for job in running:
                if job is not None:
                    job.step.note = ARM_STOPPED
            self.stop_steps()
            raise

    def leave_out(self, step: Step, why: str) -> None:
        """A step the run leaves out, with why: said now, and in the report's findings."""
        line = "%s left out: %s" % (step.title(), why)
        self.left_out.append(line)
        self.planned -= 1
        say(line)

    def copies_left_out(self, key: str, title: str) -> str:
        """Why an arm's copies sweep is left out ("": it runs). On vLLM, copies in one request
        share the prefix cache whatever the key, served in whole blocks: they compare cold
        prefills only where the prompt is shorter than one block. The block is the arm's own
        word (block_size in vllm:cache_config_info at /metrics, as 0.34.0 serves it) and the
        prompt's length the arm's own count (usage.prompt_tokens of one completion of it, a
        key of its own so that no sweep meets it in the cache). Where either is not known,
        the sweep runs, and what it compared is read from what it saved."""
        s = self.settings
        if s.engine != "vllm":
            return ""
        url = s.urls[key]
        block = cache_block_size(url)
        if block is None:
            return ""
        sweep_cfg = lab.configure(sweep_options(s, key, "copies", None, None))
        api_key = sweep_cfg.api_key or self.env.get("VLLM_API_KEY") or None
        built = sweep_cfg.sweep.prompt_tokens
        prompts = [""] if built else sorted(sweep_cfg.sweep.prompts, key=len, reverse=True)
        if built:  # run.py builds it to within max(2, N/100) tokens of N, as the server counts
            longest, said = built + max(2, built // 100), "--prompt-tokens %d" % built
        else:  # the longest text first: one prompt not shorter than a block is enough
            counts: List[int] = []
            for prompt in prompts:
                count = prompt_token_count(url, prompt, api_key)
                if count is None:
                    return ""
                counts.append(count)
                if count >= block:
                    break
            longest = max(counts)
            said = "%d token%s as the arm counts it" % (longest, "" if longest == 1 else "s")
        if longest < block:
            self.copies_compared.append(
                "%s: its copies compare cold prefills: %s (%s) is shorter than one of the "
                "arm's %d-token cache blocks (vllm:cache_config_info)"
                % (title, "the prompt" if len(prompts) == 1 else "every prompt, the longest",
                   said, block))
            return ""
        return ("%s (%s) is not shorter than one of the arm's %d-token cache blocks (block_size "
                "in vllm:cache_config_info at its /metrics): copies of it in one request share "
                "the prefix cache whatever the key, so they would compare cache hits, not cold "
                "prefills; the concurrent sweeps decide"
                % ("the prompt" if len(prompts) == 1 else "a prompt", said, block))

    def begin_job(self, job: Job) -> Job:
        step = job.step
        self.steps.append(step)
        step.argv, step.number, step.started = job.argv, len(self.steps), time.time()
        say("step %d of %d: %s%s" % (step.number, max(self.planned, step.number), step.title(),
                                     ": " + step.what if step.what else ""))
        job.files = [open(job.stdout_path, "a", encoding="utf-8"),
                     open(job.err_path or os.devnull, "a", encoding="utf-8")]
        job.said_at = time.monotonic()
        job.process = subprocess.Popen(
            job.argv,
            stdout=job.files[0],
            stderr=job.files[1],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=step_environment(os.environ),
        )
        self.running.append(job)
        return job

    def relay_progress(self, job: Job) -> None:
        """A running step's newest progress line, at most every PROGRESS_EVERY_S: a step of
        minutes on a GPU says where it stands."""
        if job.err_path is None or time.monotonic() - job.said_at < PROGRESS_EVERY_S:
            return
        job.said_at = time.monotonic()
        try:
            with open(job.err_path, "rb") as f:
                f.seek(job.read_to)
                text = f.read()
        except OSError:
            return
        complete = text[: text.rfind(b"\n") + 1]  # a line still being written waits
        job.read_to += len(complete)
        marker = "run.py: progress: "
        lines = [line for line in complete.decode("utf-8", "replace").splitlines()
                 if line.startswith(marker)]
        if lines:
            line = lines[-1][len(marker):]
            say("  step %d: %s" % (job.step.number,
                                   KEYS.engine_text(line) if KEYS is not None else line))

    def finish_job(self, job: Job) -> None:
        step = job.step
        step.exit_code, step.ended = job.process.returncode, time.time()
        for f in job.files:
            f.close()
        self.running.remove(job)
        self.check_arms()  # a step that failed because its arm died is the arm's failure
        step.note = (
            exit_meaning(step.exit_code)
            if step.lab
            else "drawn" if step.exit_code == 0 else "failed"
        )
        if step.exit_code != 0 and job.err_path:
            step.reason = failure_reason(job.stdout_path, job.err_path)
        self.name_the_disk(step, job)
        say(
            "step %d of %d: %s: exit %d, %s%s, %.0f s"
            % (
                step.number,
                max(self.planned, step.number),
                step.title(),
                step.exit_code,
                step.note,
                ": " + step.reason if step.reason else "",
                step.ended - step.started,
            )
        )
        if step.exit_code != 0 and self.exit_code == 0:
            self.exit_code = EXIT_DISK if step.note == DISK_NOTE else step.exit_code

    def name_the_disk(self, step: Step, job: Job) -> None:
        """A lab step that failed because the run's folder could not take what it wrote
        (run.py's "--save: cannot write ...", its own stdout or stderr, which are files in
        that folder here, or, where it could not even say why, a disk with no room left)
        failed on the disk, not the server: its note says so, whatever exit code run.py gave
        it."""
        if not step.lab or step.exit_code not in (lab.EXIT_SERVER, lab.EXIT_OUTPUT):
            return
        if (SAVE_FAILED in step.reason or step.exit_code == lab.EXIT_OUTPUT
                or (not step.reason and disk_full(self.run_dir))):  # its stderr not written
            step.note = DISK_NOTE
            if not step.reason:
                step.reason = "%s has no room left" % os.path.dirname(job.stdout_path)

    def stopped(self) -> None:
        """A stop signal came: the steps it stops (every one begun and not ended), or, with
        none running, what the run was doing (an arm starting, or between steps) and the
        last step that ended, so that the report's first line says where it stopped."""
        self.stopped_steps = [step for step in self.steps if step.ended is None]
        if self.stopped_during:  # said where it came (stop_arms_after_steps)
            ended = [step for step in self.steps if step.ended is not None]
            last = max(ended, key=lambda step: step.ended, default=None)
            if last is not None:
                self.stopped_during += ", after step %d of %d (%s)" % (
                    last.number, max(self.planned, last.number), last.title())
            return
        starting = [arm for arm in self.arms if arm.process is not None and arm.ready_at is None]
        if starting:
            doing = "%s %s starting (TP %s)" % (" and ".join(arm.name for arm in starting),
                                                "were" if len(starting) > 1 else "was",
                                                starting[0].env.get("TP", "?"))
        else:
            doing = "between steps"
        ended = [step for step in self.steps if step.ended is not None]
        if ended:
            last = max(ended, key=lambda step: step.ended)
            doing += ", after step %d of %d (%s)" % (last.number, max(self.planned, last.number),
                                                     last.title())
        else:
            doing += ", before the first step"
        self.stopped_during = doing

    def check_arms(self) -> None:
        for arm in self.arms:
            arm.check_running()

    def stop_steps(self, signum: int = signal.SIGTERM) -> None:
        """The lab's own stop of every running step, by the signal that stopped the
        experiment (Ctrl-C stays Ctrl-C in what the step saves): a first one stops it after
        the current request, a second at once; either way it saves what it measured, marked
        as the signal says. The steps' groups are signalled together, then waited for."""
        jobs, self.running = list(self.running), []
        for job in [job for job in jobs if job.process.poll() is not None]:
            self.ended_alone(job)  # it had ended before the stop: it was not stopped
        for _ in range(2):
            live = [job for job in jobs if job.process.poll() is None]
            for job in live:
                signal_group(job.process, signum)
            deadline = time.monotonic() + STEP_GRACE_S
            while any(job.process.poll() is None for job in live) and time.monotonic() < deadline:
                time.sleep(POLL_S / 4)
        for job in jobs:
            if job.process.poll() is None:
                signal_group(job.process, signal.SIGKILL)
            job.process.wait()
            for f in job.files:
                f.close()
            step = job.step
            if step.exit_code is None:
                step.exit_code, step.ended = job.process.returncode, time.time()
                if not step.note:
                    step.note = exit_meaning(job.process.returncode)

    def ended_alone(self, job: Job) -> None:
        """A running step whose process had ended before the stop could reach it: its own
        exit, said as any step's end is (finish_job), and not among the steps stopped."""
        step = job.step
        self.stopped_steps = [s for s in self.stopped_steps if s is not step]
        if step.exit_code is not None:
            return
        step.exit_code, step.ended = job.process.returncode, time.time()
        if step.note and step.exit_code != 0:  # an arm's exit names a failed step's end
            return
        step.note = exit_meaning(step.exit_code) if step.lab else (
            "drawn" if step.exit_code == 0 else "failed")
        if step.exit_code != 0 and job.err_path:
            step.reason = failure_reason(job.stdout_path, job.err_path)
        self.name_the_disk(step, job)

    def stop_arms(self, after: str = "") -> None:
        """Stop both arms, said first (a stop takes up to STOP_GRACE_S an arm: a user who
        sees nothing may take the run for hung); after: what has ended, for that line."""
        started = [arm for arm in self.arms if arm.process is not None]
        for arm in started:  # what the launch scripts logged they ran, for the report; only
            self.launched.setdefault(arm.key, launch_lines(arm))  # an arm that started ran
        if started:
            say("stopping the arms%s: %s (each within %.0f s)" % (
                after, " and ".join(arm.name for arm in started), STOP_GRACE_S))
        for arm in self.arms:  # both at once; each then gets its grace
            if arm.process is not None:
                signal_group(arm.process, signal.SIGTERM)
        for arm in self.arms:
            arm.stop()
        self.arms = []

    def degree(self, tp: int, places: Dict[str, Dict[str, str]], last: bool = True) -> None:
        """Both arms at one TP degree: start them and sweep each as soon as it is ready (the
        flag-off arm while the flag-on arm loads, on one device; both at once on their own),
        then, both ready and every sweep done, time both workloads alone, and stop them."""
        s = self.settings
        folder = os.path.join(self.run_dir, "tp%d" % tp)
        os.makedirs(folder)
        self.arms = [
            Arm(
                key,
                s.serve[key],
                s.urls[key],
                dict(self.env, TP=str(tp), **places[key]),
                os.path.join(folder, "server_%s.log" % key),
            )
            for key in ("off", "on")
        ]
        self.arm_times += [(tp, arm) for arm in self.arms]
        say("TP %d: starting both arms (logs in %s)" % (tp, folder))
        startup = Startup(self.arms, s.wait_s)
        if not self.environment:  # asked while the first arm loads, not before it starts
            self.environment = environment(self.described_env())
        lanes: Dict[str, List[Job]] = {"off": [], "on": []}
        for stem, key, traffic, expect, shape in self.sweeps():
            save = os.path.join(folder, stem + ".json")
            argv = self.lab(*sweep_options(s, key, traffic, expect, save))
            what = "unique completions and ULPs across batch sizes, flag %s, %s%s" % (
                key, shape, " (expect %s)" % expect if expect else "")
            step = Step("flag-%s sweep, %s" % (key, shape), tp, outputs=[save], what=what,
                        arm=key)
            left_out = ((lambda key=key, title=step.title(): self.copies_left_out(key, title))
                        if traffic == "copies" else None)
            lanes[key].append(Job(step, argv, save[:-5] + ".txt", left_out=left_out))
        if not s.overlap:  # no arm swept before both are ready: each lane waits for both
            self.run_lanes([], startup)
        self.run_lanes([lanes["off"], lanes["on"]], startup, gates=["off", "on"])
        self.tp_against_first(tp)
        self.against_earlier(tp, folder)
        cost = os.path.join(self.run_dir, "cost.json")
        for workload in WORKLOADS:
            argv = self.lab(*cost_options(s, workload, tp, cost))
            step = Step("cost, %s" % workload, tp, outputs=[cost],
                        what="the flag's overhead, %s workload, both arms alone" % workload)
            self.run_step(step, argv, cost[:-5] + ".txt")
        self.stop_arms_after_steps(tp, last)

    def stop_arms_after_steps(self, tp: int, last: bool) -> None:
        """The arms' stop once every step of a degree has ended. A stop signal that comes
        meanwhile (the natural Ctrl-C of a user who sees the steps done) waits until they are
        down: after the last degree the run's every step has ended and it stays whole (said,
        and nothing more is started: no picture); before another degree, the run stops
        there, its first line saying so."""
        came: List[int] = []
        previous = {s: signal.signal(s, lambda signum, frame: came.append(signum))
                    for s in SIGNAL_EXITS}
        try:
            self.stop_arms(" of TP %d, every step of it ended" % tp)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        if not came:
            return
        if last:
            self.late_stop = str(Stopped(came[0]))
            say("%s came while the arms stopped after the last step: every step had ended, so "
                "the run is whole; nothing more is started" % self.late_stop)
            return
        self.stopped_during = "the arms were stopping after every step of TP %d" % tp
        raise Stopped(came[0])

    def sweeps(self) -> List[Tuple[str, str, str, Optional[str], str]]:
        """The sweeps of one degree (SWEEPS, the copies sweeps only with COPIES=on)."""
        return [sweep for sweep in SWEEPS if sweep[2] != "copies" or self.settings.copies]

    def against_earlier(self, tp: int, folder: str) -> None:
        """BASELINE: each flag-on sweep of this degree again, against the earlier run's
        matching one as its --baseline (batch 1 compared too), saved as STEM_vs_baseline."""
        s = self.settings
        for stem, key, traffic, _, shape in self.sweeps():
            earlier = earlier_sweep(s, tp, stem) if key == "on" else None
            if earlier is None:
                continue
            save = os.path.join(folder, stem + "_vs_baseline.json")
            argv = self.lab(*against_earlier_options(s, traffic, earlier, save))
            step = Step("flag-on sweep, %s, against BASELINE" % shape, tp, outputs=[save],
                        what="every completion against the earlier run's batch 1, bit for bit")
            self.run_step(step, argv, save[:-5] + ".txt")

    def plan(self, degrees: List[int]) -> int:
        """How many steps a run at these degrees takes: each degree's sweeps and two cost
        cells, a TP comparison from the second degree on, the comparisons with BASELINE,
        and the pictures."""
        steps = sum(len(self.sweeps()) + 2 for _ in degrees) + max(0, len(degrees) - 1)
        steps += sum(1 for tp in degrees for stem, key, *_ in self.sweeps()
                     if key == "on" and earlier_sweep(self.settings, tp, stem))
        return steps + (len(degrees) + 1 if degrees and have_matplotlib() else 0)

    def tp_against_first(self, tp: int) -> None:
        """TP invariance of batch 1: the flag-on arm at this degree against the first degree's
        flag-on batch 1 (its saved sweep as --baseline), once there is a first degree."""
        first = self.first_tp
        if first is None:
            self.first_tp = tp
            return
        baseline = os.path.join(self.run_dir, "tp%d" % first, "sweep_on.json")
        if not os.path.exists(baseline):
            return
        s = self.settings
        save = os.path.join(self.run_dir, "tp%d" % tp, "tp%d_vs_tp%d.json" % (tp, first))
        argv = self.lab(*versus_options(s, baseline, save))
        step = Step("TP %d against TP %d, batch 1, flag on" % (tp, first), tp, outputs=[save],
                    what="batch 1 against the first degree's, bit for bit", arm="on")
        self.run_step(step, argv, save[:-5] + ".txt")

    def pictures(self) -> None:
        if not have_matplotlib():
            say("no matplotlib, no pictures (pip install matplotlib)")
            return
        for tp in self.settings.degrees:
            folder = os.path.join(self.run_dir, "tp%d" % tp)
            sweeps = [os.path.join(folder, "sweep_%s.json" % k) for k in ("off", "on")]
            sweeps = [p for p in sweeps if os.path.exists(p)]
            if sweeps:
                png = os.path.join(folder, "sweep.png")
                self.run_step(
                    Step("sweep picture", tp, lab=False, outputs=[png]),
                    [sys.executable, os.path.join(HERE, "plot_sweep.py"), *sweeps, "-o", png],
                    os.devnull,
                )
        cost = os.path.join(self.run_dir, "cost.json")
        if os.path.exists(cost):
            png = os.path.join(self.run_dir, "cost.png")
            self.run_step(
                Step("cost picture", 0, lab=False, outputs=[png]),
                [sys.executable, os.path.join(HERE, "plot_cost.py"), cost, "-o", png],
                os.devnull,
            )

    def run(self) -> None:
        places = {}
        for tp in self.settings.degrees:
            found = {arm: placement(arm, tp, self.env) for arm in ("off", "on")}
            if None in found.values():
                line = "TP %d skipped: GPUS=%s holds fewer than %d device(s)" % (
                    tp,
                    self.env.get("GPUS", "0"),
                    tp,
                )
                say(line)
                self.skipped.append(line)
            else:
                places[tp] = found
        self.planned = self.plan(list(places))
        for i, (tp, found) in enumerate(places.items()):
            self.degree(tp, found, last=i == len(places) - 1)
        if not self.late_stop:  # a stop that came after the last step: nothing more starts
            self.pictures()
        if self.skipped and self.exit_code == 0:
            self.exit_code = EXIT_SKIPPED


# ----------------------------------------------------------------------------
# The report


def load(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def fmt(value, missing="-") -> str:
    if value is None:
        return missing
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or missing
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def table(columns: List[str], rows: List[List[str]]) -> List[str]:
    """A Markdown table."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def command_output(argv: List[str], env: Dict[str, str], timeout: float = 60) -> str:
    """A command's first line of output, or "" when it cannot run here."""
    lines = subprocess_lines(argv, env, timeout)
    return lines[0].strip() if lines else ""


MODEL_SHAPE = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "vocab_size", "torch_dtype")  # config.json keys reported


# One Python for every version the report names: torch (imported, for its CUDA) and the
# engines (as installed), a line each; what is missing prints nothing
VERSIONS_PROBE = """
import importlib.metadata as metadata
for name in ("vllm", "sglang"):
    try:
        print(name, metadata.version(name))
    except metadata.PackageNotFoundError:
        pass
try:
    import torch
    print("torch", torch.__version__, torch.version.cuda)
except Exception:
    pass
"""


def environment(env: Dict[str, str]) -> List[Tuple[str, str]]:
    """What the report says of the machine, the software and the model, found while the
    first arm loads: the lab's version, the GPUs (model, count, driver, CUDA), torch and the
    engines as the experiment's Python has them, and the model's shape where its config.json
    is at hand."""
    found = [("lab", "run.py %s" % lab.lab_code()), ("host", socket.gethostname()),
             ("Python", sys.version.split()[0])]
    gpus = command_output(["nvidia-smi", "--query-gpu=name,driver_version",
                           "--format=csv,noheader"], env, 20)
    if gpus:
        listed = subprocess_lines(["nvidia-smi", "-L"], env)  # a line a device
        name, _, driver = gpus.partition(",")
        found += [("GPU", "%d x %s" % (len(listed), name.strip()) if listed else name.strip()),
                  ("driver", driver.strip())]
        header = "\n".join(subprocess_lines(["nvidia-smi"], env))
        cuda = header.split("CUDA Version:")[1].split()[0] if "CUDA Version:" in header else ""
        found.append(("CUDA (driver)", cuda or "not reported"))
    else:
        found.append(("GPU", "none found (no nvidia-smi)"))
    versions = dict(line.split(" ", 1) for line in subprocess_lines(
        [sys.executable, "-c", VERSIONS_PROBE], env, timeout=60) if " " in line)
    found.append(("torch", "%s (CUDA %s)" % tuple(versions["torch"].split()[:2])
                  if len(versions.get("torch", "").split()) > 1
                  else "not importable by the experiment's Python"))
    for engine in ("vllm", "sglang"):  # as the experiment's Python has it installed
        if engine in versions:
            found.append(("%s installed" % engine, versions[engine]))
    if not any(engine in versions for engine in ("vllm", "sglang")):
        found.append(("engine installed", "none found by the experiment's Python (neither vllm "
                      "nor sglang): arms of your own, or the practice engine"))
    model = env.get("MODEL", "")
    config = load(os.path.join(model, "config.json")) if model and os.path.isdir(model) else None
    if model:
        found.append(("model", model))
    if config:
        shape = ", ".join("%s %s" % (k, config[k]) for k in MODEL_SHAPE if k in config)
        found.append(("model shape", "%s: %s" % (fmt(config.get("architectures")), shape)))
    return found


def subprocess_lines(argv: List[str], env: Dict[str, str], timeout: float = 20) -> List[str]:
    try:
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line for line in p.stdout.splitlines() if line.strip()] if p.returncode == 0 else []


# The environment variables that hold a key the lab or an engine uses: run.py's (and every
# OpenAI client's) and vLLM's documented one (`vllm serve` reads VLLM_API_KEY)
KEY_VARIABLES = ("OPENAI_API_KEY", "VLLM_API_KEY")
# Where a key stands in text an engine writes, just before its value: a key option or
# variable (--api-key K, --api-key=K, VLLM_API_KEY=K), a field of a logged argument list
# (SGLang 0.5.23's `server_args={... 'api_key': 'K' ...}`, a Namespace's api_key='K', vLLM's
# list of keys api_key=['K1', 'K2'] after the first), an option's later keys (vLLM's
# --api-key K1 K2) or a header (Authorization: Bearer K)
KEY_STANDS_BEFORE = re.compile(  # api_key=K, 'api_key': ['K'] or ('K',), --api-k K1 K2, ...
    r"(?i)(?:(?:api[_-]?k(?:ey?)?|authorization)['\"]?\s*[:=]?\s*"
    r"(?:[\[(]\s*(?:(?:'[^']*'|\"[^\"]*\"|\[api key\])\s*,\s*)*)?['\"]?(?:bearer\s+)?"
    r"|--api[_-]k(?:ey?)?(?:\s+[^\s-]\S*)+\s+|bearer\s+)$")
KEY_CONTEXT = 200  # how far before a key its option or field is looked for
TOKEN_CHARACTERS = "_-.+/="  # a key's neighbours that would make it part of a longer token
# The characters bash's printf %q writes with a backslash before them (bash 5.2, a key of
# printable characters; and # or ~ as its first): how the launch scripts log a command
SHELL_ESCAPED = frozenset(" \t!\"$&'()*,;<>?[\\]^`{|}")


# How bash's printf %q writes a character in its $'...' form (bash 5.2, lib/sh/strtrans.c's
# ansic_quote): these with a backslash, another that the locale cannot print as octal bytes
ANSI_C_ESCAPES = {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r",
                  "\t": "\\t", "\v": "\\v", "\x1b": "\\E", "\\": "\\\\", "'": "\\'"}


def ansi_c_quoted(key: str, utf8: bool) -> str:
    """The inside of bash's printf %q form $'...' of a key, under a C locale (every byte
    beyond ASCII as octal: $'Zq9x\\303\\251') or a UTF-8 one (a character it prints kept)."""
    def char(c: str) -> str:
        if c in ANSI_C_ESCAPES:
            return ANSI_C_ESCAPES[c]
        if c.isprintable() and (c.isascii() or utf8):
            return c
        if utf8 and not c.isascii() and c.isspace():  # a no-break space: printed as it is
            return c
        return "".join("\\%03o" % b for b in c.encode("utf-8", "surrogateescape"))
    return "".join(char(c) for c in key)


def key_forms(key: str) -> Tuple[List[str], List[str]]:
    """Every form a key takes in what an engine or a shell writes, from the key itself:
    (the forms without quotes around them, the quoted forms). As given; quoted for the shell
    (shlex.quote, and as bash's printf %q writes it: backslash-escaped, or $'...' with octal
    bytes for a key beyond printable ASCII: a launch line); as Python writes it, in either
    quote style (SGLang's logged server_args, a Namespace); as JSON writes it (with and
    without non-ASCII escaped); URL-encoded (a logged URL or query). A form is hidden
    without its quotes where it has any, so that what stands around it stays."""
    def python_literal(quote: str) -> str:
        return quote + "".join("\\" + c if c == quote else repr(c)[1:-1] for c in key) + quote

    escaped = "".join("\\" + c if c in SHELL_ESCAPED or (i == 0 and c in "#~") else c
                      for i, c in enumerate(key))
    quoted = {shlex.quote(key), python_literal("'"), python_literal('"'), json.dumps(key),
              json.dumps(key, ensure_ascii=False)}
    bare = {key, escaped, urllib.parse.quote(key, safe=""), urllib.parse.quote_plus(key)}
    bare |= {f[1:-1] for f in quoted if len(f) > 1 and f[0] in "'\"" and f[-1] == f[0]}
    if not (key.isascii() and key.isprintable()):
        for utf8 in (False, True):
            inside = ansi_c_quoted(key, utf8)
            bare.add(inside)
            quoted.add("$'%s'" % inside)
    return sorted(bare, key=len, reverse=True), sorted(quoted - bare, key=len, reverse=True)


def inner_word(word: str) -> str:
    """A word of the string a shell runs, quoted for it so that the string, quoted in turn,
    still reads: in double quotes where they need no escape (--api-key "[api key]",
    VLLM_API_KEY="[api key]"), else as shlex quotes it."""
    if shlex.quote(word) == word:
        return word
    name, equals, value = word.partition("=")
    if equals and name.isidentifier():
        return name + "=" + inner_word(value)
    return '"%s"' % word if not any(c in word for c in '"$`\\!') else shlex.quote(word)


class Keys:
    """The API keys a run was given, kept out of every line said and every file written, by
    where they stand and with their own value known, never by rewriting the experiment's own
    values: from OPENAI_API_KEY and VLLM_API_KEY, an --api-key in any variable (a serve
    command's own, SGLang's --api-key included), and a key variable set in a serve command
    (env VLLM_API_KEY=K vllm serve ...), in the string a shell runs too (sh -c '...'). A
    command shows the key option's value and a key variable's as [api key]
    (lab.key_free_command's rule, for run.py's commands and the engines': an engine's
    --api-key takes several keys, and --api_key is --api-key, as vLLM reads them); text an
    engine writes (its log, as the experiment writes it; a launch line read as the command it
    is) and a step's failure line have a known key hidden where a key stands
    (KEY_STANDS_BEFORE), and a key long enough to be told from other text (lab.Secrets)
    wherever it stands, each in every form it takes (key_forms: quoted for the shell,
    written by Python or JSON, URL-encoded). EXTRA_ARGS is read as the launch
    scripts pass it too (split at blanks, quotes kept)."""

    LAUNCH_OPTIONS: Tuple[str, ...] = ()  # an engine's options are not known here: any
    # abbreviation of --api-key in a launch command is taken for it

    def __init__(self, env: Dict[str, str]):
        commands = []
        for name in ("SWEEP_ARGS", "COST_ARGS", "EXTRA_ARGS", "SERVE_OFF", "SERVE_ON"):
            try:
                commands.append(shlex.split(env.get(name, "")))
            except ValueError:
                continue
        # EXTRA_ARGS as the launch scripts pass it to the engine: split at blanks, its quotes
        # and backslashes kept (--api-key q'uo\te is the engine's key q'uo\te)
        commands.append(env.get("EXTRA_ARGS", "").split())
        keys = {env.get(name, "") for name in KEY_VARIABLES}

        def collect(words: List[str]) -> None:
            at = shell_string_at(words)
            for i, (word, shown) in enumerate(zip(words, self.command(words, launch=True))):
                if i == at:  # the keys in the string a shell runs too (sh -c '... --api-key K')
                    try:
                        collect(shlex.split(word))
                    except ValueError:
                        pass
                elif shown == "[api key]":
                    keys.add(word)
                elif shown.endswith("=[api key]"):
                    keys.add(word.split("=", 1)[1])

        for words in commands:
            collect(words)
        # each key in every form it takes (key_forms), hidden as itself: those without quotes
        # first, so that a logged 'api_key': '...' keeps its quotes
        given = sorted((k for k in keys if k), key=len, reverse=True)
        forms = [key_forms(key) for key in given]
        bare = sorted({f for each, _ in forms for f in each}, key=len, reverse=True)
        self.keys = list(dict.fromkeys(bare + sorted(
            (f for _, quoted in forms for f in quoted), key=len, reverse=True)))
        # anywhere: a long form without its quotes (in every quoted form there is one); a
        # short key's quoted form is longer than the key, and still hidden only where it stands
        self.secrets = lab.Secrets()
        self.secrets.keep(*bare)
        self.lab_options = list(lab.build_parser()._option_string_actions)

    def command(self, words: List[str], launch: bool = False) -> List[str]:
        """A command as the report may show it: run.py's (launch=False) or an engine's, a key
        variable's value hidden too (VLLM_API_KEY=K before the engine's command). An engine's
        is read as vLLM reads it (--api_key, several keys after --api-key:
        lab.key_free_command), and the string a shell runs in it (sh -c '...') as the
        command it is, shown with the rest of it; one that is not shell words is not shown."""
        options = self.LAUNCH_OPTIONS if launch else getattr(self, "lab_options", [])
        at = shell_string_at(list(words)) if launch else None
        shown = []
        for i, word in enumerate(lab.key_free_command(words, options, engine=launch)):
            name = word.split("=", 1)[0]
            assignment = "=" in word and name in KEY_VARIABLES and i != at
            shown.append(name + "=[api key]" if assignment else word)
        if at is not None and shown[at] == words[at]:
            try:
                inner = shlex.split(words[at])
            except ValueError:
                shown[at] = "(not shown: not shell words)"
            else:
                hidden = self.command(inner, launch)
                shown[at] = words[at] if hidden == inner else " ".join(
                    inner_word(w) for w in hidden)
        return shown

    def line(self, text: str, launch: bool = False) -> str:
        """A shell line (a variable's value, a logged launch command) as the report may show
        it; one that is not shell words is shown only where it holds no option at all."""
        try:
            words = shlex.split(text)
        except ValueError:
            return text if "--" not in text else "(not shown: not shell words)"
        redacted = self.command(words, launch)
        return text if redacted == words else " ".join(shlex.quote(w) for w in redacted)

    def launch_line(self, text: str) -> str:
        """A launch script's line in an engine's log ("launch: CUDA_VISIBLE_DEVICES=0 ...
        vllm serve ... --api-key K1 K2"): the command read as shell words, its keys hidden
        where they stand (command), then as any text an engine writes (engine_text)."""
        body = text.rstrip("\r\n")
        ending = text[len(body):]
        try:
            words = shlex.split(body[len("launch: "):])
        except ValueError:
            return self.engine_text(text)
        shown = self.command(words, launch=True)
        if shown != words:
            body = "launch: " + " ".join(shlex.quote(w) for w in shown)
        return self.engine_text(body) + ending

    def engine_text(self, text: str) -> str:
        """Text an engine wrote (a log line), each known key hidden where a key stands, and a
        long enough key wherever it stands."""
        text = self.secrets.hide(text)
        for key in self.keys:
            parts, end = [], 0
            at = text.find(key)
            while at >= 0:
                after = text[at + len(key): at + len(key) + 1]
                before = text[max(0, at - KEY_CONTEXT):at]
                if (KEY_STANDS_BEFORE.search(before) and not (before[-1:].isalnum())
                        and not (after.isalnum() or (after and after in TOKEN_CHARACTERS))):
                    parts += [text[end:at], "[api key]"]
                    end = at + len(key)
                at = text.find(key, at + len(key))
            text = "".join(parts) + text[end:]
        return text


SERVER_COLUMNS = ["arm", "engine", "version", "model", "flag", "attention backend", "TP",
                  "graph sizes", "known hazards"]


def server_row(arm: str, server: dict) -> List[str]:
    hazards = server.get("hazards")
    if hazards is None:
        known = "unknown (settings not known)"
    else:
        known = "; ".join(str(h.get("setting", "?")) for h in hazards if isinstance(h, dict))
        known = known or "none known"
    flag = {True: "on", False: "off"}.get(server.get("flag"), "unknown")
    return [arm, fmt(server.get("engine")), fmt(server.get("version")), fmt(server.get("model")),
            flag, fmt(server.get("attention_backend")), fmt(server.get("tp")),
            fmt(server.get("graph_sizes")), known]


SWEEP_COLUMNS = ["sweep", "verdict", "unique completions", "max ULP", "first moved",
                 "prefix-cache bypass", "batch 1 run to run", "checks", "state"]


def summary_of(doc: Optional[dict]) -> dict:
    sm = (doc or {}).get("summary")
    return sm if isinstance(sm, dict) else {}


def first_moved(doc: dict) -> str:
    """Where a sweep first moved, as its verdict read it: the summary's first_moved (the
    smallest batch size whose computed requests moved, and how). None saved: nothing the
    verdict compared moved; where answers moved all the same (in requests the cache served),
    it says so, never "nowhere"."""
    sm = summary_of(doc)
    first = sm.get("first_moved")
    if isinstance(first, dict) and isinstance(first.get("batch"), int):
        step = first.get("step")
        return "%s at batch %d%s" % (fmt(first.get("what")), first["batch"],
                                     ", step %d" % step if isinstance(step, int) else "")
    if moved(doc):
        return "not in any request the sweep compared (only where the cache served)"
    return "nowhere"


def moved(doc: Optional[dict]) -> bool:
    """Did any answer of the sweep leave batch 1's, compared or not (the saved counts: more
    than one completion, or a ULP above 0)?"""
    sm = summary_of(doc)
    unique, ulp = sm.get("unique_completions"), sm.get("max_ulp")
    return (isinstance(unique, int) and unique > 1) or (isinstance(ulp, (int, float))
                                                        and ulp > 0)


def check_outcome(doc: Optional[dict], check: str) -> Optional[str]:
    """A check's outcome as run.py decided and saved it (the summary's checks_outcome: held,
    moved, uncompared or stopped; run.Verdict.outcome); None where the sweep saved none."""
    outcomes = summary_of(doc).get("checks_outcome")
    found = outcomes.get(check.replace(" ", "_")) if isinstance(outcomes, dict) else None
    return found if found in (lab.CHECK_HELD, lab.CHECK_MOVED, lab.CHECK_UNCOMPARED,
                              lab.CHECK_STOPPED) else None


def sweep_moved(doc: Optional[dict]) -> bool:
    """Did the sweep move, by its saved verdict (anything but invariant that compared
    something: tokens, logprobs, text, a batch 1 that did not repeat) or its saved counts
    (moved())?"""
    found = summary_of(doc).get("verdict")
    said = isinstance(found, str) and found != lab.INVARIANT and not found.startswith(
        tuple(lab.UNMEASURED_VERDICTS))
    return said or moved(doc)


def check_verdicts(doc: Optional[dict]) -> List[Tuple[str, str]]:
    """Every check the sweep ran, with its verdict, as saved: each check's summary holds its
    verdict under NAME_verdict (prefill, neighbours, observer, cache_check, ...)."""
    sm = summary_of(doc)
    return [(key[: -len("_verdict")].replace("_", " "), fmt(value))
            for key, value in sm.items()
            if key.endswith("_verdict") and key != "verdict" and value is not None]


def expect_said(doc: Optional[dict]) -> str:
    """What a sweep's --expect came to, as run.py saved it (its line: "expect invariant: held
    (...)" or "expectation failed: ..."), or "" where it asked none or did not complete."""
    expect = summary_of(doc).get("expect")
    said = expect.get("said") if isinstance(expect, dict) else None
    return said if isinstance(said, str) else ""


def sweep_row(name: str, doc: dict) -> List[str]:
    sm = summary_of(doc)
    shown = []
    for check, verdict in check_verdicts(doc):
        ulp = sm.get("%s_max_ulp" % check.replace(" ", "_"))  # where the check saved one
        shown.append("%s: %s%s" % (check, verdict, " (max ULP %s)" % fmt(ulp)
                                   if isinstance(ulp, (int, float)) else ""))
    checks = "; ".join(shown) or "none run"
    control = {True: "repeatable", False: "NOT repeatable"}.get(sm.get("batch1_repeatable"),
                                                                 "no control")
    bypass = sm.get("prefix_cache_bypass")
    if isinstance(bypass, dict):
        held = fmt(bypass.get("status"))
        if bypass.get("hit_sizes"):
            held += " (cache hits at %s)" % fmt(bypass.get("hit_sizes"))
    else:
        held = "kept"
    unique = "%s of %s" % (fmt(sm.get("unique_completions")), fmt(sm.get("total_completions")))
    return [name, fmt(sm.get("verdict")), unique, fmt(sm.get("max_ulp")), first_moved(doc),
            held, control, checks, fmt(sm.get("state"))]


def cost_text(cell: Optional[dict]) -> str:
    """A cell of the 2x2 table: the overhead and its interval, or missing."""
    if cell is None:
        return "missing"
    overhead, ci = cell.get("overhead_pct"), cell.get("ci95_pct")
    if not isinstance(overhead, (int, float)):
        return "no overhead (%s)" % fmt(cell.get("state"))
    text = "%+.1f %%" % overhead
    if isinstance(ci, list) and len(ci) == 2 and all(isinstance(x, (int, float)) for x in ci):
        text += " [%+.1f, %+.1f]%s" % (ci[0], ci[1], "" if cell.get("significant") else " n.s.")
    else:
        text += " (no interval)"
    if cell.get("state") != "complete":
        text += " (%s)" % fmt(cell.get("state"))
    return text


def cost_table(cells: List[dict], degrees: List[int]) -> List[str]:
    """The 2x2 table TP=1 and each real degree, cold and shared-prefix, every cell with its
    interval and the missing ones said missing: one table for each group of cells that
    run.py's cell identity (lab.cell_key) tells apart in anything but TP and the workload,
    headed by that identity in run.py's words. Where a group holds two cells of one TP and
    workload (two prefix lengths), the later one in the file is shown."""
    groups: Dict[object, List[dict]] = {}
    for cell in cells:
        groups.setdefault(lab.cell_key(cell).table_group(), []).append(cell)
    lines = []
    for group, same in groups.items():
        lines += ["%s:" % group.text(), ""]
        rows = []
        tps = [c.get("tp") for c in same if isinstance(c.get("tp"), int)]
        for tp in sorted(set([1] + degrees + tps)):
            found = {w: next((c for c in reversed(same)
                              if c.get("tp") == tp and c.get("workload") == w), None)
                     for w in WORKLOADS}
            rows.append(["TP=%d" % tp] + [cost_text(found[w]) for w in WORKLOADS])
        if degrees == [1]:
            rows.append(["TP=k", "missing (your real TP degree)", "missing"])
        lines += table([""] + list(WORKLOADS), rows) + [""]
    if not groups:
        lines += ["No cost cell was measured in this run (see the first line and the steps).",
                  ""]
    return lines


# The settings a report names, where they are set.
REPORTED_VARIABLES = ("GPUS", "TP", "MEM", "MODEL", "BACKEND", "MAX_MODEL_LEN", "RADIX_CACHE",
                      "EXTRA_ARGS", "SWEEP_ARGS", "COST_ARGS", "OFF_PORT", "ON_PORT", "COPIES")


def stamp(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def ran_to_its_end(step: Step) -> Optional[dict]:
    """The summary a lab step saved, where it ran to its end and only its --expect did not
    hold (exit 1, its saved result complete, its saved expect not held): a negative result,
    not an incomplete run. None otherwise."""
    if not step.lab or step.exit_code != lab.EXIT_EXPECTATION or not step.outputs:
        return None
    sm = summary_of(load(step.outputs[0]))
    expect = sm.get("expect")
    if sm.get("state") != "complete" or not isinstance(expect, dict) or expect.get("held") \
            is not False:
        return None
    return sm


def expect_uncompared(step: Step) -> bool:
    """Did a step's --expect fail on what the sweep could not compare, not on a move? Its
    saved verdict claims nothing either way, or its --expect invariant failed where nothing
    moved (the run-to-run control compared nothing: unknown is not different)."""
    doc = load(step.outputs[0])
    expect = summary_of(doc).get("expect") or {}
    return sweep_uncompared(doc) or (expect.get("asked") == "invariant"
                                     and not sweep_moved(doc))


def sweep_uncompared(doc: Optional[dict]) -> bool:
    """Did the sweep compare nothing, by its saved verdict (one of run.py's verdicts that claim
    nothing either way: no data, nothing compared, the cache served everything)?"""
    found = summary_of(doc).get("verdict")
    return isinstance(found, str) and found.startswith(tuple(lab.UNMEASURED_VERDICTS))


def status_line(exp: Experiment) -> str:
    """The report's first line: whether the run is whole, and if not, why. Its word: complete
    (every step ran, every --expect held, the flag-on arm moved nowhere and every flag-on result
    compared something); INCOMPLETE (a step failed or did not finish, an arm exited, a degree
    was skipped, a signal stopped it, a step saved no whole result); else NOT AS EXPECTED
    (every step ran to its end, and an --expect did not hold or the flag-on arm moved); else
    INCONCLUSIVE (every step ran, nothing moved, but a flag-on result compared nothing)."""
    why, incomplete, negative = [], False, False
    if exp.stopped_by and exp.exit_code not in SIGNAL_EXITS.values():  # else the exit says it
        why.append("stopped by %s" % exp.stopped_by)
    if exp.failure:  # an arm's exit, with the steps it stopped said once, after it
        by_arm = [step.title() for step in exp.steps if step.note == ARM_STOPPED]
        why.append(exp.failure + ("; the step%s it stopped: %s" % (
            "s" if len(by_arm) > 1 else "", ", ".join(by_arm)) if by_arm else ""))
    if exp.unwritten:
        why.append(exp.unwritten)
    incomplete = bool(why or exp.stopped_by)

    def was_stopped(step: Step) -> bool:  # by the signal: running when it came, or its code
        return bool(exp.stopped_by) and (any(step is s for s in exp.stopped_steps)
                                         or step.exit_code == exp.exit_code)

    stopped = [step.title() for step in exp.steps if was_stopped(step)]
    if stopped:  # stopped by the signal the exit code names: said once, with the steps
        why.append("the step%s it stopped: %s" % ("s" if len(stopped) > 1 else "",
                                                  ", ".join(stopped)))
    elif exp.stopped_by:
        why.append("no step was running when it came: %s" % (exp.stopped_during or "-"))
    uncompared = list(exp.uncompared)
    uncompared_off: List[str] = []  # a flag-off step's: named after every flag-on one (below)
    for step in exp.steps:
        if was_stopped(step) or (exp.failure and step.note == ARM_STOPPED):
            continue
        if step.exit_code not in (0, None) or (step.exit_code is None and step.note):
            said = "%s: %s%s" % (step.title(), step.note or "did not finish",
                                 " (%s)" % step.reason if step.reason else "")
            ended = ran_to_its_end(step)
            if ended is None:
                incomplete = True
                why.append(said)
            elif expect_uncompared(step):  # its --expect failed on what it could not compare
                (uncompared if step.arm == "on" else uncompared_off).append(said)
            else:
                negative = True
                why.append(said)
    incomplete = incomplete or bool(exp.skipped or exp.unsaved)
    negative = negative or bool(exp.judged)
    why += exp.skipped + exp.unsaved + exp.judged
    # INCONCLUSIVE says "a flag-on result compared nothing": the flag-on ones named first
    uncompared += uncompared_off
    engine = exp.settings.engine
    if not why and not uncompared and exp.exit_code == 0:
        return ("# Batch-invariance experiment, %s: complete, every step ran and every "
                "--expect held" % engine)
    why += ["compared nothing: %s" % line for line in uncompared]
    if incomplete or (not negative and not uncompared):
        word = "INCOMPLETE"
    elif negative:  # every step ran to its end: a negative result, not an incomplete run
        word = "NOT AS EXPECTED"
    else:
        word = "INCONCLUSIVE"
    return "# Batch-invariance experiment, %s: %s (exit %d, %s): %s" % (
        engine, word, exp.exit_code, exit_meaning(exp.exit_code),
        "; ".join(why) or "see the steps below")


def reported_tp(doc: Optional[dict]) -> Optional[int]:
    """The TP degree a saved sweep's server reported (None: not reported)."""
    server = (doc or {}).get("server")
    found = server.get("tp") if isinstance(server, dict) else None
    return found if isinstance(found, int) and not isinstance(found, bool) else None


def tp_compared(exp: Experiment, tp: int, versus: Optional[dict]) -> Optional[str]:
    """Whether a TP-against-TP sweep compared across TP, as the servers report it: None where
    both degrees' flag-on arms reported the TP asked (or did not report it: not known is not
    different), else why it compared nothing across TP."""
    first = exp.first_tp if exp.first_tp is not None else exp.settings.degrees[0]
    baseline = load(os.path.join(exp.run_dir, "tp%d" % first, "sweep_on.json"))
    said = [(asked, reported_tp(doc)) for asked, doc in ((tp, versus), (first, baseline))]
    wrong = ["TP %d asked, the server reports TP %d" % (asked, found)
             for asked, found in said if found is not None and found != asked]
    if not wrong:
        return None
    return "; ".join(wrong)


def judge(exp: Experiment) -> None:
    """What the saved files say beyond the steps' exit codes: a lab step that exited 0 must
    have saved a whole result (else exp.unsaved), the flag-on arm must have moved in no shape
    (a sweep with no --expect, copies in one request, moves with exit 0) and in no check a
    sweep ran (its saved NAME_verdict: the prefill check's, the observer check's, ...; the
    sweep's --expect invariant reads only its batches) (else exp.judged), and every flag-on
    result must have compared something, a TP-against-TP sweep across the TP degrees the
    servers report (else exp.uncompared: nothing compared is never held). Each is a reason in
    the report's first line; where the run had no exit code yet, a step that saved no whole
    result or a move makes it 1, a flag-on result that compared nothing EXIT_UNCOMPARED."""
    for step in exp.steps:
        if not step.lab or step.exit_code != 0:
            continue
        for path in step.outputs:
            doc = load(path)
            where = os.path.relpath(path, exp.run_dir)
            if doc is None:
                exp.unsaved.append("%s: exit 0, but nothing saved in %s" % (step.title(), where))
            elif "summary" in doc and summary_of(doc).get("state") != "complete":
                exp.unsaved.append("%s: exit 0, but %s is %s" % (
                    step.title(), where, fmt(summary_of(doc).get("state"))))
    expect_failed = {step.outputs[0] for step in exp.steps if step.outputs
                     and ran_to_its_end(step) is not None}  # said with their step
    for tp in exp.settings.degrees:
        folder = os.path.join(exp.run_dir, "tp%d" % tp)
        for stem, key, traffic, expect, shape in SWEEPS:
            if key != "on":
                continue
            path = os.path.join(folder, stem + ".json")
            doc = load(path)
            sweep = "flag-on sweep, %s (TP %d)" % (shape, tp)
            if path in expect_failed:
                pass  # its --expect said what moved, or that it compared nothing, with its step
            elif sweep_moved(doc):
                sm = summary_of(doc)
                exp.judged.append(
                    "the flag-on arm moved, %s (TP %d): %s, %s unique of %s, max ULP %s, first "
                    "moved: %s" % (shape, tp, fmt(sm.get("verdict")),
                                   fmt(sm.get("unique_completions")),
                                   fmt(sm.get("total_completions")), fmt(sm.get("max_ulp")),
                                   first_moved(doc)))
            elif sweep_uncompared(doc) and summary_of(doc).get("state") == "complete":
                said = "%s: %s" % (sweep, summary_of(doc)["verdict"])
                # copies the cache served compare nothing, and claim nothing either way: where
                # the concurrent sweep compared, it decides, and the copies sweep is named only
                if traffic == "copies" and concurrent_compared(folder):
                    exp.aside.append(said)
                else:
                    exp.uncompared.append(said)
            # every check the sweep ran, by its saved verdict: the sweep's --expect invariant
            # reads only its batches, so a check that moved leaves its exit code 0
            for check, verdict in check_verdicts(doc):
                outcome = check_outcome(doc, check)
                if outcome in (lab.CHECK_UNCOMPARED, lab.CHECK_STOPPED):
                    exp.uncompared.append("%s, %s check: %s" % (sweep, check, verdict))
                elif outcome == lab.CHECK_MOVED:
                    exp.judged.append("the flag-on arm's %s check moved, %s (TP %d): %s"
                                      % (check, shape, tp, verdict))
        for name in versus_files(folder, tp):
            versus = load(os.path.join(folder, name))
            across = tp_compared(exp, tp, versus)
            if across and summary_of(versus).get("state") == "complete":
                exp.uncompared.append("TP against TP, batch 1, flag on (`%s`), across TP: %s"
                                      % (name, across))
    if (exp.judged or exp.unsaved) and exp.exit_code == 0:
        exp.exit_code = lab.EXIT_EXPECTATION
    if exp.uncompared and exp.exit_code == 0:
        exp.exit_code = EXIT_UNCOMPARED
    failed = [step for step in exp.steps if step.exit_code not in (0, None)]
    if (exp.exit_code == lab.EXIT_EXPECTATION and failed and not (exp.judged or exp.unsaved)
            and all(ran_to_its_end(step) is not None and expect_uncompared(step)
                    for step in failed)):
        # every --expect that failed, failed on what its sweep could not compare, not on a
        # move: the run is inconclusive, and its exit code says so, not "an --expect failed"
        exp.exit_code = EXIT_UNCOMPARED


def concurrent_compared(folder: str) -> bool:
    """Did the flag-on concurrent sweep of a degree compare, as it saved it (whole, and a
    verdict that claims something)?"""
    doc = load(os.path.join(folder, "sweep_on.json"))
    return summary_of(doc).get("state") == "complete" and not sweep_uncompared(doc)


def versus_files(folder: str, tp: int) -> List[str]:
    """The TP-against-TP sweeps saved at one degree (tpN_vs_tpM.json)."""
    if not os.path.isdir(folder):
        return []
    return [name for name in sorted(os.listdir(folder))
            if name.startswith("tp%d_vs_tp" % tp) and name.endswith(".json")]


def findings(exp: Experiment) -> List[str]:
    """One line per sweep and degree: what each arm showed, in words a post can quote."""
    lines = []
    for tp in exp.settings.degrees:
        folder = os.path.join(exp.run_dir, "tp%d" % tp)
        for stem, key, traffic, expect, shape in SWEEPS:
            doc = load(os.path.join(folder, stem + ".json"))
            if doc is None:
                continue
            sm = doc.get("summary") if isinstance(doc.get("summary"), dict) else {}
            reported = reported_tp(doc)
            degree = "TP %d" % tp if reported in (None, tp) else (
                "TP %d asked, the servers report TP %s" % (tp, reported))
            line = "- %s, flag %s, %s: **%s**, %s unique of %s, max ULP %s" % (
                degree, key, shape, fmt(sm.get("verdict")), fmt(sm.get("unique_completions")),
                fmt(sm.get("total_completions")), fmt(sm.get("max_ulp")))
            rate = rate_text(sm.get("moved"))
            if rate:
                line += "; moved from the baseline: %s" % rate
            if key == "off" or moved(doc):
                line += ", first moved: %s" % first_moved(doc)
            for check, verdict in check_verdicts(doc):
                line += "; %s: %s" % (check, verdict)
            said = expect_said(doc)
            if said:
                line += "; %s" % said
            if sm.get("state") != "complete":
                line += " (the sweep did not complete: %s)" % fmt(sm.get("state"))
            lines.append(line + ".")
    lines = lines or ["- No sweep was saved."]
    # the copies sweeps: left out, known to compare cold prefills, or named beside the verdict
    lines += ["- %s." % line for line in exp.left_out + exp.copies_compared]
    lines += ["- Not counted in the verdict: %s (the cache served the copies; the concurrent "
              "sweeps, which compared, decide)." % line for line in exp.aside]
    return lines


def against_earlier_findings(exp: Experiment) -> List[str]:
    """BASELINE: what each flag-on sweep run against the earlier run's found, as run.py's
    saved verdict names both sides; a flag-on sweep the earlier run has no match for, said."""
    s = exp.settings
    if not s.baseline:
        return []
    lines = ["", "## Against the earlier run (BASELINE)", "",
             "Each flag-on sweep again, its baseline the earlier run's matching sweep "
             "(`%s`): batch 1 and every other size compared with that run's batch 1." % s.baseline,
             ""]
    for tp in s.degrees:
        for stem, key, _, _, shape in SWEEPS:
            if key != "on" or (stem.startswith("copies") and not s.copies):
                continue
            if earlier_sweep(s, tp, stem) is None:
                lines.append("- TP %d, %s: the earlier run has no such sweep (`tp%d/%s.json`)."
                             % (tp, shape, tp, stem))
                continue
            doc = load(os.path.join(exp.run_dir, "tp%d" % tp, stem + "_vs_baseline.json"))
            said = (doc or {}).get("baseline") if isinstance(doc, dict) else None
            verdict = said.get("verdict") if isinstance(said, dict) else None
            lines.append("- TP %d, %s: %s." % (tp, shape, verdict or "no comparison saved (see "
                                                "the step's output)"))
    return lines


def rate_text(saved) -> Optional[str]:
    """A count of moved against compared with the interval run.py saved beside it ("0 of 132
    computed completions (95% CI 0-2.8%)"); None where the file holds none."""
    if not isinstance(saved, dict):
        return None
    try:
        return lab.Rate(**saved).text("computed completions")
    except (TypeError, ValueError):
        return None


# ----------------------------------------------------------------------------
# Upstream's own determinism tests: what each compares, and whether this run covered its shape

VLLM_READ = "vLLM 0.34.0"  # its source release (vllm/_version.py: commit g62d4bc3c7)
SGLANG_READ = "SGLang 0.5.23"  # its wheel (sglang/test/, python/sglang/test/ in the repository)
VLLM_TESTS = "tests/v1/determinism/"
SGLANG_TESTS = "python/sglang/test/"
RELEASES_READ = {"vllm": VLLM_READ, "sglang": SGLANG_READ}


@dataclasses.dataclass(frozen=True)
class UpstreamTest:
    """One of the engines' own determinism tests (or a mode of SGLang's driver), as read at
    its release, with the shape a saved sweep must have to cover it. Every field of the
    shape is one a sweep saves (its params, and the arm the experiment pointed it at)."""

    engine: str  # "vllm" or "sglang", as a saved sweep names its engine
    label: str  # the shape, in the lab's words
    name: str  # the test, or the driver's mode, as upstream names it
    source: str  # file:line of the test (or mode), at its engine's release (VLLM_READ, ...)
    lines: str  # the lines of what it compares, in the same file
    compares: str  # what it compares, in the lab's words
    arm: str = "on"  # the flag it runs with
    sizes: Tuple[int, int] = (1, 1)  # the smallest and the largest batch size it compares
    traffic: Tuple[str, ...] = ()  # the lab's traffic shapes of its batches (): any
    sampled: Optional[bool] = None  # True: seeded sampling; False: greedy; None: either
    logprobs: bool = True  # it compares logprobs (False: the text only)
    check: str = ""  # the lab's check it needs, by the name its saved params give it
    chunked: bool = False  # a prompt whose prefill crosses the chunked-prefill budget


# Read at the releases above, each at its file and lines. Left out: vLLM's
# test_simple_generation (it compares nothing), test_online_fp8_moe_logprobs_bitwise_bs1_vs_bsN
# (one FP8 MoE model, test_batch_invariance.py:969; the known hazards name FP8 MoE experts) and
# the kernel tests of tests/v1/determinism/, which send no request.
UPSTREAM_TESTS = (
    UpstreamTest(
        "vllm", "offline, batch 1 against N", "test_logprobs_bitwise_batch_invariance_bs1_vs_bsN",
        VLLM_TESTS + "test_batch_invariance.py:173", "prompts 197, sampling 202-208",
        "32 short prompts each alone, then all 32 in one batch; tokens and logprobs bit for "
        "bit; seeded sampling at T 0.6, 16 tokens", sizes=(1, 32), sampled=True),
    UpstreamTest(
        "vllm", "offline, chunked prefill",
        "test_logprobs_bitwise_batch_invariance_ragged_chunked_prefill",
        VLLM_TESTS + "test_batch_invariance.py:385",
        "prompts 389-394, budget 402, sampling 408-410, comparison 431-448",
        "14 prompts of 10 to 1200 words each alone, then together, under a token budget of half "
        "the longest, whose prefill is chunked; tokens and logprobs; T 0.6 seeded, 16 tokens",
        sizes=(1, 14), sampled=True, chunked=True),
    UpstreamTest(
        "vllm", "offline, needle among fillers",
        "test_v1_generation_is_deterministic_across_batch_sizes_with_needle",
        VLLM_TESTS + "test_batch_invariance.py:34", "sampling 88-97, batches 120-130",
        "one short prompt alone, then at a random place among 64 to 128 long ones, 5 batches; "
        "text only; greedy, 128 tokens", sizes=(1, 64), traffic=("mixed",), sampled=False,
        logprobs=False),
    UpstreamTest(
        "vllm", "offline, flag off must differ",
        "test_logprobs_without_batch_invariance_should_fail",
        VLLM_TESTS + "test_batch_invariance.py:507",
        "flag off 518-520, prompts 538-551, sampling 553-559, verdict 702-714",
        "flag off: 32 prompts of 10 to 3072 words each alone, then together; passes only if a "
        "token or logprob differs; T 0.6 seeded, 8 tokens", arm="off", sizes=(1, 32),
        sampled=True),
    UpstreamTest(
        "vllm", "offline, decode against prefill", "test_decode_logprobs_match_prefill_logprobs",
        VLLM_TESTS + "test_batch_invariance.py:721", "prompts 750-751, sampling 756-760, "
        "prefill 785-853",
        "4 prompts, greedy, 16 tokens; each decoded token's logprob against a prefill of its "
        "prefix, bit for bit", check="prefill_check"),
    UpstreamTest(
        "vllm", "offline, decode beside prefill chunks",
        "test_sliding_window_logprobs_bitwise_alone_vs_mixed_batch",
        VLLM_TESTS + "test_batch_invariance.py:1020", "prompts 1035-1036, budget 1047, "
        "comparison 1063-1069",
        "Gemma-2 only: 4 prompts alone, then beside 4 long ones whose prefill is chunked at 256 "
        "tokens; tokens and logprobs; greedy, 16 tokens", check="neighbours"),
    UpstreamTest(
        "vllm", "online, batch 1 against N", "test_logprobs_bitwise_batch_invariance_bs1_vs_bsN",
        VLLM_TESTS + "test_online_batch_invariance.py:138",
        "prompts 142, sampling 144-150, comparison 106-133",
        "32 short prompts to a server, each in a request of its own, then all 32 in one request; "
        "tokens and logprobs bit for bit; T 0.6 seeded, 8 tokens", sizes=(1, 32),
        traffic=("copies",), sampled=True),
    UpstreamTest(
        "sglang", "single", "test_single",
        SGLANG_TESTS + "test_deterministic_utils.py:53", "53-63; its single mode: "
        "test_deterministic.py 461-471",
        "one prompt as 1 to 20 copies in one request; the text of each batch's first completion "
        "only (test_deterministic.py 106, 181-182); greedy (T 0.5 is set at line 61, after the "
        "run), 100 tokens", sizes=(1, 20), traffic=("copies",), sampled=False, logprobs=False),
    UpstreamTest(
        "sglang", "prefix", "test_prefix_with_logprobs",
        SGLANG_TESTS + "test_deterministic_utils.py:65", "65-76; its prefix mode: "
        "test_deterministic.py 473-558",
        "batches of 10 to 19 prompts drawn from 4 prefixes of one text, a cache flush before "
        "each; one text per prefix asserted, logprobs printed (511-556), not asserted; T 0.5 "
        "seeded", sizes=(10, 19), traffic=("mixed",), sampled=True, logprobs=False),
    UpstreamTest(
        "sglang", "p_vs_d", "--test-mode p_vs_d",
        SGLANG_TESTS + "test_deterministic.py:719",
        "719-724 and 259-315; a driver mode no test of test_deterministic_utils.py runs",
        "batches of 1 to --n-trials (50) prompts; each sequence's tokens and logprobs against a "
        "prefill of prompt and output, exact; greedy by default (line 38)",
        check="prefill_check"),
    UpstreamTest(
        "sglang", "radix_cache", "--test-mode radix_cache",
        SGLANG_TESTS + "test_deterministic.py:560",
        "560-717; a driver mode no test of test_deterministic_utils.py runs",
        "one 100-token prompt and a token it generated: the next token from a cached prefill "
        "against the same after a flush, logprob exact", check="cache_check"),
)

# a check's name in a saved sweep's params, and in its summary's checks_outcome
CHECK_OUTCOME_NAMES = {"prefill_check": "prefill", "cache_check": "cache_check",
                       "neighbours": "neighbours"}


def saved_sweeps(exp: Experiment) -> List[Tuple[str, str, dict]]:
    """Every sweep the run saved in SWEEPS' files, at every degree: (its path in the run's
    folder, the arm the experiment pointed it at, its document)."""
    found = []
    for tp in exp.settings.degrees:
        for stem, key, *_ in SWEEPS:
            name = "tp%d/%s.json" % (tp, stem)
            doc = load(os.path.join(exp.run_dir, name))
            if doc is not None:
                found.append((name, key, doc))
    return found


def sizes_text(sizes: List[int]) -> str:
    return "%d to %d" % (min(sizes), max(sizes)) if sizes else "none"


def shape_misses(test: UpstreamTest, doc: dict) -> Tuple[List[str], List[str]]:
    """What a saved sweep lacks of an upstream test's shape, and what of it the sweep did not
    save (unknown is not lacking), in words, each read from what the sweep saved (its params,
    its summary's state, verdict and check outcomes); ([], []) where it covers it."""
    params = doc.get("params") if isinstance(doc.get("params"), dict) else {}
    misses: List[str] = []
    unknown: List[str] = []
    sizes = [n for n in params.get("sizes") or [] if isinstance(n, int)]
    low, high = test.sizes
    if not sizes or min(sizes) > low or max(sizes) < high:
        misses.append("sizes %s, not %d to %d" % (sizes_text(sizes), low, high)
                      if high > low else "no batch %d" % low)
    traffic = params.get("traffic")
    if test.traffic and traffic not in test.traffic:
        misses.append("%s traffic, not %s" % (fmt(traffic), " or ".join(test.traffic)))
    temperature = params.get("temperature")
    if test.sampled is not None:
        if not isinstance(temperature, (int, float)):
            unknown.append("its temperature")
        elif (temperature > 0) != test.sampled:
            misses.append("greedy, not seeded sampling" if test.sampled
                          else "sampled at T %g, not greedy" % temperature)
        elif test.sampled and params.get("seed_honoured") is False:
            misses.append("sampled unseeded (the server ignores the seed)")
    asked = params.get("logprobs")
    if test.logprobs and (not isinstance(asked, int) or asked < 1):
        misses.append("no logprobs asked")
    if test.chunked:
        long_prompt = params.get("prompt_tokens")
        chunks = long_prompt.get("prefill_chunks") if isinstance(long_prompt, dict) else None
        if not isinstance(long_prompt, dict):
            misses.append("no --prompt-tokens prompt to cross the chunked-prefill budget")
        elif not isinstance(chunks, int):
            unknown.append("its prompt's chunks (the server did not say its budget)")
        elif chunks < 2:
            misses.append("its prompt fits one chunk of the chunked-prefill budget")
    if test.check:
        outcome = check_outcome(doc, CHECK_OUTCOME_NAMES[test.check])
        if not params.get(test.check):
            misses.append("no --%s" % test.check.replace("_", "-"))
        elif outcome is None:  # unknown is not uncompared: a sweep of an older lab
            unknown.append("its %s's outcome" % test.check.replace("_", " "))
        elif outcome not in (lab.CHECK_HELD, lab.CHECK_MOVED):
            misses.append("its %s compared nothing (%s)" % (test.check.replace("_", " "),
                                                            outcome))
    state = summary_of(doc).get("state")
    if state != "complete":
        misses.append("did not complete (%s)" % fmt(state))
    elif not test.check and sweep_uncompared(doc):
        misses.append("compared nothing (%s)" % fmt(summary_of(doc).get("verdict")))
    return misses, unknown


def coverage(test: UpstreamTest, sweeps: List[Tuple[str, str, dict]]) -> str:
    """Whether the run covered an upstream test's shape: "yes" and the sweeps that did; "not
    known" where the closest sweep lacks nothing but what it did not save; else "no", and what
    the closest sweep of its engine and arm lacked."""
    mine = [(name, doc) for name, key, doc in sweeps
            if key == test.arm and doc.get("engine") == test.engine]
    if not mine:
        return "no: no flag-%s sweep of %s was saved" % (test.arm, test.engine)
    judged = [(shape_misses(test, doc), name) for name, doc in mine]
    covered = ["`%s`" % name for (misses, unknown), name in judged if not misses + unknown]
    if covered:
        return "yes: " + ", ".join(covered)
    (misses, unknown), name = min(judged, key=lambda found: (len(found[0][0]),
                                                             len(found[0][1])))
    if not misses:
        return "not known: `%s` did not save %s" % (name, "; ".join(unknown))
    return "no: closest `%s`: %s" % (name, "; ".join(misses + ["not saved: " + u
                                                                for u in unknown]))


def beyond_upstream(exp: Experiment, sweeps: List[Tuple[str, str, dict]]) -> str:
    """One line: what the run's saved results measured that the upstream tests do not, each
    from the sweeps saved whole (and the cost cells), said per arm where it differs."""
    whole = [(key, doc) for _, key, doc in sweeps if summary_of(doc).get("state") == "complete"]
    said = []
    sizes = sorted({n for _, doc in whole for n in (doc.get("params") or {}).get("sizes") or []
                    if isinstance(n, int)})
    if len(sizes) > 1:
        ulps = ["flag %s %s" % (key, fmt(max(found)))
                for key in ("off", "on") for found in [[
                    summary_of(doc).get("max_ulp") for k, doc in whole if k == key
                    and isinstance(summary_of(doc).get("max_ulp"), (int, float))]] if found]
        said.append("%d batch sizes from %s, each against batch 1, with every logprob's "
                    "float32 ULP distance (largest: %s)" % (len(sizes), sizes_text(sizes),
                                                             ", ".join(ulps) or "none saved"))
    if any(rate_text(summary_of(doc).get("moved")) for _, doc in whole):
        said.append("an exact 95 % interval on each count of completions that moved")
    if any(summary_of(doc).get("batch1_repeatable") is not None for _, doc in whole):
        said.append("batch 1 repeated as the run-to-run control")
    bypass = [summary_of(doc).get("prefix_cache_bypass") for _, doc in whole]
    statuses = sorted({fmt(b.get("status")) for b in bypass if isinstance(b, dict)})
    if statuses:
        said.append("the prefix cache's evidence for each request (bypass: %s)"
                    % ", ".join(statuses))
    said += sorted({"%s, flag %s: %s" % (check, key, verdict)
                    for key, doc in whole for check, verdict in check_verdicts(doc)})
    cost = load(os.path.join(exp.run_dir, "cost.json")) or {}
    cells = [c for c in cost.get("cells") or [] if isinstance(c, dict)]
    if cells:
        said.append("the flag's cost (%d cell%s)" % (len(cells), "" if len(cells) == 1 else "s"))
    if not said:
        return "Beyond them: nothing, no sweep or cost cell was saved whole."
    return "Beyond them, this run measured: %s." % "; ".join(said)


def upstream_coverage(exp: Experiment) -> List[str]:
    """REPORT.md's table of the engines' own determinism tests (UPSTREAM_TESTS) of the engine
    the run measured: what each compares, where it was read, and whether a saved sweep of
    this run had its shape; then one line of what the run measured beyond them."""
    sweeps = saved_sweeps(exp)
    engines = ({doc.get("engine") for _, _, doc in sweeps} & set(RELEASES_READ)
               or {exp.settings.engine})
    tests = [t for t in UPSTREAM_TESTS if t.engine in engines]
    read = {"vllm": VLLM_READ + " (its source release)", "sglang": SGLANG_READ + " (its wheel)"}
    lines = ["## Upstream's own determinism tests, and this run", "",
             "Read at %s; a shape is covered where a sweep this run saved had it, as its saved "
             "parameters and outcome say." % " and ".join(read[e] for e in sorted(engines)
                                                          if e in read), ""]
    lines += table(["upstream test", "where read", "what it compares", "this run"], [
        ["%s %s: `%s`" % ({"vllm": "vLLM", "sglang": "SGLang"}[t.engine], t.label, t.name),
         "`%s` (%s), %s" % (t.source, t.lines, RELEASES_READ[t.engine]), t.compares,
         coverage(t, sweeps)] for t in tests])
    return lines + ["", beyond_upstream(exp, sweeps), ""]


def served(exp: Experiment) -> List[Tuple[str, str]]:
    """What the arms themselves said, from the first degree's saved sweeps (else the cost
    cells' servers): the engine and its version, and the model where MODEL did not start both
    arms (a launch command of one's own serves what it says, whatever MODEL is)."""
    found = []
    named = exp.env.get("MODEL") and set(exp.settings.model_arms) == {"off", "on"}
    cost = load(os.path.join(exp.run_dir, "cost.json")) or {}
    cells = [c for c in cost.get("cells") or [] if isinstance(c, dict)]
    from_cost = [c["servers"][key] for c in cells[:1] if isinstance(c.get("servers"), dict)
                 for key in ("off", "on") if isinstance(c["servers"].get(key), dict)]
    for tp in exp.settings.degrees:
        folder = os.path.join(exp.run_dir, "tp%d" % tp)
        docs = [load(os.path.join(folder, stem + ".json")) for stem, *_ in SWEEPS[:2]]
        servers = [d["server"] for d in docs if d and isinstance(d.get("server"), dict)]
        if servers:
            break
    else:
        servers = from_cost
    if servers:
        versions = sorted({"%s %s" % (fmt(sv.get("engine")), fmt(sv.get("version")))
                           for sv in servers})
        found.append(("engine (as the arms report it)", "; ".join(versions)))
        if not named:
            models = sorted({fmt(sv.get("model")) for sv in servers})
            found.append(("model (as the arms report it)", "; ".join(models)))
    elif not named:
        found.append(("model", "not known: %s, and no sweep or cost cell saved what the arms "
                      "serve" % ("no MODEL" if not exp.env.get("MODEL") else
                                 "MODEL started no arm (SERVE_OFF and SERVE_ON are your own)"
                                 if not exp.settings.model_arms else
                                 "MODEL is only the flag-%s arm's (its launch script "
                                 "reads it)"
                                 % exp.settings.model_arms[0])))
    return found


def since(exp: Experiment, moment: Optional[float]) -> str:
    """A moment of the run as minutes and seconds after its start."""
    if moment is None:
        return "-"
    seconds = max(0, int(round(moment - exp.started)))
    return "+%d:%02d" % (seconds // 60, seconds % 60)


def duration(first: Optional[float], last: Optional[float]) -> str:
    return "%.0f s" % (last - first) if first is not None and last is not None else "-"


def start_up_seconds(exp: Experiment) -> Optional[float]:
    """The arms' start-up, as the run spent it: at each degree from the first arm's start to
    the last one's ready (arms that share a device load one after the other, so theirs add
    up; arms on their own devices overlap), summed over the degrees; None where an arm never
    became ready."""
    total = 0.0
    for tp in sorted({tp for tp, _ in exp.arm_times}):
        arms = [arm for degree, arm in exp.arm_times if degree == tp]
        if any(arm.started_at is None or arm.ready_at is None for arm in arms):
            return None
        total += max(arm.ready_at for arm in arms) - min(arm.started_at for arm in arms)
    return total if exp.arm_times else None


def time_spent(exp: Experiment) -> List[str]:
    """Where the run's time went: each arm's start and ready, the whole run against the
    arms' start-up, and every step's start and duration."""
    lines = ["## Where the time went", ""]
    wall = (exp.ended or time.time()) - exp.started
    start_up = start_up_seconds(exp)
    if start_up:
        lines += ["The whole run took %.0f s; the arms' start-up %.0f s of it (at each degree, "
                  "from the first arm's start to the last one's ready): %.2f times the "
                  "start-up." % (wall, start_up, wall / start_up), ""]
    else:
        lines += ["The whole run took %.0f s." % wall, ""]
    if exp.arm_times:  # none where no degree could be placed
        lines += table(["TP", "arm", "started", "ready", "start-up"], [
            [str(tp), arm.key, since(exp, arm.started_at), since(exp, arm.ready_at),
             duration(arm.started_at, arm.ready_at)]
            for tp, arm in exp.arm_times]) + [""]
    return lines


def report(exp: Experiment) -> str:
    """REPORT.md: what was found and how, from the files the steps saved, in an order a reader
    can paste: the status, the findings, the cost table, the environment, the launch commands,
    the parameters, then each degree's servers and sweeps, and every step."""
    keys = Keys(exp.env)
    # EXTRA_ARGS as the engines read it (several keys after --api-key, --api_key), the
    # others as run.py reads them
    settings = ["%s=%s%s" % (k, keys.line(exp.env[k], launch=k == "EXTRA_ARGS"),
                             " (not used: SERVE_OFF and SERVE_ON started the arms)"
                             if k == "MODEL" and not exp.settings.model_arms else "")
                for k in REPORTED_VARIABLES if exp.env.get(k)]
    lines = [status_line(exp), "",
             "Started %s, ended %s. Output: `%s`." % (stamp(exp.started),
                                                      stamp(exp.ended or time.time()),
                                                      exp.run_dir), ""]
    if exp.late_stop:
        lines += ["%s came while the arms stopped after the last step: every step had ended, "
                  "so the run is whole; nothing more was started (no picture)." % exp.late_stop,
                  ""]
    lines += ["## Findings", ""] + findings(exp)
    cost = load(os.path.join(exp.run_dir, "cost.json"))
    cells = [c for c in (cost or {}).get("cells") or [] if isinstance(c, dict)]
    lines += against_earlier_findings(exp)
    lines += ["", "## The flag's cost", ""]
    lines += cost_table(cells, exp.settings.degrees)
    lines += ["One cell alone is not a result: the 2x2 table is TP 1 and your real TP degree, "
              "cold and shared-prefix. Brackets: 95 % interval of the median paired ratio.", ""]
    lines += upstream_coverage(exp)
    lines += ["## Environment", ""] + table(["what", "value"],
                                               [[k, v] for k, v in exp.environment + served(exp)])
    lines += ["", "## How the arms were started", ""]
    for key in ("off", "on"):
        tried = [arm for _, arm in exp.arm_times if arm.key == key and arm.started_at]
        for line in exp.launched.get(key) or []:
            lines += ["flag %s:" % key, "", "```", keys.line(line, launch=True), "```", ""]
        if exp.launched.get(key):
            continue
        if tried:  # its command could not be run (the first line says why): as given
            lines += ["flag %s: its command could not be started:" % key, "", "```",
                      keys.line(" ".join(shlex.quote(w) for w in exp.settings.serve[key]),
                                launch=True), "```", ""]
        else:  # never started: no launch line that would start another model than asked
            lines += ["flag %s: not started (the run ended before its turn)." % key, ""]
    lines += ["## Parameters", "", "Variables: %s." % (", ".join(settings) or "the defaults"), ""]
    lab_steps = [step for step in exp.steps if step.lab and step.argv]
    if lab_steps:
        lines += ["Lab commands, as run:", "", "```"]
        lines += [" ".join(shlex.quote(w) for w in ["run.py"] + keys.command(step.argv[2:]))
                  for step in lab_steps]
        lines += ["```", ""]
    for tp in exp.settings.degrees:
        folder = os.path.join(exp.run_dir, "tp%d" % tp)
        if not os.path.isdir(folder):
            continue
        docs = {stem: load(os.path.join(folder, stem + ".json")) for stem, *_ in SWEEPS}
        lines += ["## TP %d" % tp, ""]
        servers = [(key, docs[stem]) for stem, key, *_ in SWEEPS[:2] if docs[stem]]
        if servers:
            lines += ["### Servers", ""]
            lines += table(SERVER_COLUMNS, [server_row("flag " + key, doc.get("server") or {})
                                            for key, doc in servers])
            lines += ["", "### Sweeps", ""]
            lines += table(SWEEP_COLUMNS, [sweep_row("flag %s, %s" % (key, shape), docs[stem])
                                           for stem, key, _, _, shape in SWEEPS if docs[stem]])
            lines.append("")
        logs = ["`tp%d/server_%s.log`" % (tp, key) for key in ("off", "on")
                if os.path.exists(os.path.join(folder, "server_%s.log" % key))]
        if not servers:
            lines += ["No sweep was saved at TP %d: what the arms served is not known (see the "
                      "first line%s)." % (tp, ", and the logs" if logs else ""), ""]
        lines += ["Logs: %s." % ", ".join(logs) if logs
                  else "No arm's log at TP %d: no arm was started." % tp]
        for name in versus_files(folder, tp):
            versus = load(os.path.join(folder, name))
            sm = summary_of(versus)
            across = tp_compared(exp, tp, versus)
            found = "%s, max ULP %s" % (fmt(sm.get("verdict")), fmt(sm.get("max_ulp")))
            lines += ["", "TP invariance of batch 1 (flag on, `%s`): %s." % (
                name, "compared nothing across TP (%s); batch 1 against batch 1: %s"
                % (across, found) if across else found)]
        if os.path.exists(os.path.join(folder, "sweep.png")):
            lines += ["", "![sweeps at TP %d](tp%d/sweep.png)" % (tp, tp)]
        lines.append("")
    if os.path.exists(os.path.join(exp.run_dir, "cost.png")):
        lines += ["![cost cells](cost.png)", ""]
    if any(os.path.exists(os.path.join(exp.run_dir, *p)) for p in [("cost.png",)] + [
            ("tp%d" % tp, "sweep.png") for tp in exp.settings.degrees]):
        lines += ["The pictures are files beside this report (`tp*/sweep.png`, `cost.png`): "
                  "pasted elsewhere, attach them.", ""]
    lines += time_spent(exp)
    lines += ["## Steps", ""]
    if not exp.steps:
        return "\n".join(lines + ["No step ran."]) + "\n"
    lines += table(["#", "TP", "step", "started", "took", "exit", "meaning", "output"], [
        [str(step.number), str(step.tp or "-"), step.name, since(exp, step.started),
         duration(step.started, step.ended), fmt(step.exit_code, "not finished"),
         step.note + (": " + step.reason if step.reason else ""),
         saved_outputs(exp, step)]
        for step in exp.steps])
    return "\n".join(lines) + "\n"


def saved_outputs(exp: Experiment, step: Step) -> str:
    """A step's outputs, as the Steps table lists them: only the files that exist (a step
    stopped before it saved names none)."""
    found = [p for p in step.outputs if os.path.exists(p)]
    return ", ".join("`%s`" % os.path.relpath(p, exp.run_dir) for p in found) or "none saved"


# ----------------------------------------------------------------------------
# main


KEYS: Optional["Keys"] = None  # the keys main() was given, kept out of an engine's log lines


def say(line: str) -> None:
    """A line on stderr. A stderr that can no longer be written (`... 2>&1 | head`, a closed
    terminal) silences the lines, never the run: the steps go on and REPORT.md is written."""
    try:
        sys.stderr.write("experiment: %s\n" % line)
        sys.stderr.flush()
    except (OSError, ValueError):  # ValueError: the stream was closed
        pass


def new_run_dir(output: str) -> str:
    """A folder of this run's own under output, named by its start time. A folder that cannot
    be made (a full disk, one that may not be written) is said as that: nothing started."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        path = os.path.join(output, stamp if n == 1 else "%s-%d" % (stamp, n))
        try:
            os.makedirs(output, exist_ok=True)
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
        except OSError as err:
            raise UsageError("%s: the run's folder cannot be made there (%s): the disk or the "
                             "folder; nothing was started" % (output, err.strerror or err))
    raise UsageError("%s: no free run folder name for %s" % (output, stamp))


def failure_reason(stdout_path: str, err_path: str) -> str:
    """Why a lab step failed, in its own words: the --expect that did not hold, else its last
    line on stderr that is not progress, a warning or where it saved."""
    quiet = ("run.py: progress", "run.py: warning", "run.py: saved")
    for path, keep in ((stdout_path, lambda x: x.startswith("expectation failed")),
                       (err_path, lambda x: x and not x.startswith(quiet))):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                said = [x.strip() for x in f.read().splitlines() if keep(x.strip())]
        except OSError:
            said = []
        if said:  # a server's words in it (HTTP 401 ... Bearer K): a key hidden where it stands
            return (KEYS.engine_text(said[-1]) if KEYS is not None else said[-1])[:300]
    return ""


def write_report(path: str, text: str) -> str:
    """REPORT.md through a temporary file and a rename: whole or not there, never empty.
    Returns "" once it is written, else why it could not be (a full disk, a folder that may
    not be written): the report then goes to stdout only, its first line saying so."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as err:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return str(err.strerror or err)
    return ""


def print_report(text: str) -> None:
    """The report on stdout. A terminal whose encoding cannot take a character of it (a
    model path in another script, under an ISO-8859-1 locale) gets it with that character
    replaced, and a line on stderr says so: REPORT.md holds it whole."""
    try:
        text.encode(sys.stdout.encoding or "utf-8")
    except UnicodeEncodeError:
        say("the terminal's encoding (%s) cannot show every character of the report: shown "
            "with ? for those; %s holds it whole" % (sys.stdout.encoding, "REPORT.md"))
        text = text.encode(sys.stdout.encoding, "replace").decode(sys.stdout.encoding)
    except LookupError:  # an encoding Python does not know: its own error, not ours
        pass
    sys.stdout.write(text)
    sys.stdout.flush()


def raise_stopped(signum, frame):
    raise Stopped(signum)


def main(argv=None, env=None) -> int:
    global KEYS
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        sys.stdout.write(__doc__.lstrip() + "\n")
        return 0
    env = dict(os.environ if env is None else env)
    KEYS = Keys(env)
    try:
        settings = read_settings(argv, env)
        for name in KEY_VARIABLES:  # a key no request could carry, refused as run.py does
            if env.get(name):
                try:
                    lab.check_api_key(env[name])
                except lab.UsageError as err:
                    raise UsageError("%s: %s; nothing was started" % (name, err)) from None
        check_steps(settings, [sweep for sweep in SWEEPS
                               if sweep[2] != "copies" or settings.copies])
        for tp in settings.degrees:  # every variable checked before anything starts
            placement("off", tp, env)
        for arm, url in settings.urls.items():
            port = url_port(url)
            if not port_free(port):
                raise UsageError(
                    "port %d (the flag-%s arm, %s) is in use: stop what listens there, or "
                    "move the arm with %s_PORT=N (the launch script and the lab both follow "
                    "it); nothing was started" % (port, arm, url, arm.upper())
                )
        run_dir = new_run_dir(settings.output)
    except (UsageError, OSError) as err:
        say(str(err))
        return lab.EXIT_USAGE
    exp = Experiment(settings, env, run_dir)
    previous = {s: signal.signal(s, raise_stopped) for s in SIGNAL_EXITS}
    stopping = signal.SIGTERM  # how a step still running is stopped: as the experiment was
    try:
        exp.run()
    except ArmFailed as err:
        say(str(err))
        exp.failure = str(err)
        exp.exit_code = EXIT_ARM
    except OSError as err:  # the run's own folder (a step's output file, a degree's folder)
        exp.failure = "%s could not be written (%s): the disk or the folder, not a server" % (
            err.filename or run_dir, err.strerror or err)
        say(exp.failure)
        exp.exit_code = EXIT_DISK
    except Stopped as stop:
        exp.stopped()
        exp.stopped_by = str(stop)
        exp.exit_code = SIGNAL_EXITS[stop.signum]
        stopping = stop.signum
    finally:
        for s in SIGNAL_EXITS:  # the clean-up below is bounded; let nothing cut it short
            signal.signal(s, signal.SIG_IGN)
        exp.stop_steps(stopping)
        exp.stop_arms()
        exp.ended = time.time()
        if not exp.environment:  # no arm started: the report still says where it ran
            exp.environment = environment(exp.described_env())
        judge(exp)
        path = os.path.join(run_dir, "REPORT.md")
        text = report(exp)
        unwritten = write_report(path, text)
        if unwritten:  # its first line says so, and the exit code: the disk, not a server
            exp.unwritten = "%s could not be written (%s): the disk or the folder, not a " \
                "server; the report is only what was printed" % (path, unwritten)
            exp.exit_code = exp.exit_code or EXIT_DISK
            text = report(exp)
    if exp.stopped_by:
        say("stopped by %s" % exp.stopped_by)
    code = show_report(text, exp.exit_code, previous)
    if unwritten:
        say("%s could not be written (%s): the report above is the only one" % (path, unwritten))
    else:  # said only once it is there
        say("report: %s" % path)
    return code


def show_report(text: str, code: int, previous: Dict[int, object]) -> int:
    """Print the report once REPORT.md holds it, and give the stop signals back their previous
    handlers; returns the exit code. The run is over and its report written: a first stop
    signal now waits until the report is printed whole, so that what is printed is what
    REPORT.md says (its first line, its exit code), and is said on stderr; a second one cuts
    the print at once, exits with its code, and says that REPORT.md holds the report whole."""
    late: List[int] = []

    def defer(signum, frame):
        late.append(signum)
        if len(late) > 1:
            raise Stopped(signum)

    for s in SIGNAL_EXITS:
        signal.signal(s, defer)
    try:
        print_report(text)
    except (OSError, ValueError):  # the pipe closed: REPORT.md holds the report whole
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # nothing more to flush at exit, and no traceback
        os.close(devnull)
    except Stopped as stop:
        say("stopped by %s while the report was printed: REPORT.md holds it whole" % stop)
        code = SIGNAL_EXITS[stop.signum]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if len(late) == 1:
        say("%s came once the report was written: the run had ended, and the report was "
            "printed whole; the exit code is the report's" % Stopped(late[0]))
    return code


if __name__ == "__main__":
    sys.exit(main())
