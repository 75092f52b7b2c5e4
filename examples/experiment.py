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
  - Each arm's port must be free before anything starts: the lab must measure its own
    servers, not a leftover one.
  - Both arms are watched from launch to the end. An arm that exits stops every step at once,
    with one line naming it, its exit status and the end of its log.
  - TERM, INT and HUP stop the running step (the lab saves what it measured, marked with the
    signal's state) and both arms within seconds; the exit code is the signal's.
  - Between TP degrees both arms are restarted. A degree that GPUS cannot hold is skipped with
    one line; the others still run.

Variables (all optional):
  GPUS, TP, MEM, MODEL, BACKEND  the placement and the launch scripts' settings; TP takes a list
  MAX_MODEL_LEN, RADIX_CACHE     passed to the launch scripts (see vllm_serve.sh, sglang_serve.sh)
  EXTRA_ARGS                     more engine flags, the same for both arms
  SERVE_OFF, SERVE_ON  the commands that start each arm (default: this folder's launch script
                       for the engine, with PORT set); the practice engine, for a dry run:
                       SERVE_OFF="python3 tests/stub_server.py --port 8000"
                       SERVE_ON="python3 tests/stub_server.py --port 8001 --invariant"
  OFF_URL, ON_URL      where the arms answer (default the launch scripts' ports)
  WAIT                 seconds an arm may take to answer its health check (default 900)
  SWEEP_ARGS, COST_ARGS  extra options for both sweeps and for each cost cell

Exit codes: 0 every step ran and every --expect held; otherwise the first failing step's
code (run.py's: 1 an --expect did not hold, 3 a server failed, ...); 2 a malformed variable or
a busy port (nothing was started); 4 an arm exited, or was not ready within WAIT;
129, 130, 143 stopped by SIGHUP, SIGINT or SIGTERM.
"""

import dataclasses
import errno
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Dict, List, Optional

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
LOG_TAIL_LINES = 5  # lines of a dead arm's log quoted in its one-line message

EXIT_ARM = 4  # an arm exited, or was not ready within WAIT
SIGNAL_EXITS = {
    signal.SIGINT: lab.EXIT_INTERRUPTED,
    signal.SIGTERM: lab.EXIT_TERMINATED,
    signal.SIGHUP: lab.EXIT_HANGUP,
}  # what each stop signal exits with, as run.py
EXIT_MEANINGS = dict(lab.EXIT_CODES)  # exit code -> what it means, the lab's and the experiment's
EXIT_MEANINGS[EXIT_ARM] = "an arm exited, or was not ready in time"


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
        super().__init__(signal.Signals(signum).name)
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


def split_words(name: str, env: Dict[str, str]) -> List[str]:
    try:
        return shlex.split(env.get(name, ""))
    except ValueError as err:
        raise UsageError("%s: %s" % (name, err)) from None


def read_settings(argv: List[str], env: Dict[str, str]) -> Settings:
    if len(argv) != 2 or argv[0] not in ENGINE_PORTS:
        raise UsageError("usage: examples/experiment.sh vllm|sglang OUTPUT_FOLDER")
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
    for arm, port in zip(("off", "on"), ENGINE_PORTS[engine]):
        urls[arm] = env.get(arm.upper() + "_URL") or "http://localhost:%d" % port
        default = "env PORT=%d bash %s %s" % (
            port,
            shlex.quote(os.path.join(HERE, engine + "_serve.sh")),
            arm,
        )
        serve[arm] = split_words("SERVE_" + arm.upper(), env) or shlex.split(default)
    return Settings(
        engine=engine,
        output=output,
        degrees=list(dict.fromkeys(int(e) for e in entries)),
        serve=serve,
        urls=urls,
        wait_s=wait_s,
        sweep_args=split_words("SWEEP_ARGS", env),
        cost_args=split_words("COST_ARGS", env),
    )


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

    @property
    def name(self) -> str:
        return "the flag-%s arm" % self.key

    @property
    def devices(self) -> set:
        return set(self.env.get("CUDA_VISIBLE_DEVICES", "").split(","))

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            # A process group of its own: stopping it reaches the launch script, the engine
            # and the engine's workers; the terminal's Ctrl-C reaches only the experiment.
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )

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
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                lines = [line.strip() for line in f.read().splitlines() if line.strip()]
            tail = lines[-LOG_TAIL_LINES:]
        except OSError:
            tail = []
        return ArmFailed(
            "%s (%s) %s; the end of %s: %s"
            % (self.name, self.url, what, self.log_path, " | ".join(tail) or "(empty)")
        )

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
            self.process.poll()  # reap the leader, so that only live members count
            time.sleep(POLL_S)
        signal_group(self.process, signal.SIGKILL)
        self.process.wait()


def signal_group(process: subprocess.Popen, signum: int) -> bool:
    """Send signum to the process's group; False when no member of it is left."""
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member that changed its user; it is still there
        return True
    return True


def wait_ready(arms: List[Arm], watched: List[Arm], wait_s: float) -> None:
    """Until every arm of arms answers its health check; any watched arm that exits meanwhile
    fails at once."""
    deadline = time.monotonic() + wait_s
    waiting = list(arms)
    while waiting:
        for arm in watched:
            arm.check_running()
        for arm in list(waiting):
            if arm.healthy():
                say("%s is ready at %s" % (arm.name, arm.url))
                waiting.remove(arm)
        if waiting and time.monotonic() > deadline:
            raise waiting[0].failure("was not ready within %gs (WAIT)" % wait_s)
        if waiting:
            time.sleep(POLL_S)


def start_arms(arms: List[Arm], wait_s: float) -> None:
    """Arms on separate devices start together; arms that share one, one after the other."""
    off, on = arms
    if off.devices & on.devices:
        say(
            "the arms share device(s) %s: the flag-on arm starts once the flag-off arm is ready"
            % ",".join(sorted(off.devices & on.devices))
        )
        off.start()
        wait_ready([off], [off], wait_s)
        on.start()
        wait_ready([on], arms, wait_s)
    else:
        off.start()
        on.start()
        wait_ready(arms, arms, wait_s)


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


class Experiment:
    def __init__(self, settings: Settings, env: Dict[str, str], run_dir: str):
        self.settings, self.env, self.run_dir = settings, env, run_dir
        self.steps: List[Step] = []
        self.skipped: List[str] = []
        self.arms: List[Arm] = []
        self.step_process: Optional[subprocess.Popen] = None
        self.started = time.time()
        self.ended: Optional[float] = None
        self.exit_code = 0
        self.stopped_by: Optional[str] = None
        self.first_tp: Optional[int] = None  # the first degree measured: the others against it

    def lab(self, *args: str) -> List[str]:
        return [sys.executable, os.path.join(ROOT, "run.py")] + list(args)

    def run_step(self, step: Step, argv: List[str], stdout_path: str) -> None:
        """Run one lab command with its stdout in a file, watching both arms while it runs."""
        self.steps.append(step)
        with open(stdout_path, "a", encoding="utf-8") as stdout:
            self.step_process = subprocess.Popen(
                argv, stdout=stdout, stdin=subprocess.DEVNULL, start_new_session=True
            )
            try:
                while self.step_process.poll() is None:
                    self.check_arms()
                    time.sleep(POLL_S)
                step.exit_code = self.step_process.returncode
                self.check_arms()  # a step that failed because its arm died is the arm's failure
            except ArmFailed:
                step.note = "stopped: an arm exited"
                self.stop_step()
                raise
            self.step_process = None
        step.note = (
            exit_meaning(step.exit_code)
            if step.lab
            else "drawn" if step.exit_code == 0 else "failed"
        )
        say(
            "%s%s: exit %d, %s"
            % (step.name, " (TP %d)" % step.tp if step.tp else "", step.exit_code, step.note)
        )
        if step.exit_code != 0 and self.exit_code == 0:
            self.exit_code = step.exit_code

    def check_arms(self) -> None:
        for arm in self.arms:
            arm.check_running()

    def stop_step(self) -> None:
        """The lab's own stop: a first TERM stops it after the current request, a second at once;
        either way it saves what it measured, marked terminated."""
        process, self.step_process = self.step_process, None
        if process is None or process.poll() is not None:
            return
        for _ in range(2):
            signal_group(process, signal.SIGTERM)
            try:
                process.wait(timeout=STEP_GRACE_S)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            signal_group(process, signal.SIGKILL)
            process.wait()
        if self.steps and self.steps[-1].exit_code is None:
            self.steps[-1].exit_code = process.returncode
            if not self.steps[-1].note:
                self.steps[-1].note = exit_meaning(process.returncode)

    def stop_arms(self) -> None:
        for arm in self.arms:  # both at once; each then gets its grace
            if arm.process is not None:
                signal_group(arm.process, signal.SIGTERM)
        for arm in self.arms:
            arm.stop()
        self.arms = []

    def degree(self, tp: int, places: Dict[str, Dict[str, str]]) -> None:
        """Both arms at one TP degree: start them, sweep both, time both workloads, stop them."""
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
        say("TP %d: starting both arms (logs in %s)" % (tp, folder))
        start_arms(self.arms, s.wait_s)
        for key, expect in (("off", "variant"), ("on", "invariant")):
            save = os.path.join(folder, "sweep_%s.json" % key)
            argv = self.lab(
                "--mode",
                "sweep",
                "--engine",
                s.engine,
                "--url",
                s.urls[key],
                "--wait-ready",
                "60",
                "--prefill-check",
                "--expect",
                expect,
                "--save",
                save,
                *s.sweep_args
            )
            self.run_step(
                Step("flag-%s sweep" % key, tp, outputs=[save]), argv, save[:-5] + ".txt"
            )
        self.tp_against_first(tp)
        cost = os.path.join(self.run_dir, "cost.json")
        for workload in ("cold", "shared-prefix"):
            argv = self.lab(
                "--mode",
                "cost",
                "--engine",
                s.engine,
                "--url",
                s.urls["off"],
                "--invariant",
                s.urls["on"],
                "--wait-ready",
                "60",
                "--workload",
                workload,
                "--tp",
                str(tp),
                "--save",
                cost,
                *s.cost_args
            )
            self.run_step(
                Step("cost, %s" % workload, tp, outputs=[cost]), argv, cost[:-5] + ".txt"
            )
        self.stop_arms()

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
        argv = self.lab("--mode", "sweep", "--engine", s.engine, "--url", s.urls["on"],
                        "--wait-ready", "60", *s.sweep_args, "--baseline", baseline,
                        "--sizes", "1", "--repeat", "1", "--expect", "invariant", "--save", save)
        step = Step("TP %d against TP %d, batch 1, flag on" % (tp, first), tp, outputs=[save])
        self.run_step(step, argv, save[:-5] + ".txt")

    def pictures(self) -> None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
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
        for tp, found in places.items():
            self.degree(tp, found)
        self.pictures()


# ----------------------------------------------------------------------------
# The report


def load(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


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


SERVER_COLUMNS = ["arm", "engine", "version", "model", "flag", "attention backend", "TP",
                  "graph sizes", "known hazards"]


def server_row(arm: str, server: dict) -> List[str]:
    hazards = server.get("hazards")
    if hazards is None:
        known = "unknown (settings hidden)"
    else:
        known = "; ".join(h.get("setting", "?") for h in hazards) or "none known"
    flag = {True: "on", False: "off"}.get(server.get("flag"), "unknown")
    return [arm, fmt(server.get("engine")), fmt(server.get("version")), fmt(server.get("model")),
            flag, fmt(server.get("attention_backend")), fmt(server.get("tp")),
            fmt(server.get("graph_sizes")), known]


SWEEP_COLUMNS = ["arm", "verdict", "unique completions", "max ULP", "batch 1 run to run",
                 "decode vs prefill", "state"]


def sweep_row(arm: str, doc: dict) -> List[str]:
    sm = doc.get("summary") or {}
    prefill = "not measured"
    if sm.get("prefill_verdict"):
        prefill = "%s (max ULP %s)" % (sm["prefill_verdict"], fmt(sm.get("prefill_max_ulp")))
    control = {True: "repeatable", False: "not repeatable"}.get(sm.get("batch1_repeatable"),
                                                                 "no control")
    unique = "%s of %s" % (fmt(sm.get("unique_completions")), fmt(sm.get("total_completions")))
    return [arm, fmt(sm.get("verdict")), unique, fmt(sm.get("max_ulp")), control, prefill,
            fmt(sm.get("state"))]


COST_COLUMNS = ["TP", "workload", "trial", "pairs", "overhead", "95 % interval", "significant",
                "state"]


def cost_row(cell: dict) -> List[str]:
    ci = cell.get("ci95_pct")
    interval = "[%+.1f, %+.1f]" % tuple(ci) if isinstance(ci, list) and len(ci) == 2 else "-"
    overhead = cell.get("overhead_pct")
    if cell.get("concurrency"):
        trial = "load, %s streams" % cell["concurrency"]
    else:
        trial = "batch %s" % fmt(cell.get("batch"))
    return [fmt(cell.get("tp")), fmt(cell.get("workload")), trial, fmt(cell.get("trials")),
            "%+.1f %%" % overhead if isinstance(overhead, (int, float)) else "-", interval,
            fmt(cell.get("significant")), fmt(cell.get("state"))]


# The settings a report names, where they are set.
REPORTED_VARIABLES = ("GPUS", "TP", "MEM", "MODEL", "BACKEND", "MAX_MODEL_LEN", "RADIX_CACHE",
                      "EXTRA_ARGS", "SWEEP_ARGS", "COST_ARGS")


def stamp(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def report(exp: Experiment) -> str:
    """REPORT.md: what was found and how, from the files the steps saved."""
    settings = ["%s=%s" % (k, exp.env[k]) for k in REPORTED_VARIABLES if exp.env.get(k)]
    stopped = " Stopped by %s." % exp.stopped_by if exp.stopped_by else ""
    lines = ["# Batch-invariance experiment: %s" % exp.settings.engine, "",
             "Started %s, ended %s, on %s. Output: `%s`." % (
                 stamp(exp.started), stamp(exp.ended or time.time()), socket.gethostname(),
                 exp.run_dir), "",
             "Settings: %s." % (", ".join(settings) or "the defaults"), "",
             "**Result: exit %d, %s.**%s" % (exp.exit_code, exit_meaning(exp.exit_code), stopped),
             ""]
    lines += ["- %s" % line for line in exp.skipped] + ([""] if exp.skipped else [])
    for tp in exp.settings.degrees:
        folder = os.path.join(exp.run_dir, "tp%d" % tp)
        if not os.path.isdir(folder):
            continue
        docs = {arm: load(os.path.join(folder, "sweep_%s.json" % arm)) for arm in ("off", "on")}
        found = {arm: doc for arm, doc in docs.items() if doc}
        lines += ["## TP %d" % tp, "", "### Servers", ""]
        lines += table(SERVER_COLUMNS, [server_row("flag " + arm, doc.get("server") or {})
                                        for arm, doc in found.items()])
        lines += ["", "### Sweeps", ""]
        lines += table(SWEEP_COLUMNS, [sweep_row("flag " + arm, doc)
                                       for arm, doc in found.items()])
        lines += ["", "Logs: `tp%d/server_off.log`, `tp%d/server_on.log`." % (tp, tp)]
        lines += ["No sweep saved for the flag-%s arm." % arm for arm in docs if arm not in found]
        for name in sorted(os.listdir(folder)):
            if name.startswith("tp%d_vs_tp" % tp) and name.endswith(".json"):
                versus = load(os.path.join(folder, name)) or {}
                sm = versus.get("summary") or {}
                lines += ["", "TP invariance of batch 1 (flag on, `%s`): %s, max ULP %s." % (
                    name, fmt(sm.get("verdict")), fmt(sm.get("max_ulp")))]
        if os.path.exists(os.path.join(folder, "sweep.png")):
            lines += ["", "![sweeps at TP %d](tp%d/sweep.png)" % (tp, tp)]
        lines.append("")
    cost = load(os.path.join(exp.run_dir, "cost.json"))
    lines += ["## Cost of the flag", ""]
    if cost and cost.get("cells"):
        cells = sorted(cost["cells"], key=lambda c: (fmt(c.get("tp")), fmt(c.get("workload"))))
        lines += table(COST_COLUMNS, [cost_row(c) for c in cells])
        if os.path.exists(os.path.join(exp.run_dir, "cost.png")):
            lines += ["", "![cost cells](cost.png)"]
    else:
        lines.append("No cost cell was measured.")
    lines += ["", "## Steps", ""]
    lines += table(["TP", "step", "exit", "meaning", "output"], [
        [str(step.tp or "-"), step.name, fmt(step.exit_code, "not finished"), step.note,
         ", ".join("`%s`" % os.path.relpath(p, exp.run_dir) for p in step.outputs)]
        for step in exp.steps])
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------
# main


def say(line: str) -> None:
    sys.stderr.write("experiment: %s\n" % line)
    sys.stderr.flush()


def new_run_dir(output: str) -> str:
    """A folder of this run's own under output, named by its start time."""
    os.makedirs(output, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        path = os.path.join(output, stamp if n == 1 else "%s-%d" % (stamp, n))
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
    raise UsageError("%s: no free run folder name for %s" % (output, stamp))


def raise_stopped(signum, frame):
    raise Stopped(signum)


def main(argv=None, env=None) -> int:
    env = dict(os.environ if env is None else env)
    try:
        settings = read_settings(sys.argv[1:] if argv is None else argv, env)
        for tp in settings.degrees:  # every variable checked before anything starts
            placement("off", tp, env)
        for arm, url in settings.urls.items():
            port = url_port(url)
            if not port_free(port):
                raise UsageError(
                    "port %d (the flag-%s arm, %s) is in use: stop what listens there, or "
                    "set %s_URL; nothing was started" % (port, arm, url, arm.upper())
                )
        run_dir = new_run_dir(settings.output)
    except (UsageError, OSError) as err:
        say(str(err))
        return lab.EXIT_USAGE
    exp = Experiment(settings, env, run_dir)
    previous = {s: signal.signal(s, raise_stopped) for s in SIGNAL_EXITS}
    try:
        exp.run()
    except ArmFailed as err:
        say(str(err))
        exp.exit_code = EXIT_ARM
    except Stopped as stop:
        exp.stopped_by = str(stop)
        exp.exit_code = SIGNAL_EXITS[stop.signum]
    finally:
        for s in SIGNAL_EXITS:  # the clean-up below is bounded; let nothing cut it short
            signal.signal(s, signal.SIG_IGN)
        exp.stop_step()
        exp.stop_arms()
        exp.ended = time.time()
        text = report(exp)
        with open(os.path.join(run_dir, "REPORT.md"), "w", encoding="utf-8") as f:
            f.write(text)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if exp.stopped_by:
        say("stopped by %s" % exp.stopped_by)
    sys.stdout.write(text)
    say("report: %s" % os.path.join(run_dir, "REPORT.md"))
    return exp.exit_code


if __name__ == "__main__":
    sys.exit(main())
