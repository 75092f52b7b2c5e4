#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Batch-invariance lab: does your vLLM or SGLang server give the same answer for the
same prompt whatever else shares its batch, and what does it cost to make it so?

It measures, over plain HTTP with nothing but the standard library:
  1. unique completions across batch sizes, flag off (more than one: the bug, reproduced);
  2. the same count with the flag on (exactly one expected);
  3. the overhead the flag costs, for one model, backend, TP degree and workload;
  4. the largest float32 ULP distance between batch 1's per-step logprobs and every
     other batch's (token equality is the weaker claim).

Usage:

  python3 run.py --mode harness                      # upstream harnesses + commands, offline
  python3 run.py --mode harness --engine sglang      # one engine only
  python3 run.py --mode help                         # the five-minute guide
  python3 run.py --help                              # every option, the limits and exit codes
  python3 run.py --version                           # the version and the commit it runs from

  python3 run.py --mode sweep --engine vllm --url http://localhost:8000 \\
      --model Qwen/Qwen3-1.7B --max-batch 32 --save off.json
  python3 run.py --mode sweep --engine sglang --url http://localhost:30000 \\
      --sizes 1,15,16,17,23,24,25 --temperature 0.0
  python3 run.py --mode sweep --url http://localhost:8001 --expect invariant \\
      --baseline off.json
  python3 run.py --mode cost --url http://localhost:8000 \\
      --invariant http://localhost:8001 --batch 32 --trials 20 --save cost.json

  python3 run.py --mode sweep --url http://localhost:8000/v1 --traffic copies \\
      --repeat 5 --save copies.json                 # the upstream tests' shape, for comparison
  python3 run.py --mode sweep --url http://localhost:8001 --prefill-check \\
      --expect prefill-equal                        # decode versus prefill, for RL users
  python3 run.py --mode cost --url http://localhost:8000 --invariant http://localhost:8001 \\
      --concurrency 32 --precision 3                # throughput, TTFT, TPOT, ITL under load

No GPU at hand? Start the practice engine: python3 tests/stub_server.py --port 8000

Sections, in the order they appear:
  Constants            schemas, exit codes, limits, every shared default with why
  Records              as_record, the one writer of every saved record: a dataclass's fields
                       in order, renamed, left out when None or flattened in as saved() says
  Pure functions       float32 ULPs, comparable logprob pairs, completion comparison, ladders,
                       verdicts, statistics, workload prompts (no I/O)
  Transport            HttpClient (every request, guarded, one deadline an answer), Exchange (a
                       request in steps, so that many can go out at once), the Watchdog that
                       keeps every deadline and a stop signal's grace, the secrets never shown
  Engine adapters      Sampling, ServerFacts, the EngineAdapter protocol, VllmAdapter,
                       SglangAdapter, the known-hazards table, engine detection: all that is
                       known of each engine lives here; the prefix cache's evidence from the
                       server's own counters (cache_evidence, CounterWatch)
  Shared by the modes  output, progress, atomic saves, signals, the one map of exceptions to
                       exit codes (ending), waiting for servers, table headers, the settings
                       two servers report otherwise (SettingDifference)
  Configuration        Config (what every mode shares), options taken from argparse by field
                       name, the parser, URL and file checks, configure(argv)
  Arrivals and trials  when concurrent requests go out (--request-rate), and what one timed
                       cost trial is (--batch, --concurrency): each owns its options, step,
                       records and report lines (BenchServeResult: a load arm's figures
                       under `vllm bench serve`'s result names)
  The sweep's core     Evidence (what each completion showed, and what it can show), the
                       Sender of every traffic shape (Sender.watched: the server's
                       prefix-cache counters read around every batch the sweep and its checks
                       compare), BatchRow, SizeResult, SweepSummary,
                       PromptSweep (the verdict read request by request), and SweepCheck, the
                       interface every sweep check shares; it names no check
  Sweep checks         one section each, holding its options, what it adds to a request, its
                       part of each batch, size and summary, its lines and its --expect rule:
                       Prefix-cache bypass (--prefix-cache), Cache check (--cache-check),
                       Prefill check (--prefill-check), Neighbour check (--neighbours),
                       Observer check (--observer-check), Server baseline (--baseline)
  --mode sweep         SWEEP_CHECKS (the table of checks), SweepOptions, the ladder, the
                       summary and saved document, the table, the advice, the --expect rules,
                       run_sweep: the core and the checks composed
  --mode cost          CostOptions, ArmStats, CellIdentity (everything a cell was measured
                       under), CostCell, the arms and their settings check, warm-up, the cost
                       file, the 2x2 tables (cost_tables, which plot_cost.py draws), run_cost
  --mode harness       the quoted upstream excerpts, their provenance, the commands
  --mode help          the guide
  main                 main(argv) -> exit code
"""

from __future__ import annotations

import argparse
import array
import bisect
import copy
import dataclasses
import errno
import functools
import hashlib
import heapq
import http.client
import ipaddress
import itertools
import json
import math
import operator
import os
import random
import re
import select
import signal
import socket
import ssl
import stat
import subprocess
import statistics
import struct
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.client import HTTPException
from typing import (Any, Callable, ClassVar, Dict, Iterator, List, Optional, Protocol, Sequence,
                    Set, Tuple, Type, TypeVar, Union)

# ----------------------------------------------------------------------------
# Constants

LAB_VERSION = "0.10.0"  # run.py --version and every saved result, beside the code's own name
GIT_TIMEOUT_S = 5.0  # how long git may take to name the checkout run.py sits in
SWEEP_SCHEMA = "batch-invariance-lab/sweep/2"  # the "schema" field of sweep save files
SWEEP_SCHEMAS_READ = ("batch-invariance-lab/sweep/1", SWEEP_SCHEMA)  # what this lab reads back
COST_SCHEMA = "batch-invariance-lab/cost/1"  # the "schema" field of cost save files
MODES = ("harness", "sweep", "cost", "help")
EXIT_OK = 0  # ran, and any --expect held
EXIT_EXPECTATION = 1  # an --expect did not hold
EXIT_USAGE = 2  # bad arguments or input files, found before any request
EXIT_SERVER = 3  # the server or the network failed before the run completed
EXIT_INTERNAL = 70  # a fault of the lab's own (sysexits' EX_SOFTWARE); what was measured is saved
EXIT_OUTPUT = 74  # stdout or stderr could not be written (EX_IOERR); what was measured is saved
EXIT_HANGUP = 129  # SIGHUP: the terminal closed; what was measured is saved
EXIT_INTERRUPTED = 130  # Ctrl-C; what was measured is saved
EXIT_BROKEN_PIPE = 141  # stdout closed under us (`run.py ... | head`)
EXIT_TERMINATED = 143  # SIGTERM: a job scheduler's stop; what was measured is saved
EXIT_CODES = [  # what each exit code means, as --help and the guide print it
    (EXIT_OK, "ran, and any --expect held"),
    (EXIT_EXPECTATION, "an --expect did not hold"),
    (EXIT_USAGE, "usage or input error, found before any request"),
    (EXIT_SERVER,
     "the server or network failed before the run completed (--save keeps what was measured)"),
    (EXIT_INTERNAL, "a fault of the lab's own, to report (--save keeps what was measured)"),
    (EXIT_OUTPUT, "stdout or stderr could not be written (--save keeps what was measured)"),
    (EXIT_HANGUP, "stopped by SIGHUP, a closed terminal (--save keeps what was measured)"),
    (EXIT_INTERRUPTED, "interrupted by Ctrl-C (--save keeps what was measured)"),
    (EXIT_BROKEN_PIPE, "the output pipe closed (e.g. `run.py ... | head`)"),
    (EXIT_TERMINATED, "stopped by SIGTERM, e.g. a job scheduler (--save keeps what was measured)")]
# Limits on what the lab is asked to send, checked before any request (--help lists them)
MAX_BATCH_SIZE = 4096  # batch sizes, --batch, --concurrency: no engine runs more at once
MAX_PROMPTS = 100000  # prompts a sweep takes (--prompt, --prompt-file)
MAX_PROMPT_CHARS = 1 << 22  # characters in one prompt: some 1M tokens, more than any context
MAX_TOKENS = 1 << 20  # --max-tokens: no model writes more in one completion
MAX_PROMPT_TOKENS = 1000000  # --prompt-tokens and --prefix-tokens above this fit no context
MAX_TRIALS = 100000  # --trials and --warmup
MAX_REQUESTS = 1000000  # --requests in one load trial
MAX_REPEAT = 100  # --repeat: more passes than this is a soak test, not a sweep
MAX_SERVER_COUNT = 10**12  # a token count above this is no server's: arithmetic never sees it
# --seed: a signed 64-bit int, what vLLM's completions request takes (0.34.0,
# vllm/entrypoints/openai/completion/protocol.py 45-46 and 67: 400 above it)
MAX_SEED = 2**63 - 1
LIMITS = [  # what --help says of them (the arrivals slice adds its own)
    ("batch sizes, --max-batch, --batch, --concurrency", MAX_BATCH_SIZE),
    ("prompts", MAX_PROMPTS),
    ("characters in a prompt", MAX_PROMPT_CHARS),
    ("--max-tokens", MAX_TOKENS),
    ("--prompt-tokens, --prefix-tokens", MAX_PROMPT_TOKENS),
    ("--trials, --warmup", MAX_TRIALS),
    ("--requests", MAX_REQUESTS),
    ("--repeat", MAX_REPEAT),
    ("--seed", MAX_SEED)]
# Sweep defaults
DEFAULT_PROMPT = (  # a prompt with room to wander
    "Explain, step by step, why adding the same floating-point numbers in a different order can "
    "give a different answer:")
DEFAULT_MAX_BATCH = 32  # the largest batch of the default ladder (upstream's max-num-seqs)
DEFAULT_SWEEP_TOKENS = 64  # longer generations give a near-tie more chances to appear
DEFAULT_LOGPROBS = 5  # top-k logprobs per step, as in vLLM's online test
MAX_LOGPROBS = 20  # vLLM's default max_logprobs; it answers 400 above
DEFAULT_TEMPERATURE = 0.0  # greedy: a divergence is unarguable
DEFAULT_TOP_P = 1.0  # always sent, or the model's generation_config decides
# Sent always too, each at its value that filters nothing, for the same reason: both engines
# fill a parameter left out from the model's generation_config.json. -1 is "all tokens" to
# both (vLLM 0.33.0 vllm/sampling_params.py lines 318-320 and 681-682 take 0 or -1; SGLang
# 0.5.23 python/sglang/srt/sampling/sampling_params.py lines 249-250)
DEFAULT_TOP_K = -1
DEFAULT_MIN_P = 0.0  # no probability floor (vLLM's and SGLang's own default)
DEFAULT_REPETITION_PENALTY = 1.0  # no penalty (both engines' own default)
DEFAULT_SEED = 42  # sent whenever temperature > 0; unseeded sampling depends on the batch
TRAFFIC_SHAPES = ("copies", "concurrent", "mixed")  # how each batch size is sent (see --mode help)
# The default shape measures batching on both engines: n one-prompt requests, each with its
# own cache key, so no request is served another's prefill. Copies in one request (upstream's
# harnesses) share vLLM's prefix cache whatever the salt: on vLLM they compare cached prefills.
DEFAULT_TRAFFIC = "concurrent"
# What a concurrent row's send_spread_s measures, as the saved document says it
SEND_SPREAD_MEANS = "seconds from the lab's first request of the batch written to its last"
DEFAULT_REPEAT = 3  # passes through the ladder: a flag-off server is not repeatable run to run
MIXED_FILLER_WORDS = (3, 12, 40, 120, 300, 600)  # filler prompt lengths (about tokens), mixed
# Cost defaults
WORKLOADS = ("cold", "shared-prefix")  # no prefix can be cached; one long prefix shared by all
DEFAULT_BATCH = 32  # prompts per timed request
DEFAULT_TRIALS = 20  # timed requests per arm
DEFAULT_WARMUP = 2  # discarded requests per arm before timing
WARMUP_ATTEMPTS = 2  # a warm-up request may fail once (a cold server); a trial may not
DEFAULT_COST_TOKENS = 128  # fixed output length per prompt (ignore_eos)
DEFAULT_PREFIX_TOKENS = 1000  # about this many tokens of shared prefix
BOOTSTRAP_RESAMPLES = 4000  # resamples of the paired ratios for the 95% interval
BOOTSTRAP_SEED = 20251  # fixed, so the interval is reproducible
NOISE_SPREAD = 1.5  # an arm whose max/min exceeds this is flagged noisy
# below this the bootstrap's 2.5/97.5 % bounds are just the extreme ratios
MIN_PAIRS_FOR_INTERVAL = 6
# Transport defaults
# auto: on a terminal, unless NO_COLOR is set and not empty
COLOR_CHOICES = ("auto", "always", "never")
# per answer, connecting to last byte: a 256-wide batch of long completions on a busy GPU is slow
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_MAX_RESPONSE_MB = 512  # a larger answer is refused rather than held in memory
MAX_EVENT_LINE = 1 << 20  # a streamed event line longer than this is no engine's event
MAX_REDIRECTS = 5  # a GET redirected within the server more often than this is answered as is
REDIRECTS = (301, 302, 303, 307, 308)  # the statuses that send the lab elsewhere
SHORT_SECRET = 8  # a shorter API key is not looked for in what servers send: too like data
CLOCK = time.perf_counter  # what requests are timed with (the tests swap in a virtual clock)
PROGRESS_INTERVAL_S = 10.0  # off a terminal, at most one progress line this often (short logs)
SAVE_INTERVAL_S = 1.0  # during a run --save is rewritten at most this often (and at every stop)
SAVE_SHARE = 0.05  # ... and never so often that writing it takes more than this share of the run
# an engine counts a step's prefix-cache lookups in /metrics a step after it runs it: after a
# batch the counters are read again until they cover its prompt tokens, at first this long,
COUNTERS_SETTLE_S = 1.0
COUNTERS_SETTLE_MAX_S = 4.0  # ... twice as long after each batch they lagged, up to this
COUNTERS_POLL_S = 0.05  # how often, meanwhile
METRICS_TIMEOUT_S = 5.0  # the most one read of /metrics may take (a hung one: read no more)

# ----------------------------------------------------------------------------
# Records: what is measured and saved, as dataclasses written by one function (as_record)

Json = Dict[str, Any]  # a JSON object as saved or read: made by as_record, read by from_record


def saved(name: Optional[str] = None, omit_none: bool = False, flat: Optional[str] = None,
          parts: bool = False) -> Dict[str, Any]:
    """A record field's metadata, for as_record: saved under name (default: the field's own),
    left out when None (omit_none), or its own record's fields saved in its place, each name
    behind the prefix flat; parts: the field holds a dict of records, each saved in the
    field's place as its own class's SAVED_AS (a saved() of its own) says."""
    return {"saved": name, "omit_none": omit_none or flat is not None, "flat": flat,
            "parts": parts}


NOT_SAVED: Dict[str, Any] = {"not_saved": True}  # the metadata of a field as_record leaves out


@functools.lru_cache(maxsize=None)
def saved_fields(kind: type) -> Tuple[Tuple[str, Optional[str], bool, Optional[str], bool], ...]:
    """(field, saved name, omit when None, flat prefix, parts) of a record type, in saved
    order."""
    return tuple((f.name, f.metadata.get("saved") or f.name, f.metadata.get("omit_none", False),
                  f.metadata.get("flat"), f.metadata.get("parts", False))
                 for f in dataclasses.fields(kind) if not f.metadata.get("not_saved"))


def save_into(record: Json, key: str, flat: Optional[str], value: Any) -> None:
    """One field of a record, saved under key or flattened in behind the prefix flat."""
    if flat is not None:
        record.update((flat + k, v) for k, v in as_record(value).items())
    else:
        record[key] = as_record(value)


def holds_records(value: Any) -> bool:
    """Is value a record, or a list or dict whose members are (as a container's first member
    says: a container holds one kind)?"""
    if isinstance(value, (list, tuple)):
        return bool(value) and holds_records(value[0])
    if isinstance(value, dict):
        return bool(value) and holds_records(next(iter(value.values())))
    return dataclasses.is_dataclass(value)


def as_record(value: Any) -> Any:
    """A record as it is saved: a dataclass becomes an object of its fields in their order
    (as saved() says: renamed, left out when None, or flattened in), and lists and dicts of
    records are written record by record; every other value is saved as it is (json writes a
    tuple as a list)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        record: Json = {}
        for name, key, omit_none, flat, parts in saved_fields(type(value)):
            part = getattr(value, name)
            if part is None and omit_none:
                continue
            if not parts:
                save_into(record, key, flat, part)
                continue
            for each in part.values():
                how = type(each).SAVED_AS
                save_into(record, how["saved"], how["flat"], each)
        return record
    if isinstance(value, (list, tuple)) and value and holds_records(value[0]):
        return [as_record(v) for v in value]
    if isinstance(value, dict) and value and holds_records(next(iter(value.values()))):
        return {k: as_record(v) for k, v in value.items()}
    return value


# ----------------------------------------------------------------------------
# Pure functions: float32 ULPs, comparisons, counts, ladders, statistics

_F32 = struct.Struct("<f")
_I32 = struct.Struct("<i")
_F64 = struct.Struct("<d")
_I64 = struct.Struct("<q")


def is_float32_exact(x: float) -> bool:
    """True when x is a float32 value written as a double (what vLLM and SGLang send)."""
    try:
        return _F32.unpack(_F32.pack(x))[0] == x or math.isnan(x)
    except OverflowError:
        return False


def _ordered(bits: int, sign_mask: int) -> int:
    # Map an IEEE bit pattern to an integer that orders like the float: -0.0 and 0.0
    # both map to 0, and the order is monotonic across the sign.
    return bits if bits >= 0 else -(bits & (sign_mask - 1))


def ulp_distance(a: float, b: float, width: int = 32) -> int:
    """Units in the last place between two finite floats, counted at float32 (or float64)."""
    floats, ints, sign = (_F32, _I32, 1 << 31) if width == 32 else (_F64, _I64, 1 << 63)
    ia, ib = (ints.unpack(floats.pack(x))[0] for x in (a, b))
    return abs(_ordered(ia, sign) - _ordered(ib, sign))


def logprob_distance(a: float, b: float,
                     clamps: Sequence[float] = ()) -> Tuple[Optional[int], str]:
    """(ULPs, unit) between two logprobs; ULPs is None where no distance means anything.

    unit is "float32" normally, "float64" when either value is not float32-exact (a server
    that rounds or computes in double), "clamped" when exactly one is one of `clamps` (the
    engine's stand-ins for -inf), and "non-finite" for inf or NaN on either side.
    """
    if a == b:
        return 0, "float32"
    if a in clamps or b in clamps:
        return None, "clamped"
    if not (math.isfinite(a) and math.isfinite(b)):
        return None, "non-finite"
    if is_float32_exact(a) and is_float32_exact(b):
        return ulp_distance(a, b, 32), "float32"
    return ulp_distance(a, b, 64), "float64"


@dataclass
class Completion:
    """One completion, whichever engine produced it."""

    text: str
    tokens: List[str]  # "token_id:N" where the engine gives ids
    logprobs: List[float]  # the chosen token's logprob at each step
    top_logprobs: List[Dict[str, float]]  # token -> logprob at each step
    finish_reason: Optional[str] = None
    # What the comparisons work out once per completion (has_nan, flat_view), not compared
    memo: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False,
                                 metadata=NOT_SAVED)

    @classmethod
    def from_record(cls, rec: Dict[str, Any]) -> "Completion":
        """A saved completion; the strings "NaN", "Infinity" and "-Infinity" a save wrote for
        values standard JSON has no words for are those values again."""
        top = rec.get("top_logprobs") or [{} for _ in rec["tokens"]]
        return cls(rec["text"], list(rec["tokens"]), [float(x) for x in rec["logprobs"]],
                   [{k: float(v) for k, v in d.items()} for d in top], rec.get("finish_reason"))


def has_nan(c: Completion) -> bool:
    """Any NaN among c's logprobs (looked for once per completion, in C)."""
    if "nan" not in c.memo:
        values = itertools.chain(c.logprobs, *map(dict.values, c.top_logprobs))
        c.memo["nan"] = any(map(math.isnan, values))
    return c.memo["nan"]


def same_completion(a: Completion, b: Completion) -> bool:
    """Equal tokens, logprobs and top-k lists: nothing a comparison could tell apart. A NaN is
    never equal to anything, itself included (list equality would take one for itself: json
    decodes every NaN to one object). What equals b holds a NaN only where b does, so only
    b is looked at: pass the completion a run of copies is compared with as b."""
    return (  # logprobs first: where anything moved, they tell the two apart soonest
        a.logprobs == b.logprobs and a.tokens == b.tokens and a.top_logprobs == b.top_logprobs
        and not has_nan(b))


def negative_float32_bits(values: List[float], clamps: Sequence[float]) -> Optional[array.array]:
    """values' float32 bit patterns as signed ints, for the common case: every value a finite
    float32 at or below zero and none a clamp. Then the patterns order like the values and a
    plain difference counts ULPs (+0.0, a certain token, is written as -0.0, so that every
    sign bit is set). None when any value falls outside that case. All in C: a sweep looks
    at millions of values."""
    if not values or max(values) > 0.0 or any(c in values for c in clamps) or -math.inf in values:
        return None
    f32 = array.array("f", [v or -0.0 for v in values] if 0.0 in values else values)
    if f32.tolist() != values:  # not float32 values (a zero compares equal to -0.0), or NaN
        return None
    return array.array("i", f32.tobytes())


@dataclass(frozen=True)
class Margin:
    """How near a tie the first divergence was: in the baseline's own top-k at that step, the
    baseline's chosen token against the token the other completion chose there."""

    logprob: Optional[float] = None  # chosen minus other, as logprobs (>= 0 for greedy)
    ulp: Optional[int] = None  # the same gap in ULPs (float32 where both values are)
    note: Optional[str] = None  # "not in top-k" (the other token is not in the list), ...


NOT_IN_TOP_K = "not in top-k"
ENDED_EARLY = "one ended early"


def divergence_margin(base: Completion, other: Completion, step: int,
                      clamps: Sequence[float] = ()) -> Margin:
    if step >= len(base.tokens) or step >= len(other.tokens):
        return Margin(note=ENDED_EARLY)
    top = base.top_logprobs[step] if step < len(base.top_logprobs) else {}
    mine, theirs = base.tokens[step], other.tokens[step]
    if mine not in top or theirs not in top:
        return Margin(note=NOT_IN_TOP_K)
    ulp, _ = logprob_distance(top[mine], top[theirs], clamps)
    return Margin(logprob=top[mine] - top[theirs], ulp=ulp)


@dataclass
class Delta:
    """How one completion differs from the baseline."""

    first_token_divergence: Optional[int] = None  # first step whose token differs
    max_ulp: int = 0  # over every comparable logprob
    first_ulp_step: Optional[int] = None  # first step with a non-zero distance
    ulp_notes: Tuple[str, ...] = ()  # "float64", "clamped", "non-finite", "top-k changed"
    margin: Optional[Margin] = None  # at the first token divergence
    # the same drift in nats: the largest absolute difference of two comparable logprobs (a
    # float32 ULP is relative to the value's size; a nat is what a KL or a margin is in)
    max_nats: float = 0.0


IDENTICAL = Delta()


@dataclass
class ComparablePairs:
    """The logprob pairs of two completions that share a context, flattened: first the chosen
    tokens' logprobs of the steps before the divergence (one per step), then each step's
    top-k entries present on both sides (step t's end at ends[t])."""

    diverged: Optional[int]
    xs: List[float]
    ys: List[float]
    chosen: int
    ends: List[int]
    topk_changed: Optional[int] = None  # first step whose top-k token set differs
    bits: Optional[Tuple[List[int], List[int]]] = None  # xs's and ys's, when float32 (flat_view)

    def step_of(self, i: int) -> int:
        return i if i < self.chosen else bisect.bisect_right(self.ends, i)


def flat_view(c: Completion, clamps: Sequence[float]) -> Tuple[List[str], List[int], List[float],
                                                               Optional[List[int]]]:
    """(top-k tokens, where each step ends, values, float32 bits) of c's logprobs laid out as
    comparable_pairs lays them out when nothing diverged: the chosen tokens', then each step's
    top-k. Worked out once per completion: the baseline is compared with every other."""
    key = ("flat", tuple(clamps))
    if key not in c.memo:
        top = c.top_logprobs
        values = c.logprobs + list(itertools.chain.from_iterable(map(dict.values, top)))
        ends = list(itertools.accumulate(map(len, top), initial=len(c.logprobs)))[1:]
        bits = negative_float32_bits(values, clamps)
        c.memo[key] = (list(itertools.chain.from_iterable(top)), ends, values,
                       None if bits is None else bits.tolist())
    return c.memo[key]


def comparable_pairs(base: Completion, other: Completion,
                     clamps: Sequence[float] = ()) -> ComparablePairs:
    """Before the first token divergence: the chosen token's logprob and every token in both
    top-k lists. At the divergence step: only tokens in both top-k lists. After it: nothing,
    because the two contexts differ. Built with C-level extends: a sweep compares thousands."""
    steps = min(len(base.tokens), len(other.tokens))
    diverged = None
    if base.tokens != other.tokens:
        diverged = next((t for t in range(steps) if base.tokens[t] != other.tokens[t]), None)
    if diverged is None and len(base.tokens) != len(other.tokens):
        diverged = steps  # one ended early: its end is the divergence
    last = steps - 1 if diverged is None else min(diverged, steps - 1)
    chosen = last + 1 if diverged is None else diverged
    xs, ys = base.logprobs[:chosen], other.logprobs[:chosen]
    if diverged is None:
        base_keys, base_ends, base_values, base_bits = flat_view(base, clamps)
        keys, ends, values, bits = flat_view(other, clamps)
        if keys == base_keys and ends == base_ends:
            # The common case, in C: nothing diverged, every step lists the same tokens in order
            both = (base_bits, bits) if base_bits is not None and bits is not None else None
            return ComparablePairs(None, base_values, values, chosen, ends, None, both)
    ends = []
    topk_changed = None
    for t in range(last + 1):
        bt, ot = base.top_logprobs[t], other.top_logprobs[t]
        if bt.keys() == ot.keys():
            keys = bt
        else:  # the k-th and (k+1)-th candidates swap exactly when their last bits move
            keys = bt.keys() & ot.keys()
            if topk_changed is None:
                topk_changed = t
        xs.extend(map(bt.__getitem__, keys))
        ys.extend(map(ot.__getitem__, keys))
        ends.append(len(xs))
    return ComparablePairs(diverged, xs, ys, chosen, ends, topk_changed)


def _negative_float32_ulps(xs: List[float], ys: List[float],
                           clamps: Sequence[float]) -> Optional[List[int]]:
    """ULPs of each pair, computed in C, when both sides are negative_float32_bits' case."""
    bx, by = negative_float32_bits(xs, clamps), negative_float32_bits(ys, clamps)
    if bx is None or by is None:
        return None
    return list(map(abs, map(operator.sub, bx, by)))


def pair_ulps(xs: List[float], ys: List[float],
              clamps: Sequence[float]) -> Tuple[List[Optional[int]], Set[str]]:
    """The ULP distance of every pair (None: moved, but no distance means anything), and the
    notes on units met. The common case is counted in C; the rest pair by pair."""
    bulk = _negative_float32_ulps(xs, ys, clamps)
    if bulk is not None:
        return bulk, set()
    ulps: List[Optional[int]] = []
    notes: Set[str] = set()
    for a, b in zip(xs, ys):
        distance, unit = logprob_distance(a, b, clamps)
        ulps.append(distance)
        if unit != "float32":
            notes.add(unit)
    return ulps, notes


def first_true(flags: List[bool], start: int, stop: int) -> Optional[int]:
    """The first index in start..stop-1 whose flag is true, or None (found in C)."""
    try:
        return flags.index(True, start, stop)
    except ValueError:
        return None


def compare_completions(base: Completion, other: Completion,
                        clamps: Sequence[float] = ()) -> Delta:
    """Compare a completion with the baseline, step by step (see comparable_pairs for which
    values count); clamps are the engine's stand-ins for -inf."""
    if same_completion(base, other):
        return IDENTICAL
    pairs = comparable_pairs(base, other, clamps)
    if pairs.bits is not None:  # the common case, in C: every value finite and no clamp
        ulps, notes = list(map(abs, map(operator.sub, *pairs.bits))), set()
        nats = max(map(abs, map(operator.sub, pairs.xs, pairs.ys)), default=0.0)
    else:
        ulps, notes = pair_ulps(pairs.xs, pairs.ys, clamps)
        nats = max((abs(a - b) for a, b in zip(pairs.xs, pairs.ys)
                    if math.isfinite(a) and math.isfinite(b)
                    and a not in clamps and b not in clamps), default=0.0)
    worst = max(filter(None, ulps), default=0)
    # None (moved, but no distance) counts as moved; the common all-int case is mapped in C
    moved_at = [u != 0 for u in ulps] if None in ulps else list(map(operator.truth, ulps))
    first_chosen = first_true(moved_at, 0, pairs.chosen)
    first_top = first_true(moved_at, pairs.chosen, len(ulps))
    first_top = None if first_top is None else pairs.step_of(first_top)
    if pairs.topk_changed is not None:
        notes.add("top-k changed")
    moved = [s for s in (first_chosen, first_top, pairs.topk_changed) if s is not None]
    margin = None
    if pairs.diverged is not None:
        margin = divergence_margin(base, other, pairs.diverged, clamps)
    return Delta(pairs.diverged, worst,
                 min(moved) if moved else None, tuple(sorted(notes)), margin, nats)


def top_two_margins(c: Completion) -> List[float]:
    """Each step's gap between the best two candidates of c's own top-k list, in nats
    (infinite where the list holds fewer than two); worked out once per completion."""
    if "margins" not in c.memo:
        margins = []
        for top in c.top_logprobs:
            best = heapq.nlargest(2, (v for v in top.values() if math.isfinite(v)))
            margins.append(best[0] - best[1] if len(best) == 2 else math.inf)
        c.memo["margins"] = margins
    return c.memo["margins"]


def flip_risk(baseline: Completion, drift: float) -> Optional[float]:
    """The share of the baseline's steps whose top two candidates lie within drift nats of
    each other: where a drift that large could flip the choice. None without top-k lists to
    read margins from; 0 where nothing drifted."""
    margins = top_two_margins(baseline)
    if not margins or all(math.isinf(m) for m in margins):
        return None
    if drift <= 0:
        return 0.0
    return sum(1 for m in margins if m <= drift) / len(margins)


Bucket = Union[int, str, None]  # a graph size; None above the largest (no graph); "?" unknown


def graph_bucket(batch_size: int, graph_sizes: Sequence[int]) -> Optional[int]:
    """The CUDA-graph size a decode batch pads up to; None above the largest (no graph)."""
    return next((b for b in sorted(graph_sizes) if b >= batch_size), None)


def straddling_ladder(max_batch: int, graph_sizes: Sequence[int]) -> List[int]:
    """Batch sizes from 1 to max_batch that straddle every capture size b with b-1, b, b+1."""
    sizes = {1}
    for b in graph_sizes:
        sizes.update(s for s in (b - 1, b, b + 1) if 1 <= s <= max_batch)
    return sorted(sizes)


@dataclass
class Measured:
    """What a sweep measured, as far as its verdict depends on it: for one prompt, or for all.
    The verdict's evidence is per request (PromptSweep.measured): a completion counts where
    it was computed, not served from the prefix cache, beside other requests of its batch."""

    total: int = 0  # completions that came back, the baseline's included
    unique: int = 0  # distinct completion texts, the baseline's included
    max_ulp: int = 0  # over every comparable logprob
    tokens_diverged: bool = False  # a computed completion chose another token than the baseline
    text_only: bool = False  # a computed completion's text differed while its tokens held
    moved: bool = False  # a computed completion differed from the baseline in any way
    compared: bool = False  # a computed completion above batch 1, or against a stored baseline
    batch1_repeatable: Optional[bool] = None  # batch 1's passes against each other
    unseeded: bool = False  # sampling that the server does not seed
    served_moved: bool = False  # a completion the prefix cache served differed from the baseline
    served_sizes: List[int] = field(default_factory=list)  # sizes where the cache served one
    alone_sizes: List[int] = field(default_factory=list)  # sizes where a request was alone
    # sizes where a request's cache state is not known while the cache was kept
    unknown_sizes: List[int] = field(default_factory=list)
    unoverlapped: bool = False  # some size's scheduled requests were never in flight together
    first_moved: Optional[Any] = None  # the FirstMoved of the computed evidence
    baseline_served: bool = False  # the cache served batch 1, the baseline: nothing compared
    cache_kept: bool = False  # --prefix-cache keep: no bypass was asked
    # sampled (temperature > 0) with no run-to-run control: nothing checked that the seed
    # fixes each sample, so what moved may be sampling noise
    uncontrolled: bool = False

    @classmethod
    def combined(cls, parts: Sequence["Measured"]) -> "Measured":
        """All prompts together: the verdict of a sweep is that of its least invariant prompt."""
        repeatable = [m.batch1_repeatable for m in parts]
        firsts = [m.first_moved for m in parts if m.first_moved is not None]
        return cls(
            total=sum(m.total for m in parts), unique=max((m.unique for m in parts), default=0),
            max_ulp=max((m.max_ulp for m in parts), default=0),
            tokens_diverged=any(m.tokens_diverged for m in parts),
            text_only=any(m.text_only for m in parts), moved=any(m.moved for m in parts),
            compared=any(m.compared for m in parts),
            batch1_repeatable=(False if False in repeatable else
                               True if repeatable and None not in repeatable else None),
            unseeded=any(m.unseeded for m in parts),
            served_moved=any(m.served_moved for m in parts),
            served_sizes=sorted({n for m in parts for n in m.served_sizes}),
            alone_sizes=sorted({n for m in parts for n in m.alone_sizes}),
            unknown_sizes=sorted({n for m in parts for n in m.unknown_sizes}),
            unoverlapped=any(m.unoverlapped for m in parts),
            first_moved=min(firsts, key=lambda f: f.batch) if firsts else None,
            baseline_served=any(m.baseline_served for m in parts),
            cache_kept=any(m.cache_kept for m in parts),
            uncontrolled=any(m.uncontrolled for m in parts))


INVARIANT = "invariant"
TOKENS_DIVERGED = "tokens diverged"
TEXT_ONLY = "text differs, tokens equal"  # the server's text path, not its arithmetic, moved
LOGPROBS_MOVED = "logprobs moved but tokens held"
NOT_REPEATABLE = "batch 1 not repeatable"  # the verdict when the run-to-run control fails
# the verdict when the server ignores the seed
NOISE_NOT_RULED_OUT = "sampling noise not ruled out"
NO_DATA = "no data"  # the verdict when no completion came back (the run stopped first)
# batch 1 alone came back: it is the baseline, not a comparison
NOTHING_COMPARED = "nothing compared"
# what moved, moved only in requests the prefix cache served
CACHE_CONFOUNDED = "moved only where the cache served (bypass did not hold)"
# the same, with the cache kept (--prefix-cache keep): no bypass was asked
KEPT_CACHE_MOVED = "moved only where the kept cache served"
# every request above batch 1 was served from the prefix cache, and none moved
SERVED_ONLY = "nothing compared: the cache served every request above batch 1"
# --prefix-cache keep, and no request above batch 1 is known to have been computed cold
CACHE_UNKNOWN = ("nothing compared: the cache was kept, and whether it served a request above "
                 "batch 1 is not known")
# the same under the bypass, where the server showed the bypass failing beside those requests
CACHE_UNCLEAR = ("nothing compared: whether the cache served a request above batch 1 is not "
                 "known (the bypass did not hold beside it)")
# the baseline, batch 1, came from the prefix cache: every comparison is one with the cache
BASELINE_SERVED = "nothing compared: the cache served batch 1, the baseline"
BATCH_EFFECTS = (TOKENS_DIVERGED, LOGPROBS_MOVED)  # verdicts batching explains
# they claim nothing either way
UNMEASURED_VERDICTS = (NO_DATA, NOTHING_COMPARED, SERVED_ONLY, CACHE_UNKNOWN, CACHE_UNCLEAR,
                       BASELINE_SERVED)
MOVED_NOTES = ("clamped", "non-finite", "top-k changed")  # notes that count as moved, ULPs or not

ULP_NOTE_TEXT = {
    "top-k changed": "a step's top-k token set differed from batch 1's (a candidate swapped "
    "places with one outside the list): counted as moved; the ULPs cover the shared entries",
    "float64": "some logprobs were not float32-exact (a server that rounds or works in float64): "
    "those distances are float64 ULPs",
    "clamped": "a logprob was a clamped -inf (the engine's stand-in value) on one side only: "
    "no distance, counted as moved",
    "non-finite": "a logprob was inf or NaN on one side: no distance, counted as moved"}


def verdict(m: Measured) -> str:
    """The one place a sweep's verdict is decided (printed, saved and read by --expect): what
    the computed requests show, claiming nothing that was not compared and never blaming
    batching for what something else explains (sampling the server does not seed, or whose
    seed no run-to-run control checked, a batch 1 that does not repeat itself, a prefix cache
    that served what moved)."""
    if not m.total:
        return NO_DATA
    confounded = KEPT_CACHE_MOVED if m.cache_kept else CACHE_CONFOUNDED
    if not m.compared:
        if m.baseline_served:
            return BASELINE_SERVED
        if m.served_moved:
            return confounded
        if m.unknown_sizes:
            return CACHE_UNKNOWN if m.cache_kept else CACHE_UNCLEAR
        return SERVED_ONLY if m.served_sizes else NOTHING_COMPARED
    moved = m.moved or m.batch1_repeatable is False
    if (m.unseeded and (moved or m.served_moved)) or (m.uncontrolled and moved):
        return NOISE_NOT_RULED_OUT
    if m.batch1_repeatable is False:
        return NOT_REPEATABLE
    if not moved and m.served_moved:
        return confounded
    if m.tokens_diverged:
        return TOKENS_DIVERGED
    if m.text_only:
        return TEXT_ONLY
    if moved:
        return LOGPROBS_MOVED
    return INVARIANT


def percentile(values: Sequence[float], share: float) -> float:
    """The value below which share of the values lie (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


def mad(values: Sequence[float]) -> float:
    """Median absolute deviation: a spread that one slow outlier cannot inflate."""
    m = statistics.median(values)
    return statistics.median([abs(v - m) for v in values])


def bootstrap_median_ci(values: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES,
                        seed: int = BOOTSTRAP_SEED, level: float = 0.95) -> Tuple[float, float]:
    """Percentile bootstrap interval of the median; seeded, so the same data give the same
    interval."""
    rng = random.Random(seed)
    n = len(values)
    meds = sorted(
        statistics.median([values[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    tail = (1.0 - level) / 2.0
    return meds[int(tail * (resamples - 1))], meds[int(math.ceil((1.0 - tail) * (resamples - 1)))]


_FILLER = ("the quick brown fox jumps over a lazy dog while seven wise owls watch from an old oak "
           "tree near the river bank and count every star in the clear night sky").split()


def filler_words(count: int, offset: int = 0) -> str:
    """About `count` tokens of plain English (common words are about one token each)."""
    return " ".join(_FILLER[(offset + i) % len(_FILLER)] for i in range(count))


def mixed_batch(prompt: str, n: int, seed: int) -> Tuple[List[str], int]:
    """One batch of mixed traffic: the measured prompt once, at a position that varies with n,
    among n-1 filler prompts of varied lengths; the same n and seed always give the same batch."""
    rng = random.Random(seed * 1000003 + n)
    position = rng.randrange(n)
    fillers = []
    while len(fillers) < n - 1:
        words = rng.choice(MIXED_FILLER_WORDS)
        text = "[%d.%d] %s" % (n, len(fillers), filler_words(words, rng.randrange(len(_FILLER))))
        if text != prompt:
            fillers.append(text)
    return fillers[:position] + [prompt] + fillers[position:], position


def workload_prompts(workload: str, batch: int, trial: int, run_id: str,
                     prefix_tokens: int = DEFAULT_PREFIX_TOKENS) -> List[str]:
    """The prompts of one trial. cold: every prompt opens with its own run, trial and slot, so
    no prefix cache can hit; shared-prefix: one long prefix for every prompt of every trial."""
    if workload == "cold":
        return [
            "[%s.%d.%d] Write a short story about %s." %
            (run_id, trial, i, filler_words(6, trial + i)) for i in range(batch)]
    prefix = "Read this passage and answer the question after it. " + filler_words(prefix_tokens)
    return [
        "%s\nQuestion %d.%d: what is word %d of the passage?" % (prefix, trial, i, i + 1)
        for i in range(batch)]


# ----------------------------------------------------------------------------
# Transport: one guarded HTTP client for every engine and mode


class ServerError(Exception):
    """The server or network failed; the message is one line, ready for the user. kind says
    which way: HTTP (the server answered with an error status, kept in status), ANSWER (it
    answered, but not with what the engine sends: invalid JSON, the wrong shape), or NETWORK
    (no answer: refused, dropped, timed out, redirected away)."""

    HTTP, ANSWER, NETWORK = "http", "answer", "network"

    def __init__(self, message: str, status: Optional[int] = None, kind: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.kind = kind or (self.HTTP if status is not None else self.NETWORK)


class UsageError(Exception):
    """Bad arguments or input; the message is one line, ready for the user."""


def is_loopback(host: str) -> bool:
    """This machine: loopback addresses and names, the any-address engines log, and the
    machine's own name. A proxy cannot reach any of them."""
    if host.lower() in ("localhost", "localhost.localdomain", "0.0.0.0", "::", "[::]",
                        socket.gethostname().lower()):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


BEARER = re.compile(r"(?i)\bbearer\s+")  # where a key stands in an echoed Authorization header


class Secrets:
    """The API key, kept out of what the lab prints and saves by where it stands, never by
    rewriting the lab's own values: the recorded command line has the key option's value
    replaced where it stands (key_free_command); and text a server sends back (its error
    bodies, what its info endpoints answer) is searched for the key, in any case and cut
    short from SHORT_SECRET characters on, only when the key is long enough to be told from
    data; a key of any length where it stands after "Bearer " (a server repeating the header
    it was sent). A shorter key is said once on stderr: the lab never writes it, and looks
    for it in a server's answers only there."""

    def __init__(self) -> None:
        self.pattern: Optional["re.Pattern[str]"] = None
        self.rests: Dict[str, str] = {}
        self.words: List[str] = []  # every key kept, the longest first
        self.short = False  # a key was given that is too short to search for

    def keep(self, *secrets: Optional[str]) -> None:
        """Hide these from now on in what servers send: a key in any case, and any start of
        it of SHORT_SECRET characters or more (a server may echo a key cut short), whatever
        stands at its edges; and a key of any length where a key stands (after "Bearer ", as
        a server repeats the Authorization header it was sent)."""
        words = sorted({w for w in secrets if w}, key=len, reverse=True)
        self.words = words
        self.short = any(len(w) < SHORT_SECRET for w in words)
        self.rests = {}  # a long key's first SHORT_SECRET characters -> the rest, lower case
        for w in words:
            if len(w) >= SHORT_SECRET:
                self.rests.setdefault(w[:SHORT_SECRET].lower(), w[SHORT_SECRET:].lower())
        alternatives = ["(?i:%s)" % re.escape(start) for start in self.rests]
        self.pattern = re.compile("|".join(alternatives)) if alternatives else None

    def hide(self, text: str) -> str:
        """Server text with each key's start, and as much more of that key as follows, hidden
        (a loop, not a pattern: a key of a thousand characters nests no thousand groups); and
        a key standing after "Bearer ", whatever its length."""
        text = self.hide_standing(text)
        if self.pattern is None:
            return text
        parts, end = [], 0
        for found in self.pattern.finditer(text):
            if found.start() >= end:  # not inside a key already hidden
                rest = self.rests.get(found.group().lower(), "")
                more = text[found.end():found.end() + len(rest)].lower()
                parts += [text[end:found.start()], "[api key]"]
                end = found.end() + len(os.path.commonprefix([more, rest]))
        return "".join(parts) + text[end:]

    def hide_standing(self, text: str) -> str:
        """A kept key of any length, in any case, hidden where it stands after "Bearer " and
        is the whole word there (a short key, which is searched for nowhere else)."""
        if not self.words:
            return text
        parts, end = [], 0
        for found in BEARER.finditer(text):
            at = found.end()
            if found.start() < end:
                continue
            for word in self.words:
                after = text[at + len(word):at + len(word) + 1]
                if text[at:at + len(word)].lower() == word.lower() and not after.isalnum():
                    parts += [text[end:at], "[api key]"]
                    end = at + len(word)
                    break
        return "".join(parts) + text[end:]

    def hidden(self, value: Any) -> Any:
        """A decoded JSON answer of a server with the key hidden in every string of it, keys
        of objects too: done once decoded, never by rewriting encoded text."""
        if not self.words:
            return value
        if isinstance(value, str):
            return self.hide(value)
        if isinstance(value, dict):
            return {self.hidden(k): self.hidden(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.hidden(v) for v in value]
        return value


KEY_OPTION = "--api-key"  # the one option whose value is a secret


def key_free_command(argv: Sequence[str], options: Sequence[str],
                     engine: bool = False) -> List[str]:
    """A command line as it may be recorded: the key option's value replaced where it stands,
    in every spelling argparse takes (--api-key K, --api-key=K, and any abbreviation of it
    that no other of options begins: --api K). One rule, for run.py's own record and the
    experiment's. An engine's command (engine=True) is read as vLLM's parser reads it: an
    underscore in an option's name is a dash (--api_key K: FlexibleArgumentParser,
    vllm/utils/argparse_utils.py, 0.34.0 lines 378-391), and the option takes several keys,
    each word up to the next option (--api-key K1 K2: api_key is list[str],
    vllm/entrypoints/common/cli_args.py line 336, given nargs="+" by
    vllm/engine/arg_utils.py line 258)."""
    def is_key_option(word: str) -> bool:
        name = word.split("=", 1)[0]
        if engine:
            name = name.replace("_", "-")
        if len(name) < 3 or not KEY_OPTION.startswith(name):
            return False
        return name == KEY_OPTION or not any(o.startswith(name) for o in options
                                             if o != KEY_OPTION)

    command, expects_value, more_values = [], False, False
    for i, word in enumerate(argv):
        if more_values and word.startswith("-"):
            more_values = False
        if expects_value or more_values:
            command.append("[api key]")
            more_values = engine
            expects_value = False
        elif word == "--":
            return command + list(argv[i:])
        elif word.startswith("--") and is_key_option(word):
            if "=" in word:
                command.append(word.split("=", 1)[0] + "=[api key]")
            else:
                command.append(word)
                expects_value = True
        else:
            command.append(word)
    return command


def check_api_key(key: Optional[str]) -> Optional[str]:
    """The API key, refused when it could not go in an HTTP header as it is: a line break
    would add a header of its own (exit 2, the key not repeated)."""
    if key is not None and (not key.isprintable() or not key.isascii()):
        raise UsageError(
            "the API key (--api-key or $OPENAI_API_KEY) holds a line break, a control "
            "character or a non-ASCII character: no HTTP header can carry it as it is")
    return key


SECRETS = Secrets()


def printable(text: str) -> str:
    """A server's text as one printable line: line breaks, escape sequences and every other
    character a terminal would act on written as escapes (a server cannot forge a line)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def server_message(body: bytes) -> str:
    """The server's own error text, wherever the engine puts it: {"error": {"message": ...}},
    {"error": "..."}, {"message": ...} or plain text (its first 200 characters); the key is
    hidden before any text is cut (a server may echo it back), so that no part of it shows."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    text = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            text = str(err["message"])
        else:
            keys = ("message", "detail", "error")
            text = next((data[k] for k in keys if isinstance(data.get(k), str)), None)
    if text is not None:
        return printable(SECRETS.hide(text))
    text = body.decode("utf-8", "replace").strip().replace("\n", " ")
    return printable(SECRETS.hide(text)[:200]) or "no body"


STOP_GRACE_S = 1.0  # after a stop signal, a request in flight may take this long, then it is cut
WAIT_SLICE_S = 0.1  # how often a wait for an answer looks at the clock and for a stop


class StopRequest:
    """The first stop signal, as the waits for answers see it (DeferredInterrupt sets it)."""

    def __init__(self):
        self.event = threading.Event()
        self.signum = signal.SIGINT

    def ask(self, signum: int) -> None:
        self.signum = signum
        self.event.set()


STOP = StopRequest()


class Deadline:
    """One answer's time limit, from connecting to its last byte, and a stop signal's grace:
    every wait for a server asks left() for how long it may block, so neither a server that
    trickles its bytes nor a stuck request outlasts --timeout, or a stop by STOP_GRACE_S."""

    def __init__(self, seconds: float, overrun: Callable[[], Exception]):
        self.at = time.monotonic() + seconds
        self.overrun = overrun  # what to raise when the time is up
        self.give_up: Optional[float] = None  # once a stop signal came: when to abandon
        self.expired: Optional[BaseException] = None  # what the watchdog found, if it ended it

    def left(self) -> float:
        """How long the next wait may block (at most WAIT_SLICE_S); raises overrun() once the
        time is up, or Stopped once a stop signal's grace is over."""
        now = time.monotonic()
        if STOP.event.is_set():
            self.give_up = self.give_up or now + STOP_GRACE_S
            if now >= self.give_up:
                raise Stopped(STOP.signum)
        if now >= self.at:
            raise self.overrun()
        return min(WAIT_SLICE_S, self.at - now)


class Watchdog:
    """Ends the connections of concurrent and streamed requests once their answer's deadline
    has passed, or a stop signal's grace is over. Their sockets block without a timeout (a
    socket with one polls before every read: a fifth more CPU per streamed token), so one
    thread watches them all, and shuts a connection down to wake the read stuck on it; the
    reader then raises what the deadline says (expired)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.watched: Dict[int, Tuple[Deadline, socket.socket]] = {}
        self.thread: Optional[threading.Thread] = None

    def watch(self, deadline: Deadline, sock: socket.socket) -> None:
        with self.lock:
            self.watched[id(deadline)] = (deadline, sock)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="lab-watchdog", daemon=True)
                self.thread.start()

    def unwatch(self, deadline: Deadline) -> None:
        with self.lock:
            self.watched.pop(id(deadline), None)

    def _run(self) -> None:
        while True:
            time.sleep(WAIT_SLICE_S)
            with self.lock:
                watched = list(self.watched.values())
            for deadline, sock in watched:
                try:
                    deadline.left()
                except BaseException as err:  # the time is up, or a stop signal's grace
                    deadline.expired = err
                    self.unwatch(deadline)
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass


WATCHDOG = Watchdog()


@dataclass(frozen=True)
class Route:
    """How requests reach a server: straight, or through the environment's proxy (which no
    loopback address is sent through), worked out once per server (reading the environment
    for proxies costs more than a request)."""

    https: bool
    host: str  # whom to connect to: the server, or its proxy
    port: Optional[int]
    netloc: str  # the server's, for the Host header
    path: str  # the base URL's path, which every request's path extends
    absolute: bool  # a plain-HTTP proxy takes the absolute URL as the target
    tunnel: Optional[Tuple[str, Optional[int]]]  # an HTTPS proxy's CONNECT target

    @classmethod
    def to(cls, base_url: str) -> "Route":
        parts = urllib.parse.urlsplit(base_url)
        https, host, port = parts.scheme == "https", parts.hostname or "", parts.port
        straight = cls(https, host, port, parts.netloc, parts.path, False, None)
        proxy = urllib.request.getproxies().get(parts.scheme)
        if not proxy or is_loopback(host) or urllib.request.proxy_bypass(host):
            return straight
        via = urllib.parse.urlsplit(proxy if "://" in proxy else "http://" + proxy)
        return dataclasses.replace(straight, host=via.hostname or "", port=via.port,
                                   absolute=not https, tunnel=(host, port) if https else None)

    def connection(self, timeout: float) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = kind(self.host, self.port, timeout=timeout)
        if self.tunnel:
            conn.set_tunnel(*self.tunnel)
        return conn


class Exchange:
    """One request and its answer, in steps: connect() opens the connection, send() writes
    the request, whole_answer(), answer() or events() read the reply. Many threads each
    holding one can send within moments of each other (concurrent traffic), because neither
    connection set-up nor reading another request's answer falls between their sends. One
    deadline covers connecting, another the answer from the request written to its last
    byte; the watchdog keeps both, and a stop signal's grace. Errors are the client's."""

    def __init__(self, client: HttpClient, method: str, path: str,
                 body: Optional[Dict[str, Any]] = None):
        self.client, self.path = client, path
        self.deadline: Optional[Deadline] = None  # what the watchdog holds the exchange to
        self.response: Optional[http.client.HTTPResponse] = None  # from the answer's start on
        self.data = b"" if body is None else json.dumps(body).encode("utf-8")
        route = client.route
        self.url = client.base_url + path
        self.target = self.url if route.absolute else route.path + path
        self.conn = route.connection(client.timeout)
        head = ["%s %s HTTP/1.1" % (method, self.target), "Host: %s" % route.netloc]
        if body is not None:
            head += ["Content-Type: application/json", "Content-Length: %d" % len(self.data)]
        head.append("Connection: close")
        if client.api_key:
            head.append("Authorization: Bearer " + client.api_key)
        # The whole request, written in one call: the less each thread does between the
        # barrier and the wire, the closer together the requests arrive.
        self.raw = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + self.data

    def _guard(self, step: Callable[[], Any]) -> Any:
        try:
            return step()
        except (OSError, HTTPException) as err:
            self.close()
            self._raise_expired()
            raise self.client.transport_error(err, self.url) from None
        except ServerError:  # an answer cut short: by the server, or by the watchdog
            self.close()
            self._raise_expired()
            raise
        except BaseException:
            self.close()
            raise

    def _raise_expired(self) -> None:
        """What ended the answer, when the watchdog did: its deadline, or a stop signal."""
        if self.deadline is not None and self.deadline.expired is not None:
            raise self.deadline.expired

    def connect(self) -> None:
        """Open the connection within --timeout (then the lab's own wait, if any, for the
        moment to send is under no deadline: the answer's starts at send())."""
        self.deadline = self.client.deadline()
        self.conn._create_connection = sliced_connection(self.deadline)
        self._guard(self.conn.connect)
        WATCHDOG.unwatch(self.deadline)

    def send(self) -> None:
        """Write the request; from here one deadline covers the rest of the answer."""
        self.deadline = self.client.deadline()
        sock = self.conn.sock
        WATCHDOG.watch(self.deadline, sock)
        self._guard(lambda: sock.sendall(self.raw))

    def close(self) -> None:
        """Close the connection and the answer read from it (which holds the socket open)."""
        if self.deadline is not None:
            WATCHDOG.unwatch(self.deadline)
        if self.response is not None:
            self.response.close()
        self.conn.close()

    def whole_answer(self) -> Tuple[int, Optional[str], bytes]:
        """(status, Location header, body) of the answer, read whole; then the exchange ends."""
        try:
            resp = self._begin()
            raw = self._guard(lambda: self.client._read_capped(resp))
        finally:
            self.close()
        self._raise_expired()  # a body without a length ends where the watchdog cut it
        return resp.status, resp.getheader("Location"), raw

    def answer(self) -> Any:
        """The decoded JSON answer; an error status raises the server's own message."""
        status, _, raw = self.whole_answer()
        if status >= 300:
            raise self.client.http_error(status, self.path, raw)
        return self.client.decode(raw, self.path)

    def _begin(self) -> http.client.HTTPResponse:
        """The response, its status line and headers read."""
        resp = self.response = http.client.HTTPResponse(self.conn.sock)
        self._guard(resp.begin)
        return resp

    def events(self) -> Any:
        """The answer as server-sent events: each event's JSON (its `data:` lines joined, as
        the standard says; a byte-order mark at the start is dropped), as it arrives, until
        `data: [DONE]`. Both engines stream so (vLLM's /v1/completions and SGLang's /generate
        with stream true). An answer that is not a stream, an error event, or a stream that
        ends before [DONE] raises ServerError; the whole stream is under one deadline."""
        try:
            resp = self._begin()
            if resp.status >= 300:
                raise self.client.http_error(resp.status, self.path,
                                             self._guard(lambda: self.client._read_capped(resp)))
            if "text/event-stream" not in (resp.getheader("Content-Type") or ""):
                raise ServerError("%s did not stream its answer (no text/event-stream), though "
                                  "the request asked it to" % self.path)
            pending: List[bytes] = []  # the data lines of the event being read
            start = True
            while True:
                line = self._guard(lambda: resp.readline(MAX_EVENT_LINE + 1))
                if start and line.startswith(b"\xef\xbb\xbf"):  # a byte-order mark
                    line = line[3:]
                start = False
                if len(line) > MAX_EVENT_LINE:
                    raise ServerError("a stream line from %s is longer than %d MiB: refused" %
                                      (self.path, MAX_EVENT_LINE >> 20), kind=ServerError.ANSWER)
                if not line.endswith(b"\n"):  # the end of the stream, in the middle of a line
                    self._raise_expired()
                    raise ServerError("the stream from %s was cut before it ended" % self.path)
                field_line = line.rstrip(b"\r\n")
                if field_line.startswith(b"data:"):
                    pending.append(field_line[5:])
                    if pending != [b" [DONE]"] and pending != [b"[DONE]"]:
                        continue  # [DONE] ends the stream at once; an event, at a blank line
                elif field_line or not pending:
                    continue  # another field (event:, id:, a comment), or a blank line alone
                data = b"\n".join(part[1:] if part[:1] == b" " else part for part in pending)
                pending = []
                if data == b"[DONE]":
                    return
                event = self.client.decode(data, self.path)
                if isinstance(event, dict) and "error" in event:
                    raise self.client.http_error(200, self.path, data)
                yield event
        finally:
            self.close()


# What a timeout raises: socket.timeout became an alias of TimeoutError only in Python 3.10.
TIMEOUTS = (TimeoutError, socket.timeout)


class HttpClient:
    """Every request the lab sends to one server: JSON in and out, under one deadline an
    answer (connecting, the status line, the headers, every byte of the body: the watchdog
    keeps it), a stop signal honoured within STOP_GRACE_S, redirects followed only within
    the server, every failure a one-line ServerError."""

    def __init__(self, base_url: str, api_key: Optional[str], timeout: float, max_bytes: int):
        self.base_url = base_url.rstrip("/")
        self.api_key, self.timeout, self.max_bytes = api_key, timeout, max_bytes
        self.route = Route.to(self.base_url)

    def request(self, path: str, body: Optional[Dict[str, Any]] = None,
                as_text: bool = False) -> Any:
        """GET (body None) or POST JSON; returns the decoded JSON answer (with as_text, the
        answer's text) or raises ServerError.
        A GET redirected within the server follows the redirect (at most MAX_REDIRECTS
        times); a POST never does."""
        target = path
        for _ in range(MAX_REDIRECTS + 1):
            exchange = Exchange(self, "GET" if body is None else "POST", target, body)
            exchange.connect()
            exchange.send()
            status, location, raw = exchange.whole_answer()
            if status not in REDIRECTS or location is None:
                break
            target = self.redirected(status, location, target)
            if body is not None:
                break  # a POST's redirect is answered as the error it is
        if status >= 300:
            raise self.http_error(status, path, raw)
        return self.decode(raw, path, as_text)

    def redirected(self, status: int, location: str, target: str) -> str:
        """The path a redirect sends the lab to, refused when it leaves the server."""
        here = urllib.parse.urlsplit(self.base_url + target)
        there = urllib.parse.urlsplit(urllib.parse.urljoin(self.base_url + target, location))
        if (there.scheme, there.netloc) != (here.scheme, here.netloc):
            shown = urllib.parse.urlunsplit((there.scheme, there.netloc, there.path, "", ""))
            raise ServerError(
                "%s://%s answered HTTP %d, redirecting to %s, another server: the lab follows no "
                "redirect away from the server it was given (give that URL instead, if it is "
                "the one)" % (here.scheme, here.netloc, status, shown[:200]))
        base_path = urllib.parse.urlsplit(self.base_url).path
        path = there.path[len(base_path):] if there.path.startswith(base_path) else there.path
        return path + ("?" + there.query if there.query else "")

    def deadline(self) -> Deadline:
        """The deadline of one answer, starting now."""
        late = "no complete answer from %s within %gs (--timeout)" % (self.base_url, self.timeout)
        return Deadline(self.timeout, lambda: ServerError(late))

    def http_error(self, status: int, path: str, body: bytes) -> ServerError:
        message = server_message(body)[:300]
        hint = ""
        if status == 401 and self.api_key:
            hint = " (the server refused the key given: is it the --api-key it was started with?)"
        elif status == 401:
            hint = (" (the server wants an API key: give it with --api-key or $OPENAI_API_KEY, "
                    "as the server's own --api-key)")
        return ServerError("HTTP %d from %s: %s%s" % (status, path, message, hint), status)

    def transport_error(self, reason: Any, url: str) -> ServerError:
        """What went wrong on the way to the server, said as what it is."""
        if isinstance(reason, OSError) and reason.errno in (errno.EMFILE, errno.ENFILE):
            return ServerError(
                "this machine ran out of open files (%s), not the server: raise the limit "
                "(ulimit -n) or send fewer requests at once" % os.strerror(reason.errno))
        if isinstance(reason, ssl.SSLCertVerificationError):
            return ServerError("the TLS certificate of %s is not trusted here (%s)" %
                               (self.base_url, reason.verify_message or reason.reason))
        if isinstance(reason, ssl.SSLError):
            return ServerError("TLS with %s failed (%s): engines serve plain HTTP unless "
                               "started with a certificate; try %s"
                               % (self.base_url, reason.reason or reason,
                                  "http://" + self.base_url.split("://", 1)[-1]))
        if isinstance(reason, (OSError, HTTPException)) and not isinstance(
                reason, TIMEOUTS + (ConnectionRefusedError, socket.gaierror)):
            return ServerError("connection to %s dropped (%s)" % (url, type(reason).__name__))
        if isinstance(reason, ConnectionRefusedError):
            return ServerError("connection refused by %s: is the server running? (one still "
                               "loading its model refuses connections: --wait-ready SECONDS "
                               "waits for it)" % self.base_url)
        if isinstance(reason, socket.gaierror):
            return ServerError("cannot resolve the host of %s" % self.base_url)
        if isinstance(reason, TIMEOUTS):
            return ServerError("no answer from %s within %gs (--timeout)" %
                               (self.base_url, self.timeout))
        return ServerError("cannot reach %s: %s" % (self.base_url, reason))

    @staticmethod
    def decode(raw: bytes, path: str, as_text: bool = False) -> Any:
        if as_text:
            return raw.decode("utf-8", "replace")
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than Python parses
            raise ServerError("invalid JSON from %s (%d bytes)" % (path, len(raw)),
                              kind=ServerError.ANSWER) from None

    def _read_capped(self, resp) -> bytes:
        """The body, no larger than --max-response-mb (its deadline is the caller's)."""
        chunks, total = [], 0
        while True:
            chunk = resp.read1(1 << 16)
            if not chunk:
                break
            total += len(chunk)
            if total > self.max_bytes:
                raise ServerError("answer larger than %d MB refused (--max-response-mb)" %
                                  (self.max_bytes >> 20))
            chunks.append(chunk)
        if getattr(resp, "length", None):  # the server hung up before the length it announced
            raise ServerError("connection to %s dropped in the middle of an answer"
                              % self.base_url)
        return b"".join(chunks)


def writable(sock: socket.socket, seconds: float) -> bool:
    """Wait at most seconds for sock to be writable (poll takes any number of descriptors;
    select only those below 1024, fewer than a thousand concurrent requests open)."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(sock, select.POLLOUT)
        return bool(poller.poll(seconds * 1000))
    return bool(select.select([], [sock], [], seconds)[1])


def sliced_connection(deadline: Deadline) -> Callable[..., socket.socket]:
    """What http.client calls to open its socket (socket.create_connection's part): the
    connect waited for in slices of the deadline, so that an unreachable server neither
    outlasts it nor holds a stop signal; the socket then blocks, handed to the watchdog at
    once, so that a TLS handshake or a proxy's tunnel that follows is under the deadline too."""

    def create(address: Tuple[str, int], *unused: Any) -> socket.socket:
        failure: Optional[OSError] = None
        for family, kind, proto, _, addr in socket.getaddrinfo(*address, 0, socket.SOCK_STREAM):
            sock = socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                code = sock.connect_ex(addr)
                while code in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EALREADY, errno.EINTR):
                    if writable(sock, deadline.left()):
                        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code:
                    raise OSError(code, os.strerror(code))  # e.g. ConnectionRefusedError
                sock.setblocking(True)
                WATCHDOG.watch(deadline, sock)
                return sock
            except OSError as err:
                sock.close()
                failure = err
            except BaseException:
                sock.close()
                raise
        raise failure or OSError("no address for %s" % address[0])

    return create


def allow_open_files(connections: int) -> None:
    """Raise this process's open-file limit so that many connections can be open at once
    (a common soft limit is 1024); where it cannot be raised, the connects fail one by one."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = connections + 256
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(
                resource.RLIMIT_NOFILE,
                (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard), hard))
    except (ImportError, ValueError, OSError):
        pass


class Stopped(KeyboardInterrupt):
    """A stop asked for by a signal; the run ends with the signal's own exit code."""

    def __init__(self, signum: int):
        super().__init__()
        self.signum = signum


STOP_SIGNALS = {
    "SIGINT": (EXIT_INTERRUPTED, "interrupted"),
    "SIGTERM": (EXIT_TERMINATED, "terminated"),
    "SIGHUP": (EXIT_HANGUP, "hung up")}  # signal -> (exit code, state); SIGHUP is not on Windows


def in_threads(jobs: Sequence[Callable[[], Any]],
               meanwhile: Optional[Callable[[], None]] = None) -> List[Any]:
    """The one place the lab starts threads for its requests (the Watchdog keeps its own):
    each job in a daemon thread of its own, meanwhile (when given) in the calling thread
    while they run, then every thread joined. Returns each job's result, or the exception
    it raised (failed_outcome raises the first of them in the caller)."""
    results: List[Any] = [None] * len(jobs)

    def run(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except BaseException as err:  # raised in the calling thread, by failed_outcome
            results[i] = err

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(jobs))]
    for t in threads:
        t.start()
    try:
        if meanwhile is not None:
            meanwhile()
    finally:
        for t in threads:
            t.join()
    return results


def failed_outcome(outcomes: Sequence[Any], what: str) -> None:
    """Raise, in the thread that sent them, what the worst of many requests' threads raised:
    a stop first, then anything unforeseen (so that it ends the run as in this thread), then
    the first server error, with how many failed."""
    raised = [o for o in outcomes if isinstance(o, BaseException)]
    if not raised:
        return
    stop = next((o for o in raised if isinstance(o, KeyboardInterrupt)), None)
    unforeseen = next((o for o in raised if not isinstance(o, ServerError)), None)
    if stop or unforeseen:
        raise stop or unforeseen
    raise ServerError("%s (%d of %d %s failed)" % (raised[0], len(raised), len(outcomes), what),
                      raised[0].status, raised[0].kind)


# ----------------------------------------------------------------------------
# Engine adapters: each engine's wire format in, Completion and ServerFacts records out.
# Nothing below this section knows which engine answered.


@dataclass(frozen=True)
class Sampling:
    """What every generation request asks for; saved as the sweep's params (as_record)."""

    temperature: float
    top_p: float
    max_tokens: int
    logprobs: Optional[int]  # top-k per step; None asks for none
    seed: Optional[int] = None  # sent only when temperature > 0 (see of())
    ignore_eos: bool = field(default=False, metadata=NOT_SAVED)  # cost's fixed output length
    top_k: int = DEFAULT_TOP_K  # every sampling parameter is sent, never left to the model's
    min_p: float = DEFAULT_MIN_P
    repetition_penalty: float = DEFAULT_REPETITION_PENALTY

    @classmethod
    def of(cls, temperature: float, max_tokens: int, logprobs: Optional[int], seed: int,
           ignore_eos: bool = False) -> "Sampling":
        """The seed is sent only when sampling: greedy needs none, and an unseeded sample
        would draw from a generator the whole batch shares (vLLM's old V1 runner) or, in
        vLLM's V2 runner, may take another sampler depending on its neighbours (HAZARDS)."""
        return cls(temperature, DEFAULT_TOP_P, max_tokens, logprobs,
                   seed if temperature > 0 else None, ignore_eos)


def is_count(x: Any) -> bool:
    """A whole number from 1 to MAX_SERVER_COUNT (true is not a count)."""
    return isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= MAX_SERVER_COUNT


def total_count(counts: Sequence[Optional[int]]) -> Optional[int]:
    """The sum of counts a server reported, None where any is not known."""
    return None if not counts or None in counts else sum(counts)


def logprobs_limit(value: Any) -> Optional[int]:
    """The most top logprobs a server allows, from what it states (vLLM's max_logprobs): a
    whole number from 0 (0: none allowed); anything else is unknown (None), -1 included,
    which vLLM takes as no limit (vllm/config/model.py line 300, vLLM 0.34.0: ge=-1)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SERVER_COUNT:
        return value
    return None


def plain_scalar(value: Any) -> Any:
    """A value to print as it is: a string (cut to 120 characters, printable on one line),
    number, boolean or null; anything else a server sent in its place becomes null."""
    if isinstance(value, str):
        return printable(value[:120])
    return value if value is None or isinstance(value, (bool, int, float)) else None


def plain_value(value: Any) -> Any:
    """A setting's value, as the server sent it when it is small and shallow; otherwise its
    JSON text, cut to 200 characters (so it still compares, prints and saves)."""
    try:
        text = json.dumps(value)
    except (ValueError, TypeError, RecursionError):
        return repr(type(value))
    return value if len(text) <= 200 else text[:200]


def shape_error(what: str) -> ServerError:
    return ServerError("answer of the wrong shape: " + what, kind=ServerError.ANSWER)


@dataclass
class ServerFacts:
    """What the lab knows of one server, in one shape whichever engine runs it."""

    engine: str  # the adapter's name
    model: str  # the served model the lab will ask for
    version: Any = None
    flag: Optional[bool] = None  # the batch-invariance flag; None: the server does not say
    max_model_len: Any = None
    max_model_len_source: Optional[str] = None  # where the server keeps it (effective first)
    attention_backend: Any = None  # as the adapter spells it (vLLM: the class name)
    tp: Any = None
    max_num_seqs: Any = None  # the most requests the server runs together
    max_num_seqs_source: Optional[str] = None  # where the server keeps it (effective first)
    seed_honoured: Optional[bool] = None  # does a per-request seed fix the sample? None: unknown
    seed_note: Optional[str] = None  # why not, when it is not
    load_format: Any = None
    graph_sizes: List[int] = field(default_factory=list)  # decode CUDA graphs; [] when none run
    graph_source: str = "assumed"  # reported, derived (from reported settings) or assumed
    # the engine's own graph sizes; ladders use them where the server runs no graphs
    default_graph_sizes: List[int] = field(default_factory=list)
    info_source: Optional[str] = None  # the endpoint the settings came from; None: hidden
    settings_hint: Optional[str] = None  # how to make a server that hides its settings show them
    settings: Dict[str, Any] = field(default_factory=dict)  # label -> value, compared between arms
    # label -> the value the flag itself gives that setting on this engine
    flag_sets: Dict[str, Any] = field(default_factory=dict)
    # known hazards this server's settings meet; None: hidden
    hazards: Optional[List[Dict[str, Any]]] = None
    # the model's id as the server gave it, which requests name it by; model is what the lab
    # prints and saves (the same, but where the server's text held the API key: without_key)
    model_id: str = field(default="", metadata=NOT_SAVED)
    # the most top logprobs a request may ask for, where the server says (vLLM --max-logprobs)
    max_logprobs: Any = field(default=None, metadata=NOT_SAVED)

    def bucket(self, batch_size: int) -> Bucket:
        assumed = self.graph_source == "assumed"
        return "?" if assumed else graph_bucket(batch_size, self.graph_sizes)

    def differing(self, other: "ServerFacts") -> List[Tuple[str, Any, Any]]:
        """(label, this server's value, the other's) of every setting both report, and report
        otherwise; a setting only one reports is unknown on the other, never a difference."""
        labels = sorted(self.settings.keys() & other.settings.keys())
        return [(label, self.settings[label], other.settings[label]) for label in labels
                if self.settings[label] != other.settings[label]]

    def without_key(self) -> "ServerFacts":
        """These facts as the lab may print and save them: the API key hidden in every value
        the server sent (what a server says of itself may hold it: SGLang's /server_info
        lists its api_key), the id requests name the model by kept as the server gave it."""
        values = {f.name: SECRETS.hidden(getattr(self, f.name)) for f in dataclasses.fields(self)
                  if f.name != "model_id"}
        return dataclasses.replace(self, **values, model_id=self.model_id or self.model)

    def checked(self) -> "ServerFacts":
        """These facts with every value a server sent made safe to use: a server may send any
        JSON at any key. What is not of its kind becomes unknown; nothing raises later."""
        if not isinstance(self.model, str) or not self.model:
            raise shape_error("the server names no model")
        self.flag = self.flag if isinstance(self.flag, bool) else None
        self.seed_honoured = self.seed_honoured if isinstance(self.seed_honoured, bool) else None
        for name in ("version", "max_model_len", "attention_backend", "tp", "load_format"):
            setattr(self, name, plain_scalar(getattr(self, name)))
        if not is_count(self.max_num_seqs):
            self.max_num_seqs, self.max_num_seqs_source = None, None
        if not (isinstance(self.graph_sizes, list) and all(map(is_count, self.graph_sizes))):
            self.graph_sizes, self.graph_source = list(self.default_graph_sizes), "assumed"
        self.settings = {label: plain_value(v) for label, v in self.settings.items()}
        return self


class EngineAdapter(Protocol):
    """Everything the modes know of an engine."""

    name: str  # as --engine spells it
    label: str  # as printed
    default_port: int
    generate_path: str
    health_path: str
    flag_name: str
    logprob_clamps: Tuple[float, ...]  # the engine's stand-ins for a -inf logprob
    CACHE_COUNTS_HINT: str  # how to have the server report cached prompt tokens
    PREFILL_BUDGET: str  # the settings label of the chunked-prefill budget
    # verdict -> what this engine's prefix cache adds to the sweep's advice on it (sweep_advice):
    # only an adapter knows how its engine keeps requests apart, or counts what it served
    CACHE_ADVICE: Dict[str, str]

    def answers_like(self, client: HttpClient) -> bool:
        """Does the server at client answer this engine's own info endpoint as this engine does?
        A server that answers with an HTTP error does not; one that cannot be reached raises."""

    def read_facts(self, client: HttpClient, model: Optional[str]) -> ServerFacts:
        """What the server says of itself; model, when given, must be one it serves."""

    def body(self, model: str, prompts: List[str], sampling: Sampling, isolate: bool = False,
             cache_key: Optional[str] = None) -> Dict[str, Any]:
        """The generation request; isolate: nothing an earlier request cached may serve it
        (a fresh cache key); cache_key: this key, so that a repeat is served from the cache."""

    def before_batch(self, client: HttpClient, isolate: bool) -> None:
        """Called before every batch size is sent; isolate as in body()."""

    def completions(self, answer: Any, n: int, with_logprobs: bool) -> List[Completion]:
        """The answer's n completions, checked, with their per-step logprobs if asked."""

    def output_tokens(self, answer: Any) -> int:
        """The answer's output tokens, as the server counts them."""

    def cached_tokens(self, answer: Any) -> Optional[int]:
        """Prompt tokens the server says it served from its prefix cache; None: it does not say."""

    def cached_per_prompt(self, answer: Any, prompts: List[str]) -> List[Optional[int]]:
        """Each prompt's tokens served from the prefix cache, where the server's count can be
        that prompt's (None: not known for that prompt)."""

    def prompt_tokens(self, answer: Any) -> Optional[int]:
        """The request's prompt tokens, every prompt's, as the server counts them (None: it
        does not say): what its prefix-cache counters should have looked up for it."""

    def prefix_cache_counters(self, client: HttpClient) -> Optional["CacheCounters"]:
        """The server's own prefix-cache counters now (its /metrics), or None where it exposes
        none; a missing, failing or malformed /metrics is None, never an error."""

    def prefix_cache_off(self, settings: Dict[str, Any]) -> bool:
        """Do the server's settings (ServerFacts.settings) say its prefix cache is off?"""

    def stream_body(self, model: str, prompt: str, sampling: Sampling) -> Dict[str, Any]:
        """One prompt's generation request, streamed."""

    def streamed_tokens(self, event: Any) -> Optional[int]:
        """Output tokens so far, as a stream event reports them (None: this event does not say)."""

    def prompt_token_ids(self, client: HttpClient, model: str, prompt: str) -> List[int]:
        """The prompt as the server tokenizes it for a completion."""

    def prefill_logprobs(self, client: HttpClient, model: str, ids: List[int], start: int,
                         isolate: bool) -> List[float]:
        """The logprob of each token of ids from position start on, as the server computes it
        when it reads ids as one prompt (a prefill)."""

    def prefill_only_body(self, model: str, ids: List[int]) -> Dict[str, Any]:
        """A request that prefills ids (a token-id prompt, a cache key of its own) and writes
        one token: a neighbour that shares a decode's step with its prefill alone."""




def server_count(value: Any, what: str, absent: Optional[int] = None) -> Optional[int]:
    """A count a server reports (tokens, cached tokens): a whole number from 0 to
    MAX_SERVER_COUNT, checked before any arithmetic; absent when the server sent none."""
    if value is None:
        return absent
    if not (isinstance(value, int) and not isinstance(value, bool)):
        raise shape_error("%s is not a whole number" % what)
    if not 0 <= value <= MAX_SERVER_COUNT:
        raise shape_error("%s is %s, out of range" % (what, str(value)[:30]))
    return value


TOKEN_ID = r"token_id:([0-9]{1,12})"  # how both engines spell a token by its id


def token_id(token: str) -> Optional[int]:
    """The id in a token spelled "token_id:N" (N ASCII digits only), or None."""
    found = re.fullmatch(TOKEN_ID, token)  # (compiled on first use, as every pattern here)
    return int(found.group(1)) if found else None


def dig(data: Any, *keys: str) -> Any:
    """data[k1][k2]... through nested objects, or None when any step is missing."""
    for key in keys:
        data = data.get(key) if isinstance(data, dict) else None
    return data


def is_number(x: Any) -> bool:
    """A JSON number a float can hold (true and false are not numbers here)."""
    return isinstance(x, float) or (isinstance(x, int) and not isinstance(x, bool)
                                    and abs(x) < 2**1000)


def checked_completion(i: int, text: str, tokens: Any, logprobs: Any, top: Any, finish: Any,
                       previous: Optional[Completion]) -> Completion:
    """Completion i of an answer, from its per-step lists, refused when downstream code could
    not compare them; a copy of the previous completion of the answer (copies of one prompt
    mostly are) shares its lists."""
    if not isinstance(logprobs, list) or not isinstance(tokens, list):
        raise shape_error("completion %d has no logprobs" % i)
    if not isinstance(top, list) or not (len(tokens) == len(logprobs) == len(top)):
        raise shape_error("completion %d has %d tokens but %d logprobs" %
                          (i, len(tokens), len(logprobs)))
    # The types of every value at once, in C: the per-value checks run only on the rare
    # answer that holds something other than strings, floats and objects of floats.
    if not set(map(type, tokens)) <= {str}:
        raise shape_error("completion %d has a token that is not a string" % i)
    if not set(map(type, top)) <= {dict}:
        raise shape_error("completion %d has malformed top logprobs" % i)
    if previous is not None and logprobs == previous.logprobs and top == previous.top_logprobs:
        # A copy: it holds the previous completion's values, checked already; sharing the
        # lists makes every later comparison of the two an identity check
        if tokens == previous.tokens:
            tokens = previous.tokens
        c = Completion(text, tokens, previous.logprobs, previous.top_logprobs,
                       plain_scalar(finish))
        c.memo.update(previous.memo)
        return c
    values = logprobs + list(itertools.chain.from_iterable(map(dict.values, top)))
    if not set(map(type, values)) <= {float}:
        if not all(map(is_number, logprobs)):
            raise shape_error("completion %d has a logprob that is not a number" % i)
        if not all(map(is_number, itertools.chain.from_iterable(map(dict.values, top)))):
            raise shape_error("completion %d has malformed top logprobs" % i)
    return Completion(text, tokens, logprobs, top, plain_scalar(finish))


def is_token_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_SERVER_COUNT


def token_ids(values: Any, what: str) -> List[int]:
    if not isinstance(values, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in values):
        raise shape_error("%s are not token ids" % what)
    return values


def prefill_values(values: List[Any], count: int, what: str) -> List[float]:
    if len(values) != count or not all(map(is_number, values)):
        raise shape_error("%s: %d logprobs for %d tokens" % (what, len(values), count))
    return values


def choice_order(choices: List[Any]) -> List[Any]:
    """vLLM's choices by their index, which must be the whole numbers 0..n-1, each once."""
    indexes = [c.get("index") if isinstance(c, dict) else None for c in choices]
    whole = all(isinstance(x, int) and not isinstance(x, bool) for x in indexes)
    if not whole or sorted(indexes) != list(range(len(choices))):
        raise shape_error("choice indexes are not 0..%d, each once" % (len(choices) - 1))
    return [c for _, c in sorted(zip(indexes, choices), key=lambda pair: pair[0])]


def fresh_cache_key() -> str:
    """A prefix-cache key no earlier request used (the bypass's; a cache check's cold batch)."""
    return "lab-" + os.urandom(12).hex()


def answer_or_none(client: HttpClient, path: str) -> Any:
    """The answer to a GET, or None when the server answers with an HTTP error or invalid JSON;
    a server that cannot be reached still raises."""
    try:
        return client.request(path)
    except ServerError as err:
        if err.kind == ServerError.NETWORK:
            raise
        return None


@dataclass(frozen=True)
class CacheCounters:
    """A server's own prefix-cache counters at one moment, in prompt tokens since it started:
    kept by its scheduler, apart from the cached-token count each answer reports."""

    queried: int  # prompt tokens looked up in the prefix cache
    served: int  # of them, tokens the cache served
    source: str  # the metrics they were read from


PROMETHEUS_SAMPLE = re.compile(  # name{labels} value [timestamp], Prometheus' text format
    r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)(?:[ \t]+\S+)?")
PROMETHEUS_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def metric_sums(text: Any, name: str,
                labels: Optional[Dict[str, Sequence[str]]] = None) -> Optional[float]:
    """The sum of a metric's samples in a Prometheus text answer (one per engine or rank),
    only those whose labels take one of the given values; 0 for a family declared with no
    sample yet (a labelled counter shows none until first counted); None when the answer
    holds no such metric or is not text. Malformed or non-finite samples are skipped."""
    if not isinstance(text, str):
        return None
    declared, total = False, 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            words = line.split()
            declared = declared or (len(words) >= 3 and words[1] in ("TYPE", "HELP")
                                    and words[2] in (name, name[:-len("_total")]))
            continue
        found = PROMETHEUS_SAMPLE.fullmatch(line.strip())
        if found is None or found.group(1) != name:
            continue
        declared = True
        pairs = dict(PROMETHEUS_LABEL.findall(found.group(2) or ""))
        if any(pairs.get(key) not in allowed for key, allowed in (labels or {}).items()):
            continue
        try:
            value = float(found.group(3))
        except ValueError:
            continue
        if math.isfinite(value) and 0 <= value <= MAX_SERVER_COUNT:
            total += value
    return total if declared else None


def metrics_text(client: HttpClient) -> Optional[str]:
    """GET /metrics as text, or None when the server does not answer it (any HTTP error, a
    dropped or refused connection): the counters are evidence to add, never a reason to fail."""
    try:
        text = client.request("/metrics", as_text=True)
    except ServerError:
        return None
    return text if isinstance(text, str) else None


CACHE_COUNTED_AND_SERVED = "counted and served"
CACHE_SERVED_NOT_COUNTED = "served but not counted"
CACHE_NEITHER = "neither served nor counted"
CACHE_EVIDENCE_UNKNOWN = "unknown"


@dataclass(frozen=True)
class CacheEvidence:
    """What the server's counters and its answers say together of one batch's prefix-cache
    hits (cache_evidence)."""

    verdict: str  # one of the four CACHE_* words above
    served: Optional[int]  # prompt tokens the counters say the cache served during the batch
    counted: Optional[int]  # cached tokens the batch's answers reported (None: none reported)
    why: str  # the words behind the verdict

    @property
    def uncounted(self) -> bool:
        """The cache served more of the batch than its answers counted: which of its requests
        it served, the answers do not say."""
        if self.verdict == CACHE_SERVED_NOT_COUNTED:
            return True
        return self.verdict == CACHE_COUNTED_AND_SERVED and self.served > (self.counted or 0)

    def note(self) -> str:
        """The disagreement, in the words of a row's notes."""
        return ("the server's counters: %d prompt tokens served from the cache, the answers "
                "counted %s" % (self.served, self.counted or "none"))


def cache_evidence(before: Optional[CacheCounters], after: Optional[CacheCounters],
                   reported: Sequence[Optional[int]],
                   prompt_tokens: Optional[int] = None) -> CacheEvidence:
    """Did the prefix cache serve a batch, by the server's own counters read before and after
    it, and did the batch's answers count it? reported: each request's cached-token count
    (None where an answer said nothing). prompt_tokens, when known: the batch's prompt tokens;
    counters that queried more than that saw other clients' requests too, and say nothing of
    this batch alone; counters that looked up fewer have not counted the whole batch yet (an
    engine counts a step after it runs it). Counters that went down (a restarted server),
    counters missing, and answers that counted hits the counters did not see, are unknown."""
    counts = [c for c in reported if isinstance(c, int) and not isinstance(c, bool)]
    counted = sum(counts) if counts else None
    if before is None or after is None:
        return CacheEvidence(CACHE_EVIDENCE_UNKNOWN, None, counted,
                             "the server exposes no prefix-cache counters")
    served, queried = after.served - before.served, after.queried - before.queried
    if served < 0 or queried < 0:
        return CacheEvidence(CACHE_EVIDENCE_UNKNOWN, None, counted,
                             "the counters went down (the server restarted?)")
    if prompt_tokens is not None and queried > prompt_tokens:
        return CacheEvidence(CACHE_EVIDENCE_UNKNOWN, served, counted,
                             "the counters looked up %d prompt tokens, more than the batch's "
                             "%d: other requests reached the server meanwhile"
                             % (queried, prompt_tokens))
    if prompt_tokens is not None and queried < prompt_tokens:
        return CacheEvidence(CACHE_EVIDENCE_UNKNOWN, served, counted,
                             "the counters looked up %d prompt tokens of the batch's %d: they "
                             "had not counted it all yet" % (queried, prompt_tokens))
    if served > 0 and counted:
        return CacheEvidence(CACHE_COUNTED_AND_SERVED, served, counted,
                             "the cache served %d prompt tokens and the answers counted %d"
                             % (served, counted))
    if served > 0:
        return CacheEvidence(CACHE_SERVED_NOT_COUNTED, served, counted,
                             "the cache served %d prompt tokens, and the answers reported %s"
                             % (served, "none" if counted is None else "0 cached tokens"))
    if counted:
        return CacheEvidence(CACHE_EVIDENCE_UNKNOWN, served, counted,
                             "the answers counted %d cached tokens the counters did not see"
                             % counted)
    return CacheEvidence(CACHE_NEITHER, 0, counted, "the cache served no prompt token")


class CounterWatch:
    """The server's own prefix-cache counters, read before and after each batch the lab sends
    (the sweep's and its checks' alike) and judged against the batch's answers
    (cache_evidence). Counters that lag are waited for, longer after each batch they did not
    settle in; counters that never move, or a /metrics that stops answering, are read no
    more, and why is kept (stopped) for the summary to say. A batch they had not counted by
    the end of the wait is waited for again before the next one starts, so that its late
    count is not taken for the next batch's."""

    def __init__(self, adapter: EngineAdapter, client: HttpClient, start: CacheCounters):
        self.adapter = adapter
        # its own client: a /metrics that hangs costs METRICS_TIMEOUT_S, not --timeout
        self.client = HttpClient(client.base_url, client.api_key,
                                 min(client.timeout, METRICS_TIMEOUT_S), client.max_bytes)
        self.start = start  # at the sweep's start: counters that stay there count nothing
        self.settle = COUNTERS_SETTLE_S  # how long to wait for a batch to be counted
        self.stopped = ""  # why the counters are no longer read ("": they are)
        # the counters have shown the cache serving what the answers did not count: from
        # then on an answer's count of 0 proves nothing where the counters cannot say
        self.uncounted_seen = False
        self.owed: Optional[int] = None  # the lookups a batch not yet counted brings them to

    def read(self) -> Optional[CacheCounters]:
        if self.stopped:
            return None
        found = self.adapter.prefix_cache_counters(self.client)
        if found is None:
            self.stopped = "its /metrics stopped answering with them"
        return found

    def before(self) -> Optional[CacheCounters]:
        """The counters before a batch, once they have counted the last one."""
        found = self.read()
        deadline = time.monotonic() + self.settle
        while (found is not None and self.owed is not None and found.queried < self.owed
               and time.monotonic() < deadline):
            time.sleep(COUNTERS_POLL_S)
            found = self.read()
        self.owed = None
        return found

    def after(self, before: Optional[CacheCounters], prompt_tokens: Optional[int],
              counted: Optional[int]) -> Optional[CacheEvidence]:
        """The batch's evidence, once its prompt tokens are counted (or the wait is over);
        None where the counters were not read before it."""
        if before is None:
            return None
        deadline = time.monotonic() + self.settle
        after = self.read()
        while (after is not None and prompt_tokens is not None
               and after.queried - before.queried < prompt_tokens
               and time.monotonic() < deadline):
            time.sleep(COUNTERS_POLL_S)
            after = self.read()
        seen = cache_evidence(before, after, [counted], prompt_tokens)
        if after is None:
            return seen
        if prompt_tokens is not None and after.queried - before.queried < prompt_tokens:
            if self.settle >= COUNTERS_SETTLE_MAX_S:
                # not counted through the longest wait: counters that lag so far would pin
                # each batch's lookups on the next, and counters that looked nothing up are
                # not counting this traffic (vLLM counts none with prefix caching off)
                self.stopped = ("they looked up nothing through a wait of %gs"
                                if after.queried == self.start.queried else
                                "they had not counted a batch after a wait of %gs"
                                ) % self.settle
            self.settle = min(self.settle * 2, COUNTERS_SETTLE_MAX_S)  # lagging: wait longer
            self.owed = before.queried + prompt_tokens
        self.uncounted_seen = self.uncounted_seen or seen.uncounted
        return seen


class VllmAdapter:
    name = "vllm"
    label = "vLLM"
    default_port = 8000
    generate_path = "/v1/completions"
    health_path = "/health"  # 200 once the model is loaded
    flag_name = "VLLM_BATCH_INVARIANT"
    logprob_clamps = (-9999.0,)  # vLLM writes -inf logprobs as -9999.0
    DEFAULT_MAX_NUM_SEQS = 32  # assumed when the server does not say (upstream's test value)
    SETTINGS_HINT = "start vLLM with VLLM_SERVER_DEV_MODE=1 to expose /server_info"
    CACHE_COUNTS_HINT = "start vLLM with --enable-prompt-tokens-details to have them reported"
    PREFILL_BUDGET = "max num batched tokens"  # the setting that splits a long prefill into chunks
    CACHE_ADVICE = {
        CACHE_CONFOUNDED: "vLLM's copies of one request share its cache whatever the salt: sweep "
        "with --traffic concurrent, whose requests carry a salt each.",
        SERVED_ONLY: "vLLM's copies of one request share its cache whatever the salt: sweep with "
        "--traffic concurrent, whose requests carry a salt each.",
        CACHE_UNKNOWN: "vLLM counts cached tokens only with --enable-prompt-tokens-details, and "
        "for a request of several prompts only its last prompt's count.",
        CACHE_UNCLEAR: "vLLM counts a request of several prompts' cached tokens for its last "
        "prompt only (under --traffic mixed, often a filler).",
        BASELINE_SERVED: "vLLM keeps requests apart by their cache_salt, which the bypass sends."}

    # (label, path in /server_info) of every setting that changes the arithmetic or the batching
    SETTINGS = [
        ("model", ("vllm_config", "model_config", "model")),
        ("dtype", ("vllm_config", "model_config", "dtype")),
        ("quantization", ("vllm_config", "model_config", "quantization")),
        ("load format", ("vllm_config", "load_config", "load_format")),
        ("max model length", ("vllm_config", "model_config", "max_model_len")),
        ("logprobs mode", ("vllm_config", "model_config", "logprobs_mode")),
        ("enforce eager", ("vllm_config", "model_config", "enforce_eager")),
        ("attention backend", ("vllm_config", "attention_config", "backend")),
        ("TP size", ("vllm_config", "parallel_config", "tensor_parallel_size")),
        ("PP size", ("vllm_config", "parallel_config", "pipeline_parallel_size")),
        ("max num seqs", ("vllm_config", "scheduler_config", "max_num_seqs")),
        ("max num batched tokens", ("vllm_config", "scheduler_config", "max_num_batched_tokens")),
        ("chunked prefill", ("vllm_config", "scheduler_config", "enable_chunked_prefill")),
        ("prefix caching", ("vllm_config", "cache_config", "enable_prefix_caching")),
        ("KV-cache dtype", ("vllm_config", "cache_config", "cache_dtype")),
        ("CUDA-graph mode", ("vllm_config", "compilation_config", "cudagraph_mode")),
        ("CUDA-graph sizes", ("vllm_config", "compilation_config", "cudagraph_capture_sizes")),
        ("compilation mode", ("vllm_config", "compilation_config", "mode")),
        # 0.33.0's environment variable; from 0.34.0 BREAKABLE_RESOLVED holds the setting in force
        ("breakable CUDA graph", ("vllm_env", "VLLM_USE_BREAKABLE_CUDAGRAPH")),
        ("FlashInfer sampler", ("vllm_env", "VLLM_USE_FLASHINFER_SAMPLER"))]
    # Where 0.34.0 keeps whether breakable CUDA graphs run: resolved at start-up from the
    # environment variable, the architecture's default and the flag, stored in the config and
    # no longer written back to the environment (vllm/config/vllm.py lines 810-834,
    # vllm/config/compilation.py lines 735-746 of vLLM 0.34.0); null means unresolved.
    BREAKABLE_RESOLVED = ("vllm_config", "compilation_config", "use_breakable_cudagraph")
    # With the flag on, vLLM turns prefix caching off for these backends itself.
    FLAG_COMPILES_EAGER_FROM = "0.33.0"  # the first release whose flag sets both (flag_sets)
    FLAG_DISABLES_PREFIX_CACHE = ("FlashInferBackend", "TritonMLABackend")

    @staticmethod
    def capture_sizes(max_num_seqs: int) -> List[int]:
        """vLLM's default capture sizes: 1, 2, 4, then steps of 8 (16 above 256), to
        min(2*seqs, 512)."""
        top = min(2 * max_num_seqs, 512)
        sizes = [1, 2, 4] + list(range(8, min(top, 256) + 1, 8)) + list(range(272, top + 1, 16))
        return [s for s in sizes if s <= top]

    @staticmethod
    def short_backend(name: Any) -> Any:
        """vllm.v1.attention.backends.flash_attn.FlashAttentionBackend -> FlashAttentionBackend."""
        return name.rsplit(".", 1)[-1] if isinstance(name, str) else name

    def answers_like(self, client: HttpClient) -> bool:
        # SGLang has no /version
        return isinstance(dig(answer_or_none(client, "/version"), "version"), str)

    def read_facts(self, client: HttpClient, model: Optional[str]) -> ServerFacts:
        version = dig(client.request("/version"), "version")
        models = client.request("/v1/models")
        hint = self.SETTINGS_HINT  # 404: served only with VLLM_SERVER_DEV_MODE=1
        try:
            info = client.request("/server_info?config_format=json")
        except ServerError as err:
            info = None
            if err.status != 404:  # dev mode is on, and the endpoint failed: say what it said
                hint = "its /server_info answered: %s" % err
        return self.facts(version, models, info, model, hint)

    def facts(self, version: Any, models: Any, info: Any, model: Optional[str],
              hint: str = SETTINGS_HINT) -> ServerFacts:
        """The common facts record from /version, /v1/models and (dev mode) /server_info;
        hint: why the settings are unknown when info is None."""
        entries = dig(models, "data")
        entries = entries if isinstance(entries, list) else []
        entries = [m for m in entries if isinstance(m, dict) and m.get("id")]
        if not entries:
            raise ServerError("/v1/models lists no model")
        ids = [m["id"] for m in entries]
        if model is not None and model not in ids:
            raise UsageError("the server does not serve %s; it serves: %s" %
                             (model, ", ".join(ids)))
        entry = entries[ids.index(model)] if model is not None else entries[0]
        listed = {"engine version": version, "served model": entry["id"],
                  "max model length": entry.get("max_model_len")}
        sizes = self.capture_sizes(self.DEFAULT_MAX_NUM_SEQS)
        facts = ServerFacts(self.name, entry["id"], version, seed_honoured=True,
                            max_model_len=entry.get("max_model_len"),
                            max_model_len_source="/v1/models", graph_sizes=sizes,
                            default_graph_sizes=sizes, settings_hint=hint, settings=listed)
        if not isinstance(dig(info, "vllm_config"), dict):
            return facts  # the settings are hidden: only what /v1/models lists
        settings = dict(listed, **{label: dig(info, *path) for label, path in self.SETTINGS})
        facts.max_logprobs = dig(info, "vllm_config", "model_config", "max_logprobs")
        resolved = dig(info, *self.BREAKABLE_RESOLVED)
        if isinstance(resolved, bool):  # 0.34.0 on: the config's value, not the environment's
            settings["breakable CUDA graph"] = resolved
        settings["attention backend"] = backend = self.short_backend(settings["attention backend"])
        max_num_seqs = settings["max num seqs"]
        if isinstance(max_num_seqs, int):
            sizes = self.capture_sizes(max_num_seqs)
        reported = settings["CUDA-graph sizes"]
        if settings["enforce eager"]:
            graph, source = [], "reported"
        elif isinstance(reported, list):
            graph, source = reported, "reported"
        else:
            graph, source = sizes, "assumed"
        flag = dig(info, "vllm_env", self.flag_name)
        return dataclasses.replace(
            facts, flag=flag, attention_backend=backend, tp=settings["TP size"],
            max_num_seqs=max_num_seqs,
            max_num_seqs_source="vllm_config.scheduler_config.max_num_seqs",
            load_format=settings["load format"], graph_sizes=graph, graph_source=source,
            default_graph_sizes=sizes, info_source="/server_info", settings_hint=None,
            settings=settings, hazards=hazards_in(self.name, info, version),
            flag_sets=self.flag_sets(flag, backend, version))

    def flag_sets(self, flag: Any, backend: Any, version: Any) -> Dict[str, Any]:
        """What the flag itself sets on a flag-on server, by setting label: a difference from
        the flag-off arm there is the flag's, never a mismatch. Prefix caching goes off under
        FlashInfer and Triton-MLA; from vLLM 0.33.0 the flag turns on breakable CUDA graphs
        for the model shapes of its tile table, and they run without torch.compile
        (compilation mode NONE, 0: vllm/config/vllm.py lines 842-869 of vLLM 0.33.0, where
        it sets VLLM_USE_BREAKABLE_CUDAGRAPH; lines 810-834 of 0.34.0, where it sets
        compilation_config.use_breakable_cudagraph). A release before 0.33.0, or one the
        server does not name, is granted neither: there they are settings of the user's that
        differ between the arms."""
        if flag is not True:
            return {}
        sets: Dict[str, Any] = {}
        if has_release(version, self.FLAG_COMPILES_EAGER_FROM):
            sets.update({"breakable CUDA graph": True, "compilation mode": 0})
        if backend in self.FLAG_DISABLES_PREFIX_CACHE:
            sets["prefix caching"] = False
        return sets

    def body(self, model: str, prompts: List[str], s: Sampling, isolate: bool = False,
             cache_key: Optional[str] = None) -> Dict[str, Any]:
        body: Dict[str, Any] = {"model": model, "prompt": prompts, "max_tokens": s.max_tokens,
                                "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                                "min_p": s.min_p, "repetition_penalty": s.repetition_penalty}
        if isolate:
            # A fresh salt puts the request's prefix-cache entries apart from every other's
            # (CompletionRequest.cache_salt, vllm/entrypoints/openai/completion/protocol.py,
            # lines 185-195 in vLLM 0.26.0; an empty salt is refused at lines 555-566).
            body["cache_salt"] = cache_key or fresh_cache_key()
        elif cache_key:
            body["cache_salt"] = cache_key
        if s.logprobs is not None:
            body["logprobs"] = s.logprobs
            body["return_tokens_as_token_ids"] = True  # compare ids, not decoded text
        if s.seed is not None:
            body["seed"] = s.seed
        if s.ignore_eos:
            body["ignore_eos"] = True
        return body

    def completions(self, answer: Any, n: int, with_logprobs: bool) -> List[Completion]:
        choices = dig(answer, "choices")
        if not isinstance(choices, list):
            raise shape_error("no choices")
        if len(choices) != n:
            raise shape_error("%d completions for %d prompts" % (len(choices), n))
        out = []
        for i, c in enumerate(choice_order(choices)):
            if not isinstance(c, dict) or not isinstance(c.get("text"), str):
                raise shape_error("completion %d has no text" % i)
            lp = c.get("logprobs")
            if not with_logprobs:
                out.append(Completion(c["text"], [], [], [], c.get("finish_reason")))
                continue
            if not isinstance(lp, dict):
                raise shape_error("completion %d has no logprobs" % i)
            tokens, values = lp.get("tokens"), lp.get("token_logprobs")
            top = lp.get("top_logprobs")
            if isinstance(top, list) and None in top:  # a step without top-k entries
                top = [d or {} for d in top]
            finish = c.get("finish_reason")
            out.append(checked_completion(i, c["text"], tokens, values, top, finish,
                                          (out or [None])[-1]))
        return out

    def before_batch(self, client: HttpClient, isolate: bool) -> None:
        pass  # the per-request salt does it

    def stream_body(self, model: str, prompt: str, sampling: Sampling) -> Dict[str, Any]:
        # Usage on every event, so each says how many tokens are out so far (the real stream
        # in tests/fixtures/vllm-0.26.0/stream_usage.body: usage on every event, then a
        # last event with no choices and the final usage, then [DONE]).
        return dict(self.body(model, [prompt], sampling), stream=True,
                    stream_options={"include_usage": True, "continuous_usage_stats": True})

    def streamed_tokens(self, event: Any) -> Optional[int]:
        return server_count(dig(event, "usage", "completion_tokens"), "usage.completion_tokens")

    def prompt_token_ids(self, client: HttpClient, model: str, prompt: str) -> List[int]:
        # POST /tokenize (vllm/entrypoints/serve/tokenize/protocol.py, 0.26.0 lines 24-40):
        # special tokens added as a completion adds them.
        answer = client.request("/tokenize", {"model": model, "prompt": prompt})
        return token_ids(dig(answer, "tokens"), "/tokenize's tokens")

    def prefill_logprobs(self, client: HttpClient, model: str, ids: List[int], start: int,
                         isolate: bool) -> List[float]:
        # A token-id prompt with prompt_logprobs (completion/protocol.py, 0.26.0 line 94): each
        # position's entry is keyed by token id and holds the actual token's logprob.
        body: Dict[str, Any] = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                                "prompt_logprobs": 0}
        if isolate:
            body["cache_salt"] = fresh_cache_key()
        choices = dig(client.request(self.generate_path, body), "choices") or [None]
        entries = dig(choice_order(choices)[0], "prompt_logprobs")
        if not isinstance(entries, list) or len(entries) != len(ids):
            raise shape_error(
                "no prompt_logprobs for the token-id prompt (the prefill check needs them)")
        return prefill_values(
            [dig(entries[p], str(ids[p]), "logprob") for p in range(start, len(ids))],
            len(ids) - start, "prompt_logprobs")

    def prefill_only_body(self, model: str, ids: List[int]) -> Dict[str, Any]:
        # a token-id prompt (CompletionRequest.prompt takes a list of ids, as the prefill check
        # sends them), greedy, one token, a salt of its own
        return {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                "cache_salt": fresh_cache_key()}

    def output_tokens(self, answer: Any) -> int:
        """Completion tokens of the whole batch (usage; a logprob-free answer has no per-choice
        count)."""
        count = dig(answer, "usage", "completion_tokens")
        return server_count(count, "usage.completion_tokens", 0)

    def cached_tokens(self, answer: Any) -> Optional[int]:
        # Only with --enable-prompt-tokens-details, and for a list prompt only the last
        # prompt's count (vllm/entrypoints/openai/completion/serving.py, 0.26.0, lines 608-616).
        value = dig(answer, "usage", "prompt_tokens_details", "cached_tokens")
        return server_count(value, "usage.prompt_tokens_details.cached_tokens")

    def cached_per_prompt(self, answer: Any, prompts: List[str]) -> List[Optional[int]]:
        # The request's one count is its last prompt's: it is another prompt's only where
        # that prompt is the same text (copies); for any other prompt it is not known
        count = self.cached_tokens(answer)
        return [count if p == prompts[-1] else None for p in prompts]

    def prompt_tokens(self, answer: Any) -> Optional[int]:
        return server_count(dig(answer, "usage", "prompt_tokens"), "usage.prompt_tokens")

    # The scheduler's prefix-cache counters, one sample per engine (vllm/v1/metrics/loggers.py,
    # 0.34.0 lines 661-679: counters vllm:prefix_cache_queries and vllm:prefix_cache_hits,
    # which Prometheus writes with _total, as the real 0.26.0 answer in tests/fixtures shows).
    COUNTER_QUERIES = "vllm:prefix_cache_queries_total"
    COUNTER_HITS = "vllm:prefix_cache_hits_total"

    def prefix_cache_off(self, settings: Dict[str, Any]) -> bool:
        return settings.get("prefix caching") is False

    def prefix_cache_counters(self, client: HttpClient) -> Optional[CacheCounters]:
        text = metrics_text(client)
        queried = metric_sums(text, self.COUNTER_QUERIES)
        served = metric_sums(text, self.COUNTER_HITS)
        if queried is None or served is None:
            return None
        return CacheCounters(int(queried), int(served),
                             "%s, %s" % (self.COUNTER_QUERIES, self.COUNTER_HITS))


class SglangAdapter:
    name = "sglang"
    label = "SGLang"
    default_port = 30000
    generate_path = "/generate"
    health_path = "/health"  # 200 once the engine has loaded
    flag_name = "--enable-deterministic-inference"
    # -inf logprobs become float32's lowest value (python/sglang/srt/layers/logprob_processor.py,
    # 0.5.23 line 926, 0.5.18 line 795: clamp_(min=torch.finfo(logprobs.dtype).min)).
    logprob_clamps = (-3.4028234663852886e38,)
    GRAPH_SIZES = [1, 2, 4, 8, 12, 16, 24, 32]  # decode graphs with --cuda-graph-max-bs-decode 32
    CACHE_COUNTS_HINT = "SGLang reports them in meta_info.cached_tokens; this server did not"
    _KEPT_APART = ("SGLang's bypass empties the radix cache before every batch (/flush_cache) "
                   "and gives every prompt a cache key of its own (extra_key): a request served "
                   "all the same is one the cache did not keep apart (a release that does not "
                   "take extra_key, or other traffic on the server). Start it with "
                   "--disable-radix-cache to compare computed prefills only.")
    CACHE_ADVICE = {CACHE_CONFOUNDED: _KEPT_APART, SERVED_ONLY: _KEPT_APART,
                    BASELINE_SERVED: _KEPT_APART}
    PREFILL_BUDGET = "chunked prefill size"  # the setting that splits a long prefill into chunks
    SEED_NOTE = ("SGLang honours sampling_seed only with --enable-deterministic-inference "
                 "(python/sglang/srt/sampling/sampling_batch_info.py, 0.5.23 lines 157-171)")

    SETTINGS = [(label, (key,)) for label, key in [
        ("model", "model_path"),
        ("dtype", "dtype"),
        ("quantization", "quantization"),
        ("load format", "load_format"),
        ("max model length", "context_length"),
        ("attention backend", "attention_backend"),
        ("TP size", "tp_size"),
        ("PP size", "pp_size"),
        ("DP size", "dp_size"),
        ("max running requests", "max_running_requests"),
        ("chunked prefill size", "chunked_prefill_size"),
        ("max prefill tokens", "max_prefill_tokens"),
        ("radix cache disabled", "disable_radix_cache"),
        ("KV-cache dtype", "kv_cache_dtype"),
        ("CUDA graph disabled", "disable_cuda_graph"),
        ("sampling backend", "sampling_backend"),
        ("CUDA-graph max bs", "cuda_graph_max_bs_decode"),
        ("CUDA-graph max bs (old)", "cuda_graph_max_bs")]] + [
        ("CUDA-graph sizes", ("cuda_graph_config", "decode", "bs")),
        ("CUDA-graph decode backend", ("cuda_graph_config", "decode", "backend")),
        # 0.5.23 captures prefill graphs too ("breakable" on both arms of the real pair in
        # tests/fixtures/sglang-0.5.23): another prefill path on one arm is another arithmetic
        ("CUDA-graph prefill backend", ("cuda_graph_config", "prefill", "backend"))]

    def answers_like(self, client: HttpClient) -> bool:
        info = answer_or_none(client, "/server_info")  # vLLM's (dev mode only) has no model_path
        return isinstance(info, dict) and "model_path" in info

    def read_facts(self, client: HttpClient, model: Optional[str]) -> ServerFacts:
        try:
            info = client.request("/server_info")
        except ServerError as err:
            if err.status != 404:
                raise
            info = client.request("/get_server_info")  # SGLang before /server_info existed
        try:
            models = client.request("/v1/models")
        except ServerError:
            models = None  # the effective context length is then unknown; the raw flag stands in
        return self.facts(info, model, models)

    @staticmethod
    def effective(info: Dict[str, Any],
                  models: Any) -> Tuple[Any, Optional[str], Any, Optional[str]]:
        """(running-request limit, where it came from, context length, where it came from).
        /server_info's max_running_requests and context_length are the raw flags, null by
        default; the limit in force is each DP rank's effective_max_running_requests_per_dp
        (python/sglang/srt/managers/scheduler_components/internal_state.py, 0.5.23 line 73)
        and the context length /v1/models's max_model_len (entrypoints/http_server.py, 0.5.23
        line 2005)."""
        states = info.get("internal_states")
        states = states if isinstance(states, list) else []
        limits = [dig(s, "effective_max_running_requests_per_dp") for s in states]
        limits = [x for x in limits if isinstance(x, int) and not isinstance(x, bool)]
        limit, limit_source = info.get("max_running_requests"), "max_running_requests"
        if limits:
            limit = min(limits)
            limit_source = "internal_states[].effective_max_running_requests_per_dp"
        elif limit is None:
            limit_source = None
        data = dig(models, "data")
        context = dig(data[0], "max_model_len") if isinstance(data, list) and data else None
        if isinstance(context, int) and not isinstance(context, bool):
            return limit, limit_source, context, "/v1/models"
        raw = info.get("context_length")
        return limit, limit_source, raw, "context_length" if raw is not None else None

    def facts(self, info: Any, model: Optional[str], models: Any = None) -> ServerFacts:
        """The common facts record from /server_info's flat server arguments."""
        if not isinstance(info, dict) or "model_path" not in info:
            raise shape_error("server info is not SGLang's (no model_path)")
        served = [m for m in (info.get("model_path"), info.get("served_model_name")) if m]
        if model is not None and model not in served:
            raise UsageError("the server serves %s, not %s" %
                             (served[-1] if served else "?", model))
        settings = dict([("engine version", info.get("version"))]
                        + [(label, dig(info, *path)) for label, path in self.SETTINGS])
        reported = settings["CUDA-graph sizes"]
        # Decode graphs can be off while bs stays filled: --cuda-graph-backend-decode disabled,
        # --disable-decode-cuda-graph and automatic disabling set only the decode backend
        # (python/sglang/srt/arg_groups/cuda_graph_hook.py, 0.5.23 lines 55-67).
        if info.get("disable_cuda_graph") or settings["CUDA-graph decode backend"] == "disabled":
            graph, source = [], "reported"
        elif isinstance(reported, list):
            graph, source = reported, "reported"
        elif info.get("cuda_graph_max_bs_decode",
                      info.get("cuda_graph_max_bs")) == max(self.GRAPH_SIZES):
            graph, source = self.GRAPH_SIZES, "derived"
        else:
            graph, source = self.GRAPH_SIZES, "assumed"
        backend = info.get("attention_backend")
        # With the flag on, SGLang switches these itself: pytorch sampling, and no radix cache
        # with flashinfer.
        flag_sets: Dict[str, Any] = {"sampling backend": "pytorch"}
        if backend == "flashinfer":
            flag_sets["radix cache disabled"] = True
        flag = info.get("enable_deterministic_inference")
        limit, limit_source, context, context_source = self.effective(info, models)
        return ServerFacts(self.name, model or info.get("model_path"), info.get("version"),
                           flag=flag, max_model_len=context, max_model_len_source=context_source,
                           attention_backend=backend, tp=info.get("tp_size"), max_num_seqs=limit,
                           max_num_seqs_source=limit_source,
                           seed_honoured=None if flag is None else bool(flag),
                           seed_note=None if flag else self.SEED_NOTE,
                           load_format=info.get("load_format"), graph_sizes=graph,
                           graph_source=source, default_graph_sizes=self.GRAPH_SIZES,
                           info_source="/server_info", settings=settings, flag_sets=flag_sets,
                           hazards=hazards_in(self.name, info, info.get("version")))

    def body(self, model: str, prompts: List[str], s: Sampling, isolate: bool = False,
             cache_key: Optional[str] = None) -> Dict[str, Any]:
        params: Dict[str, Any] = {"temperature": s.temperature, "top_p": s.top_p,
                                  "top_k": s.top_k, "min_p": s.min_p,
                                  "repetition_penalty": s.repetition_penalty,
                                  "max_new_tokens": s.max_tokens}
        if s.seed is not None:
            params["sampling_seed"] = s.seed
        if s.ignore_eos:
            params["ignore_eos"] = True
        body: Dict[str, Any] = {"text": prompts, "sampling_params": params, "stream": False}
        if isolate:
            # A fresh cache key per prompt (GenerateReqInput.extra_key, one per prompt of a
            # list; the radix cache is namespaced by it: 0.5.17 managers/io_struct.py line 287,
            # mem_cache/radix_cache.py lines 198-207), so that copies in one request do not
            # share a prefix; before_batch also flushes the cache between sizes.
            body["extra_key"] = [fresh_cache_key() for _ in prompts]
        if cache_key:  # one key per prompt, the same in a repeat
            body["extra_key"] = ["%s-%d" % (cache_key, i) for i in range(len(prompts))]
        if s.logprobs is not None:
            body["return_logprob"] = True
            body["top_logprobs_num"] = s.logprobs
        return body

    def completions(self, answer: Any, n: int, with_logprobs: bool) -> List[Completion]:
        if not isinstance(answer, list):
            raise shape_error("expected a list of %d completions" % n)
        if len(answer) != n:
            raise shape_error("%d completions for %d prompts" % (len(answer), n))
        out = []
        for i, item in enumerate(answer):
            if not isinstance(item, dict) or not isinstance(item.get("text"), str):
                raise shape_error("completion %d has no text" % i)
            finish = dig(item, "meta_info", "finish_reason", "type")
            if not with_logprobs:
                out.append(Completion(item["text"], [], [], [], finish))
                continue
            steps = dig(item, "meta_info", "output_token_logprobs")
            top = dig(item, "meta_info", "output_top_logprobs") or []
            if not isinstance(steps, list) or not all(
                    isinstance(s, list) and len(s) >= 2 for s in steps):
                raise shape_error("completion %d has no logprobs" % i)
            ids = item.get("output_ids")
            if isinstance(ids, list) and len(ids) != len(steps):
                raise shape_error("completion %d has %d tokens but %d logprobs" %
                                  (i, len(ids), len(steps)))
            if not all(is_token_id(s[1]) for s in steps):
                raise shape_error("completion %d has a token id that is not a whole number" % i)
            if isinstance(ids, list) and ids != [s[1] for s in steps]:
                raise shape_error(
                    "completion %d: its output_ids are not the tokens its logprobs are of" % i)
            if isinstance(top, list) and any(
                    step and (not all(isinstance(e, list) and len(e) >= 2 and is_token_id(e[1])
                                      for e in step) or len({e[1] for e in step}) != len(step))
                    for step in top):
                raise shape_error("completion %d has top logprobs whose token ids are not whole "
                                  "numbers, each once a step" % i)
            try:  # entries are [logprob, token id, text or null]
                tokens = ["token_id:%d" % s[1] for s in steps]
                tops = [{} for _ in steps]
                if isinstance(top, list) and top:
                    tops = [{"token_id:%d" % e[1]: e[0] for e in (step or [])} for step in top]
            except (TypeError, IndexError, KeyError, ValueError, OverflowError):
                raise shape_error("completion %d has malformed logprob entries" % i) from None
            values = [s[0] for s in steps]
            out.append(checked_completion(i, item["text"], tokens, values, tops, finish,
                                          (out or [None])[-1]))
        return out

    def before_batch(self, client: HttpClient, isolate: bool) -> None:
        """Empty the radix cache, which is on by default: otherwise every size after batch 1
        would be served the prompt's cached prefill."""
        if not isolate:
            return
        text = client.request("/flush_cache", {}, as_text=True)
        if not text.startswith("Cache flushed"):
            raise ServerError("/flush_cache did not flush the radix cache: %s"
                              % text.strip()[:120])

    def output_tokens(self, answer: Any) -> int:
        counts = (dig(item, "meta_info", "completion_tokens") for item in answer or [])
        return sum(server_count(count, "completion_tokens", 0) for count in counts)

    def stream_body(self, model: str, prompt: str, sampling: Sampling) -> Dict[str, Any]:
        # One prompt as a string: each event is one object, its meta_info counting the
        # completion tokens so far (entrypoints/http_server.py, 0.5.23 lines 950-975).
        return dict(self.body(model, [prompt], sampling), text=prompt, stream=True)

    def streamed_tokens(self, event: Any) -> Optional[int]:
        return server_count(dig(event, "meta_info", "completion_tokens"), "completion_tokens")

    def input_logprobs(self, client: HttpClient, prompt: Dict[str, Any], start: int) -> List[Any]:
        """meta_info.input_token_logprobs of one prompt read from start: entries [logprob, id,
        text] for positions start.., the first logprob None (managers/scheduler_components/
        logprob_result_processor.py, 0.5.23 lines 26-50; logprob_start_len and input_ids:
        managers/io_struct.py lines 188 and 233)."""
        body = dict(prompt, sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                    return_logprob=True, logprob_start_len=start, stream=False)
        entries = dig(client.request(self.generate_path, body), "meta_info",
                      "input_token_logprobs")
        if not isinstance(entries, list) or not all(
                isinstance(e, list) and len(e) >= 2 for e in entries):
            raise shape_error("no input_token_logprobs (the prefill check needs them)")
        return entries

    def prompt_token_ids(self, client: HttpClient, model: str, prompt: str) -> List[int]:
        return token_ids([e[1] for e in self.input_logprobs(client, {"text": prompt}, 0)],
                         "input token ids")

    def prefill_only_body(self, model: str, ids: List[int]) -> Dict[str, Any]:
        # input_ids in place of text (managers/io_struct.py, 0.5.23 line 233), one new token
        return {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "extra_key": fresh_cache_key(), "stream": False}

    def prefill_logprobs(self, client: HttpClient, model: str, ids: List[int], start: int,
                         isolate: bool) -> List[float]:
        # entry 0 is position start-1's, its logprob None
        entries = self.input_logprobs(client, {"input_ids": ids}, start - 1)
        return prefill_values([e[0] for e in entries[1:]], len(ids) - start,
                              "input_token_logprobs")

    def cached_tokens(self, answer: Any) -> Optional[int]:
        counts = [dig(item, "meta_info", "cached_tokens") for item in answer or []
                  if isinstance(item, dict)]
        counts = [server_count(c, "cached_tokens") for c in counts if c is not None]
        return sum(counts) if counts else None

    def cached_per_prompt(self, answer: Any, prompts: List[str]) -> List[Optional[int]]:
        # SGLang counts per item, in the order of the prompts
        items = [item for item in answer or [] if isinstance(item, dict)]
        if len(items) != len(prompts):
            return [None] * len(prompts)
        return [server_count(dig(item, "meta_info", "cached_tokens"), "cached_tokens")
                for item in items]

    def prompt_tokens(self, answer: Any) -> Optional[int]:
        counts = [server_count(dig(item, "meta_info", "prompt_tokens"), "prompt_tokens")
                  for item in answer or [] if isinstance(item, dict)]
        return None if not counts or None in counts else sum(counts)

    # With --enable-metrics, the scheduler's own count of prefill tokens by where they came
    # from (python/sglang/srt/observability/metrics_collector.py, 0.5.23 lines 1040-1046 and
    # 1580-1596; counted in managers/scheduler_components/metrics_reporter.py lines 826-847).
    # sglang:cached_tokens_total is only the answers' own cached_tokens summed, and
    # sglang:cache_hit_rate the latest prefill's rate: neither is a second source.
    COUNTER_PREFILL = "sglang:prefill_effective_tokens_total"
    HIT_MODES = ("device_hit", "host_hit", "storage_hit")

    def prefix_cache_off(self, settings: Dict[str, Any]) -> bool:
        return settings.get("radix cache disabled") is True

    def prefix_cache_counters(self, client: HttpClient) -> Optional[CacheCounters]:
        text = metrics_text(client)
        served = metric_sums(text, self.COUNTER_PREFILL, {"mode": self.HIT_MODES})
        computed = metric_sums(text, self.COUNTER_PREFILL, {"mode": ("input",)})
        if served is None or computed is None:
            return None
        return CacheCounters(int(served + computed), int(served), self.COUNTER_PREFILL)


@dataclass(frozen=True)
class Hazard:
    """A server setting reported upstream to break or weaken batch invariance, with the
    evidence read for it. fires(value) is given the setting as /server_info holds it."""

    engine: str = field(metadata=NOT_SAVED)
    setting: str  # what to look at, in the engine's /server_info
    path: Tuple[str, ...] = field(metadata=NOT_SAVED)  # where it sits there
    fires: Callable[[Any], bool] = field(metadata=NOT_SAVED)
    versions: str  # where it was seen, and whether a fix had landed when read
    why: str  # in the lab's words
    refs: str  # the upstream reports, repository and number
    checked: str = field(metadata=NOT_SAVED)  # what was read to keep this row
    # the first release with the fix (read in its source): not raised against it or later
    fixed_in: Optional[str] = field(default=None, metadata=NOT_SAVED)
    # does the row concern this server at all, given its whole /server_info and its release
    # (which model runner it runs, say)? An unknown release is not ruled out.
    applies: Callable[[Any, Any], bool] = field(default=lambda info, version: True,
                                                metadata=NOT_SAVED)


# Release identifiers as Python's packaging orders them (PEP 440), enough for engines' versions
RELEASE_PATTERN = re.compile(
    r"v?(?P<release>[0-9]+(?:\.[0-9]+)*)"
    r"(?:[-_.]?(?P<pre>a|alpha|b|beta|c|rc|pre|preview)[-_.]?(?P<pre_n>[0-9]*))?"
    r"(?:[-_.]?(?P<post>post|rev|r)[-_.]?(?P<post_n>[0-9]*))?"
    r"(?:[-_.]?(?P<dev>dev)[-_.]?(?P<dev_n>[0-9]*))?"
    r"(?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?", re.IGNORECASE)
PRE_RELEASE_RANK = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2, "pre": 2, "preview": 2}
MAX_RELEASE_DIGITS = 30  # a release part longer than this is no engine's


def release(version: Any) -> Optional[Tuple[Any, ...]]:
    """A release as Python's packaging orders it (PEP 440): "0.33" equals "0.33.0"; a
    pre-release (0.33.0rc1, 0.33.0a1, 0.33.0-rc1) and a dev build (0.33.0.dev12) come before
    their release, a post-release after it; a local label (0.5.23+cu129, a build of the
    release) does not move it. None where the server says nothing the lab can read."""
    if not isinstance(version, str):
        return None
    found = RELEASE_PATTERN.fullmatch(version.strip())
    if found is None or any(len(p) > MAX_RELEASE_DIGITS for p in found["release"].split(".")):
        return None
    parts = [int(p) for p in found["release"].split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()  # 0.33 is 0.33.0
    infinity = (math.inf,)
    if found["pre"]:
        pre = (PRE_RELEASE_RANK[found["pre"].lower()], int(found["pre_n"] or 0))
    elif found["dev"] and not found["post"]:
        pre = (-math.inf,)  # 0.33.0.dev1 comes before 0.33.0a1
    else:
        pre = infinity
    post = (int(found["post_n"] or 0),) if found["post"] else (-math.inf,)
    dev = (int(found["dev_n"] or 0),) if found["dev"] else infinity
    return (tuple(parts), pre, post, dev)


def has_release(version: Any, first: str) -> bool:
    """Is the server's release known to be first or later? Unknown is not later."""
    running = release(version)
    return running is not None and running >= release(first)


def _is_fp8(value: Any) -> bool:
    return isinstance(value, str) and value.lower().startswith("fp8")


V2_RUNNER_DEFAULT_FROM = "0.33.0"  # vllm/config/vllm.py lines 731-767 of vLLM 0.33.0
V1_RUNNER_REMOVED_IN = "0.34.0"  # vllm/platforms/interface.py lines 1481-1491 of vLLM 0.34.0


def _v2_runner_chosen(info: Any) -> Any:
    """VLLM_USE_V2_MODEL_RUNNER as the server reports it (vllm_env lists only variables set)."""
    return dig(info, "vllm_env", "VLLM_USE_V2_MODEL_RUNNER")


def vllm_v1_runner_may_run(info: Any, version: Any) -> bool:
    """The old (V1) model runner: gone in 0.34.0; in 0.33.0 only when VLLM_USE_V2_MODEL_RUNNER
    is 0 (or the model needs what V2 lacks, which /server_info does not show); before 0.33.0
    and on an unknown release it may run."""
    if has_release(version, V1_RUNNER_REMOVED_IN):
        return False
    if has_release(version, V2_RUNNER_DEFAULT_FROM):
        return _v2_runner_chosen(info) is False
    return True


def vllm_v2_runner_may_run(info: Any, version: Any) -> bool:
    """The V2 model runner: the only one from 0.34.0, the default in 0.33.0; before 0.33.0
    only where the server says VLLM_USE_V2_MODEL_RUNNER is on; an unknown release may run it."""
    if has_release(version, V1_RUNNER_REMOVED_IN) or release(version) is None:
        return True
    if has_release(version, V2_RUNNER_DEFAULT_FROM):
        return _v2_runner_chosen(info) is not False
    return _v2_runner_chosen(info) is True


FLASH_ATTN_NAMES = ("FLASH_ATTN", "FlashAttentionBackend")  # as asked, and as /server_info says


def _flag_on_sliding_window_flash_attn(info: Any) -> bool:
    """A flag-on server whose KV cache is a sliding window (vLLM sets cache_config.sliding_window
    for models whose every layer slides: vllm/engine/arg_utils.py lines 2322-2327 of 0.34.0),
    on FLASH_ATTN or an attention backend left to vLLM."""
    vc = dig(info, "vllm_config")
    window = dig(vc, "cache_config", "sliding_window")
    backend = dig(vc, "attention_config", "backend")
    return (dig(info, "vllm_env", "VLLM_BATCH_INVARIANT") is True and is_count(window)
            and (backend is None or str(backend).rsplit(".", 1)[-1] in FLASH_ATTN_NAMES))


HAZARDS = [
    Hazard(
        "vllm", "sequence parallelism / async TP (pass_config.enable_sp or fuse_gemm_comms)",
        ("vllm_config", "compilation_config", "pass_config"),
        lambda pc: isinstance(pc, dict)
        and (pc.get("enable_sp") is True or pc.get("fuse_gemm_comms") is True),
        "seen on 0.29.0; still no guard in 0.33.0 (its vllm/config/ never checks the flag "
        "beside enable_sp); a fix (PR 56377) open when read",
        "SP's reduce-scatter sums each token in an order set by which rank owns its chunk, so by "
        "the batch: 1522 of 1536 logprobs differed between batch 1 and 64 in the report",
        "vllm-project/vllm#56370, #56377", "the issue's measurement and the PR's description"),
    Hazard(
        "vllm", "speculative decoding (speculative_config)",
        ("vllm_config", "speculative_config"), lambda spec: spec not in (None, {}, ""),
        "reported on 0.20.1 and against main; batch-invariant speculative decoding an open PR "
        "(52522) when read",
        "a verified draft runs the same row as k+1 tokens instead of 1, an axis the "
        "batch-invariant kernels do not cover; greedy output changed with an ngram draft on "
        "0.20.1",
        "vllm-project/vllm#54506, #52522, #41758",
        "the RFC, the PR's config guard, the ngram report"),
    Hazard(
        "vllm", "online FP8 quantization (model_config.quantization fp8), for MoE models",
        ("vllm_config", "model_config", "quantization"), _is_fp8,
        "seen on 0.27.1; fixed in 0.33.0, whose flag quantizes expert inputs per token "
        "(vllm/model_executor/layers/quantization/online/fp8.py lines 603-608)",
        "the fused-MoE experts quantize their inputs with one scale over the whole batch, so a "
        "request's numbers depend on its neighbours (dense layers are not affected)",
        "vllm-project/vllm#57016, #57092",
        "the issue's reproduction and the PR's diagnosis; the fix in 0.33.0's source",
        fixed_in="0.33.0"),
    Hazard(
        "vllm", "FlashInfer sampler in the old (V1) model runner (VLLM_USE_FLASHINFER_SAMPLER "
        "on)",
        ("vllm_env", "VLLM_USE_FLASHINFER_SAMPLER"), lambda on: on is True,
        "the V1 runner chooses the FlashInfer sampler on CUDA without asking the flag "
        "(vllm/v1/sample/ops/topk_topp_sampler.py lines 241-251 of 0.33.0; the XPU branch, "
        "262-270, does ask); 0.33.0 runs it only with VLLM_USE_V2_MODEL_RUNNER=0, 0.34.0 not "
        "at all",
        "its top-k/top-p sampling is not one of the batch-invariant kernels: sampled (not "
        "greedy) completions of concurrent requests need not repeat from run to run with the "
        "flag on; greedy decoding does not sample",
        "vllm-project/vllm#51187", "0.33.0's sampler selection, and the issue's report",
        fixed_in=V1_RUNNER_REMOVED_IN, applies=vllm_v1_runner_may_run),
    Hazard(
        "vllm", "FlashInfer sampler in the V2 model runner, for unseeded sampling with top-p or "
        "top-k (VLLM_USE_FLASHINFER_SAMPLER on)",
        ("vllm_env", "VLLM_USE_FLASHINFER_SAMPLER"), lambda on: on is True,
        "read in 0.33.0 (v1/worker/gpu/sample/sampler.py lines 304-315) and 0.34.0 (lines "
        "301-312): the runner's FlashInfer sampler runs only for a step in which no request is "
        "greedy or explicitly seeded; VLLM_USE_FLASHINFER_SAMPLER defaults to on "
        "(vllm/envs.py lines 937-941 of 0.34.0)",
        "flag on too, an unseeded request at temperature > 0 with top-p < 1 or top-k takes "
        "FlashInfer's sampler or the runner's own depending on whether a neighbour in its step "
        "is greedy or seeded. Greedy and seeded requests (every request the lab sends) never "
        "take it; each unseeded request draws from a seed of its own (sample/states.py lines "
        "54-58 of 0.34.0), not from a generator the batch shares",
        "vllm-project/vllm#51187", "the V2 runner's sampler selection in 0.33.0 and 0.34.0",
        applies=vllm_v2_runner_may_run),
    Hazard(
        "vllm", "sliding-window attention with the flag on FLASH_ATTN "
        "(cache_config.sliding_window)",
        (), _flag_on_sliding_window_flash_attn,
        "reported on Hopper with Gemma-2; fixed in 0.34.0, whose flag fixes FLASH_ATTN's "
        "max_seq_len at max_model_len (vllm/v1/attention/backends/flash_attn.py lines 834-835; "
        "0.33.0 has no such line)",
        "a sliding-window decode moved beside its neighbours' prefill chunks with the flag on: "
        "a neighbour check (--neighbours) of such a model is expected to move before 0.34.0 "
        "and hold from it. Models that mix sliding and global layers (Gemma-2, Gemma-3) leave "
        "cache_config.sliding_window unset, so the lab cannot see them: check your model",
        "vllm-project/vllm#65587",
        "the fix in 0.34.0's source against 0.33.0's, and its regression test "
        "(tests/v1/determinism/test_batch_invariance.py lines 1020-1022 of 0.34.0, Gemma-2)",
        fixed_in="0.34.0"),
    Hazard(
        "sglang", "FP8 KV cache (kv_cache_dtype)",
        ("kv_cache_dtype",), _is_fp8,
        "measured on 0.5.18; only a warning proposed (PR 35938) when read",
        "with --enable-deterministic-inference and an FP8 KV cache, greedy outputs diverged at "
        "the same position (token 97) for every prompt length; the bf16 control was bit-identical",
        "sgl-project/sglang#35938, #25790", "the PR's table and the issue's analysis"),
    Hazard(
        "sglang", "radix cache on (disable_radix_cache false)",
        ("disable_radix_cache",), lambda disabled: disabled is False,
        "open when read; on by default in 0.5.18-0.5.23",
        "a prompt served from the radix cache runs another kernel path than a cold prefill: 18 "
        "of 40 greedy outputs flipped on a cache hit in the report (--prefix-cache bypass "
        "flushes the cache before every size and gives every prompt a cache key of its own, so "
        "no sweep request is served from the cache, as the cached-token counts show; other "
        "clients' requests and --prefix-cache keep still are)",
        "sgl-project/sglang#34683", "the issue's cold/warm reproduction")]


@dataclass(frozen=True)
class ReleaseChange:
    """A change between two releases of an engine that makes one kind of figure measured on
    either side of it not comparable with the other side's."""

    engine: str
    first: str  # the first release with the change
    figures: str  # which figures it concerns, in words
    what: str  # the change, as a user reads it
    read: str  # where it was read (or that it could not be)


RELEASE_CHANGES = [
    ReleaseChange(
        "vllm", "0.34.0", "TP > 1 costs",
        "the flag no longer forces the one-stage custom all-reduce (the two-stage kernel sums "
        "ranks in a fixed order)",
        "0.33.0's flag sets VLLM_CUSTOM_ALLREDUCE_ALGO=1stage (vllm/model_executor/"
        "determinism/batch_invariant.py lines 1391-1394 of 0.33.0); 0.34.0's does not, and its "
        "two-stage kernel reads the ranks in absolute order (csrc/custom_all_reduce.cuh lines "
        "44-50 of the 0.34.0 source release)")]


def tp_cost_release_notes(engine: Any, cells: Sequence[Tuple[Any, Any]]) -> List[str]:
    """A line for each release change that TP > 1 cost cells of one engine straddle: cells is
    (release, TP degree) of each cell shown together (a cell's releases as its arms reported
    them). Cells of an unknown release or degree straddle nothing."""
    lines = []
    for change in RELEASE_CHANGES:
        if change.engine != engine or "TP" not in change.figures:
            continue
        sides = {has_release(version, change.first) for version, tp in cells
                 if is_count(tp) and tp > 1 and release(version) is not None}
        if sides == {True, False}:
            lines.append("Note: %s %s measured before %s and from it are not comparable: from %s "
                         "%s." % (engine, change.figures, change.first, change.first,
                                  change.what))
    return lines


# What reading a server's answer can raise when the answer is not what the engine sends.
SHAPE_FAULTS = (TypeError, ValueError, KeyError, AttributeError, IndexError, RecursionError,
                OverflowError)


def hazards_in(engine: str, info: Any, version: Any) -> List[Dict[str, Any]]:
    """The known hazards an engine's /server_info answer meets, at the release the server
    reports (a hazard fixed in an earlier release is not raised; one whose fix the server's
    unknown release may or may not have, is)."""
    found = []
    for h in HAZARDS:
        fixed = h.fixed_in is not None and has_release(version, h.fixed_in)
        if h.engine == engine and not fixed and h.applies(info, version):
            try:
                if h.fires(dig(info, *h.path)):
                    found.append(as_record(h))
            except SHAPE_FAULTS:
                pass  # a value of no known kind meets no known hazard
    return found


ADAPTERS: Dict[str, EngineAdapter] = {a.name: a for a in (VllmAdapter(), SglangAdapter())}


def parsed(what: str, parse: Callable[..., Any], *args: Any) -> Any:
    """parse(*args), with any fault an unexpected answer causes turned into a wrong-shape
    error: every value a server sends is untrusted, and none may crash the lab."""
    try:
        return parse(*args)
    except SHAPE_FAULTS as err:
        raise shape_error("%s could not be read (%s)" % (what, type(err).__name__)) from None


def answers_like(adapter: EngineAdapter, client: HttpClient) -> bool:
    try:
        return bool(parsed("the answer", adapter.answers_like, client))
    except ServerError as err:
        if err.kind == ServerError.NETWORK:
            raise  # the server cannot be reached: say that, not that it is no engine
        return False


def detect_engine(client: HttpClient) -> EngineAdapter:
    """The adapter whose engine answers at client, asked through each adapter's own endpoint."""
    found = [a for a in ADAPTERS.values() if answers_like(a, client)]
    if not found:
        raise ServerError(
            "cannot tell which engine answers at %s: it answers neither %s; name it with --engine"
            % (client.base_url, " nor ".join("like %s" % a.label for a in ADAPTERS.values())))
    if len(found) > 1:
        raise UsageError(
            "%s answers like %s at once (a gateway in front of both?): name the engine with "
            "--engine" % (client.base_url, " and like ".join(a.label for a in found)))
    return found[0]


# ----------------------------------------------------------------------------
# Shared by the modes: output, saving, stopping cleanly, server facts


def fmt_duration(seconds: float) -> str:
    """A duration as people read it: 42s, 3m 05s, 1h 00m 12s."""
    whole = int(round(seconds))
    if whole < 60:
        return "%ds" % whole
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return "%dm %02ds" % (minutes, secs)
    return "%dh %02dm %02ds" % (minutes // 60, minutes % 60, secs)


class OutputFailed(Exception):
    """stdout or stderr could not be written: closed, or its disk full. The run ends (what was
    measured is saved) with EXIT_BROKEN_PIPE for a closed pipe, EXIT_OUTPUT otherwise."""

    def __init__(self, stream: str, err: BaseException):
        reason = os.strerror(err.errno) if isinstance(err, OSError) and err.errno else str(err)
        super().__init__("cannot write to %s (%s)" % (stream, reason))
        self.stream = stream
        self.code = EXIT_BROKEN_PIPE if isinstance(err, BrokenPipeError) else EXIT_OUTPUT


class ClosedStream:
    """What a standard stream closed before the start (`run.py ... >&-`) is written through:
    every write fails as on a closed file descriptor."""

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        raise ValueError("closed before the start")


class Bold(str):
    """A line that states a verdict: Out.bold prints it where a report has several lines."""


class Out:
    """Plain text to stdout; colour on a terminal unless NO_COLOR is set (non-empty) or --color
    says otherwise; a live progress line on a stderr terminal. A terminal that says it is dumb
    (TERM=dumb: Emacs' shell, some CI logs) gets no escape code of either kind unless --color
    always asks: its progress is plain lines, as in a log. A stream that cannot be written raises
    OutputFailed once; after that nothing more is written to it. No line is rewritten: the
    key never enters the lab's own text (Secrets)."""

    def __init__(self, stdout=None, stderr=None):
        # A stream closed before the lab started is None in sys: writing to it fails as a
        # closed file does
        self.stdout = stdout or sys.stdout or ClosedStream()
        self.stderr = stderr or sys.stderr or ClosedStream()
        smart = os.environ.get("TERM") != "dumb"  # one that moves its cursor on escape codes
        self.colour = self.stdout.isatty() and smart and not os.environ.get("NO_COLOR")
        self.progress_on = self.stderr.isatty() and smart
        self.failure: Optional[OutputFailed] = None

    def use_colour(self, choice: str) -> None:
        """--color: auto keeps what __init__ found; always and never decide it."""
        if choice != "auto":
            self.colour = choice == "always"

    def _write(self, which: str, text: str, raising: bool = True) -> None:
        """Write to "stdout" or "stderr", flushed at once."""
        if self.failure is not None and self.failure.stream == which:
            return
        stream = self.stdout if which == "stdout" else self.stderr
        try:
            stream.write(text)
            stream.flush()
        except (OSError, ValueError) as err:  # ValueError: the stream was closed
            self.failure = OutputFailed(which, err)
            if raising:
                raise self.failure from None

    def line(self, text: str = "") -> None:
        """A line of results, out at once (a table is printed as it is measured)."""
        if self.progress_on:
            self._write("stderr", "\r\033[K")  # the progress line returns with its next update
        self._write("stdout", text + "\n")

    def note(self, text: str = "") -> None:
        """A plain line on stderr: the results' commentary when stdout carries JSON."""
        self._write("stderr", text + "\n")

    def say(self, text: str, raising: bool = True) -> None:
        """A line about the run, on stderr ("run.py: ..."); raising False for the last words."""
        self._write("stderr", "run.py: %s\n" % text, raising)

    def style(self, text: str, code: str) -> str:
        return "\033[%sm%s\033[0m" % (code, text) if self.colour else text

    def bold(self, text: str) -> None:
        """A summary line: a line of results, bold where colour is on."""
        self.line(self.style(text, "1"))

    def warn(self, text: str) -> None:
        self.say("warning: " + text)

    def progress(self, text: str) -> None:
        if self.progress_on:
            self._write("stderr", "\r\033[K" + text)

    def progress_done(self) -> None:
        if self.progress_on:
            self._write("stderr", "\r\033[K", raising=False)


PROGRESS_MIN_ITEMS = 3  # no time-left estimate before this many steps are done ...
PROGRESS_MIN_SHARE = 0.1  # ... and this share of the work: the first steps carry the start-up


class Progress:
    """Where a long run stands, on stderr. On a terminal: one live line, rewritten before every
    step. Elsewhere (a log file, `| tee`): a plain line for the first finished step, then at most
    one every PROGRESS_INTERVAL_S, and one for the last. Nothing with --quiet.

    The time left is estimated from the steps after the first (which carries connections,
    warm caches and compiled kernels a later step does not pay for), once PROGRESS_MIN_ITEMS
    steps and PROGRESS_MIN_SHARE of the work are done. work, when given, is the whole run's
    work in completions, and each step's completions its share of it: a sweep's batch of 32
    weighs 32 of batch 1. Without it every step weighs the same."""

    def __init__(self, out: Out, total: int, unit: str, quiet: bool = False,
                 work: Optional[int] = None, clock: Callable[[], float] = time.monotonic):
        self.out, self.total, self.unit = out, total, unit
        self.live = out.progress_on and not quiet
        self.plain = not out.progress_on and not quiet
        self.done = self.completions = 0
        self.work = work if work is not None and work > 0 else None
        self.clock = clock
        self.start = clock()
        self.first: Optional[Tuple[float, int]] = None  # (when, work done) at the first step's end
        self.last_line: Optional[float] = None

    def work_done(self) -> int:
        return self.completions if self.work else self.done

    def left_s(self, now: float) -> Optional[float]:
        """Seconds left at the pace of the steps since the first, or None while too little of
        the run is done to say."""
        total = self.work or self.total
        done = self.work_done()
        if self.first is None or not 0 < self.done < self.total:
            return None
        if self.done < PROGRESS_MIN_ITEMS or done < PROGRESS_MIN_SHARE * total:
            return None
        since, before = self.first
        if done <= before or now <= since:
            return None
        return (now - since) / (done - before) * max(total - done, 0)

    def status(self) -> str:
        now = self.clock()
        left_s = self.left_s(now)
        left = "" if left_s is None else " ~%s left" % fmt_duration(left_s)
        return "%d/%d %s, %d completions, %s elapsed%s" % (
            self.done, self.total, self.unit, self.completions, fmt_duration(now - self.start),
            left)

    def running(self, what: str) -> None:
        if self.live:
            self.out.progress("%s | %s" % (what, self.status()))

    def finished(self, what: str, completions: int) -> None:
        self.done += 1
        self.completions += completions
        now = self.clock()
        if self.first is None:
            self.first = (now, self.work_done())
        due = (self.last_line is None or now - self.last_line >= PROGRESS_INTERVAL_S
               or self.done == self.total)
        if self.plain and due:
            self.out.say("progress: %s done | %s" % (what, self.status()))
            self.last_line = now


class SaveError(Exception):
    """--save could not be written after measuring began: the run fails (exit 3), but the
    results are still printed and the file keeps its last good contents."""


def file_identity(path: str) -> Optional[Tuple[int, int, int, int]]:
    """What tells one version of a file from another: (device, inode, size, modified ns) of
    the file a path leads to; None where there is none."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


class ThrottledSave:
    """Rewrites --save during a run at most once every SAVE_INTERVAL_S, and less often when the
    file is large enough that writing it would take more than SAVE_SHARE of the run: a run's
    saves cost time in proportion to the run, not to the square of what it measured. The
    caller writes once more at the end and at every stop. A write that fails is remembered
    (failure), not raised: measuring goes on, and the caller reports it at the end.

    exclusive (a sweep's file, which holds one run): before each write the file must still be
    what this run last wrote (or what was there when it began). Another run that wrote it
    meanwhile is not overwritten: this run's results go to a file beside it (moved_to), so
    neither run loses what it measured."""

    def __init__(self, path: Optional[str], exclusive: bool = False):
        self.path, self.exclusive = path, exclusive
        self.next_due = 0.0
        self.failure: Optional[SaveError] = None
        self.moved_to: Optional[str] = None  # where the results went, when another run wrote
        self.identity = file_identity(path) if path else None

    def offer(self, save: Callable[[str], Any]) -> None:
        """Call save(path) if a write is due; what it saves is built only then."""
        if self.path and time.monotonic() >= self.next_due:
            self.write(save)

    def write(self, save: Callable[[str], Any]) -> Any:
        """Call save(path) now; the time it took, building included, sets when the next is due."""
        if not self.path:
            return None
        start = time.monotonic()
        if self.exclusive and self.moved_to is None and file_identity(self.path) != self.identity:
            root, ext = os.path.splitext(self.path)
            self.moved_to = "%s.%d%s" % (root, os.getpid(), ext or ".json")
        try:
            result = save(self.moved_to or self.path)
            self.identity = file_identity(self.moved_to or self.path)
            self.failure = None  # the file is whole and current again
        except SaveError as err:
            self.failure, result = err, None
        end = time.monotonic()
        self.next_due = end + max(SAVE_INTERVAL_S, (end - start) * (1 - SAVE_SHARE) / SAVE_SHARE)
        return result


def read_only(path: str) -> bool:
    """A file nobody may write (its mode), or this user may not: what --save never replaces
    (root may write anything, yet a file made read-only says keep me)."""
    return not (os.stat(path).st_mode & 0o222) or not os.access(path, os.W_OK)


def now_stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def json_text(doc: Dict[str, Any], indent: Optional[int] = None) -> str:
    """Standard JSON (no NaN or Infinity, which a server may have sent): such values are
    written as the strings "NaN", "Infinity" and "-Infinity". Compact unless indented."""
    separators = (",", ":") if indent is None else (",", ": ")
    try:
        return json.dumps(doc, indent=indent, separators=separators, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(doc), indent=indent, separators=separators, allow_nan=False)


_LIST_MARK = "\0lab-%s\0" % os.urandom(8).hex()  # in no text a server sends


def report_save(cfg: Config, saves: ThrottledSave, code: int, out: Out) -> int:
    """The last line of a run: where it was saved, or why it was not (a run whose results
    could not be saved has failed: exit 3, unless it had already failed otherwise)."""
    if saves.failure is not None:
        out.say("%s; the results above are not in it" % saves.failure, raising=False)
        return code or EXIT_SERVER
    if saves.moved_to is not None:
        out.say("--save: %s was written by another run while this one measured; not overwritten: "
                "saved %s instead" % (cfg.save, saves.moved_to), raising=False)
        return code or EXIT_SERVER
    if cfg.save:
        out.say("saved %s" % cfg.save, raising=False)
    return code


def json_chunks(doc: Dict[str, Any], listed: str,
                texts: Optional[Sequence[str]] = None) -> Iterator[str]:
    """json_text(doc) in pieces, the list doc[listed] one item at a time (or, given, each
    item's json_text already made), so that writing a large document never holds all of its
    text at once (a sweep of 1000 prompts is 30 MB)."""
    marker = _LIST_MARK + listed  # where the list's items go
    head, tail = json_text(dict(doc, **{listed: marker})).split(json.dumps(marker))
    yield head + "["
    for i, text in enumerate(texts if texts is not None else map(json_text, doc[listed])):
        yield ("," if i else "") + text
    yield "]" + tail


def _file_mode(path: str) -> int:
    """The mode the file would have had if written in place: its own, or 0666 less the umask."""
    try:
        return os.stat(path).st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def write_json_atomic(path: str, doc: Dict[str, Any], listed: Optional[str] = None,
                      texts: Optional[Sequence[str]] = None) -> None:
    """Write through a temporary file and a rename: a crash never leaves half a file, and a
    failed write leaves the old file as it was. Compact JSON, one line: only json.dumps without
    indent runs in C, ten times faster on a large sweep (`python3 -m json.tool FILE` indents it);
    with listed, written a piece at a time (json_chunks). A symbolic link stays: the file it
    points to is the one written.
    """
    path = os.path.realpath(path)
    folder = os.path.dirname(path)
    if os.path.exists(path) and read_only(path):
        raise SaveError("--save: %s is read-only now; not replaced" % path)
    chunks = json_chunks(doc, listed, texts) if listed else [json_text(doc)]
    try:
        fd, tmp = tempfile.mkstemp(prefix=".run-", suffix=".json", dir=folder)
    except OSError as err:
        raise SaveError("--save: cannot write in %s (%s)" % (folder, err.strerror)) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for chunk in chunks:
                f.write(chunk)
            f.write("\n")
        os.chmod(tmp, _file_mode(path))
        os.replace(tmp, path)
    except OSError as err:
        raise SaveError("--save: cannot write %s (%s)" % (path, err.strerror)) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class FolderLock:
    """An exclusive lock on the folder of a file, so that two runs adding to one file take
    turns (where the platform has flock; elsewhere nothing is locked)."""

    def __init__(self, path: str):
        self.folder = os.path.dirname(os.path.realpath(path))  # a link's target's folder
        self.fd: Optional[int] = None

    def __enter__(self) -> "FolderLock":
        try:
            import fcntl

            self.fd = os.open(self.folder, os.O_RDONLY)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except (ImportError, OSError):
            self.fd = None
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock


class DeferredInterrupt:
    """The first Ctrl-C, SIGTERM or SIGHUP asks to stop after the current request; a second
    one stops at once. Either way what was measured is saved and summarised."""

    def __init__(self, out: Out):
        self.out = out
        self.signum: Optional[int] = None
        self._previous: Dict[int, Any] = {}

    def _handler(self, signum, frame):
        if self.signum is not None:  # the second: stop at once
            raise Stopped(signum)
        self.signum = signum
        STOP.ask(signum)
        self.out.say(  # in a signal handler: a failed write must not raise here
            "%s: stopping after the current request (at most %gs more; again to abort it)" %
            (signal.Signals(signum).name, STOP_GRACE_S), raising=False)

    def __enter__(self) -> "DeferredInterrupt":
        STOP.event.clear()
        for name in STOP_SIGNALS:
            signum = getattr(signal, name, None)
            if signum is None:
                continue
            try:
                self._previous[signum] = signal.signal(signum, self._handler)
            except ValueError:  # not the main thread: signals stay as they were
                pass
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)

    def check(self) -> None:
        """Between requests: stop here if a stop was asked for."""
        if self.signum is not None:
            raise Stopped(self.signum)


class SavesFirst(DeferredInterrupt):
    """Once measuring is over: the first stop signal waits until what was measured is saved
    and shown (the final save is never cut by the signal that asked for it), and the run then
    ends with that signal's code; a second one stops at once."""

    def _handler(self, signum, frame):
        if self.signum is not None:  # the second: stop at once
            raise Stopped(signum)
        self.signum = signum
        self.out.say("%s: saving what was measured first" % signal.Signals(signum).name,
                     raising=False)

    def code(self) -> int:
        """The exit code of the signal that came while saving (0: none came)."""
        return 0 if self.signum is None else STOP_SIGNALS[signal.Signals(self.signum).name][0]


class StopsAtOnce:
    """Before the measuring starts (waiting for servers, reading their facts, building a
    prompt), a stop signal stops the run at once, with its line and its exit code: there is
    nothing measured to save, and SIGTERM or SIGHUP would otherwise kill the process with
    no word. DeferredInterrupt takes over while measuring."""

    def __enter__(self) -> "StopsAtOnce":
        self._previous: Dict[int, Any] = {}
        for name in STOP_SIGNALS:
            signum = getattr(signal, name, None)
            if signum is None:
                continue
            try:
                self._previous[signum] = signal.signal(signum, self._handler)
            except ValueError:  # not the main thread: signals stay as they were
                pass
        return self

    @staticmethod
    def _handler(signum, frame):
        raise Stopped(signum)

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


WAIT_POLL_S = 0.5  # how often --wait-ready asks again


def wait_until_ready(cfg: Config, servers: Sequence[Tuple[str, str]], out: Out) -> None:
    """With --wait-ready, ask every server ((url, what it is) pairs) for its health check until
    it answers, or give up when the time is up."""
    if not cfg.wait_ready:
        return
    adapters = [cfg.adapter] if cfg.engine else list(ADAPTERS.values())
    paths = sorted({a.health_path for a in adapters})
    deadline = time.monotonic() + cfg.wait_ready
    for url, what in servers:
        if not cfg.quiet:
            out.say("progress: waiting up to %s for %s at %s to answer %s" %
                    (fmt_duration(deadline - time.monotonic()), what, url, " or ".join(paths)))
        while True:
            remaining = deadline - time.monotonic()
            client = HttpClient(url, cfg.api_key, max(0.1, min(5.0, remaining)), 1 << 20)
            try:
                for path in paths:
                    client.request(path, as_text=True)
                break
            except ServerError as err:
                if remaining <= WAIT_POLL_S:
                    raise ServerError("%s at %s was not ready within %gs (--wait-ready): %s" %
                                      (what, url, cfg.wait_ready, err)) from None
            time.sleep(WAIT_POLL_S)


def resolve_engine(cfg: Config, servers: Sequence[Tuple[str, str]]) -> Config:
    """The configuration with its engine named: as given, or found by asking every server
    ((url, what it is) pairs), which must all run the same engine."""
    if cfg.engine is not None:
        return cfg
    found = []
    for url, what in servers:
        try:
            found.append(detect_engine(cfg.client(url)))
        except ServerError as err:
            raise ServerError("%s at %s: %s" % (what, url, err)) from None
    if len({a.name for a in found}) > 1:
        answers = ["%s answers like %s" % (what, a.label) for (_, what), a in zip(servers, found)]
        raise UsageError("the servers run different engines: %s" % ", ".join(answers))
    return dataclasses.replace(cfg, engine=found[0].name, engine_detected=True)


def server_facts(cfg: Config, url: str, arm: str = "the server") -> ServerFacts:
    """The server's facts through the configured engine's adapter; when that fails and another
    engine's adapter recognises the server, the error says so."""
    client = cfg.client(url)
    try:
        facts = parsed("the server's facts", cfg.adapter.read_facts, client, cfg.model)
        return facts.checked().without_key()
    except ServerError as err:
        others = [a for a in ADAPTERS.values() if a is not cfg.adapter]
        try:
            other = next((a for a in others if answers_like(a, client)), None)
        except ServerError:
            other = None  # unreachable: the first error says so
        hint = ("; it answers like %s: pass --engine %s, or leave --engine out" %
                (other.label, other.name) if other else "")
        raise ServerError("cannot read the facts of %s at %s: %s%s" %
                          (arm, url, err, hint)) from None


def refuse_what_cannot_fit(facts: ServerFacts, max_tokens: int, prompt_tokens: Optional[int],
                           what: str) -> None:
    """Refuse, before any generation request, a completion the server's maximum model length
    cannot hold: --max-tokens alone, or with a prompt of a known length (prompt_tokens;
    what: where that length comes from). A server that does not say its limit is not
    refused."""
    limit = facts.max_model_len
    if not is_count(limit):
        return
    source = facts.max_model_len_source or "the server"
    if max_tokens >= limit:
        raise UsageError("--max-tokens %d does not fit the server's maximum model length of %d "
                         "tokens (%s), which the prompt shares: give fewer"
                         % (max_tokens, limit, source))
    if prompt_tokens is not None and prompt_tokens + max_tokens > limit:
        raise UsageError("%s of %d tokens and --max-tokens %d do not fit the server's maximum "
                         "model length of %d tokens (%s): give a shorter prompt or fewer tokens"
                         % (what, prompt_tokens, max_tokens, limit, source))


def internal_error(err: BaseException) -> str:
    """One line for a fault of the lab's own, with where it happened, to report."""
    line, tb = None, err.__traceback__
    while tb is not None:  # the innermost frame of this file, not of a library it called
        if tb.tb_frame.f_code.co_filename == __file__:
            line = tb.tb_lineno
        tb = tb.tb_next
    where = " at run.py line %d" % line if line is not None else ""
    return "internal error (%s%s: %s); please report it" % (type(err).__name__, where,
                                                            str(err)[:200])


def ending(err: BaseException) -> Tuple[int, str, str]:
    """What ended a run, as (exit code, the state its saved result records, one line saying
    why): the one place where an exception becomes an exit code."""
    if isinstance(err, UsageError):
        return EXIT_USAGE, "stopped: usage error", str(err)
    if isinstance(err, ServerError):
        return EXIT_SERVER, "stopped: server error", str(err)
    if isinstance(err, KeyboardInterrupt):  # a stop signal (Stopped) or Ctrl-C
        code, state = STOP_SIGNALS[signal.Signals(getattr(err, "signum", signal.SIGINT)).name]
        return code, state, state
    if isinstance(err, OutputFailed):
        return err.code, "stopped: output failed", str(err)
    return EXIT_INTERNAL, "stopped: internal error", internal_error(err)


def measure_until_stopped(out: Out, what: str,
                          loop: Callable[[DeferredInterrupt], None]) -> Tuple[str, int]:
    """Run a measuring loop. A server error, a stop signal, an output that cannot be written
    or a fault of the lab's own ends it early; whichever it was, the caller keeps, reports
    and saves what was measured. Returns (state, exit code)."""
    state, code, message = "complete", EXIT_OK, None
    with DeferredInterrupt(out) as interrupt:
        try:
            loop(interrupt)
        except (Exception, KeyboardInterrupt) as err:  # what was measured still counts
            code, state, why = ending(err)
            if isinstance(err, KeyboardInterrupt):
                message = "%s; showing what was measured" % why
            elif isinstance(err, ServerError):
                message = "%s stopped at %s" % (what, why)
            else:
                message = "%s stopped: %s" % (what, why)
    if code == EXIT_OK and interrupt.signum is not None:
        # the signal came while the last request was in flight and its answer came within
        # the grace: everything was measured (the state stays complete), and the run still
        # ends with the signal's code, as a job scheduler that sent it expects
        code = STOP_SIGNALS[signal.Signals(interrupt.signum).name][0]
        message = "%s: every request answered; ending as the signal asked" % (
            signal.Signals(interrupt.signum).name)
    out.progress_done()
    if message:
        out.say(message, raising=False)
    return state, code


def fmt_opt(value: Any, none: str = "-", form: str = "%s") -> str:
    return none if value is None else form % value


# The facts a table's header shows on its second line, before the graph sizes
SHOWN_FACTS = ("attention_backend", "tp", "max_num_seqs", "max_model_len")


def fmt_graph_sizes(facts: Dict[str, Any]) -> str:
    if facts.get("graph_source") == "assumed" or facts.get("graph_sizes") is None:
        return "unknown"
    if not facts["graph_sizes"]:
        return "none (eager)"
    return ",".join(str(s) for s in facts["graph_sizes"])


def describe_flag(flag: Optional[bool], adapter: EngineAdapter) -> str:
    if flag is None:
        return "flag unknown (the server does not say)"
    return "flag %s (%s=%s)" % ("on" if flag else "off", adapter.flag_name, str(flag).lower())


def hazard_lines(facts: Dict[str, Any], whose: str = "") -> List[str]:
    """The known hazards a server's settings meet (see --mode help for what this can know)."""
    hazards = facts.get("hazards")
    if hazards is None:
        return ["        %sknown hazards: unknown (the server hides its settings)" % whose]
    if not hazards:
        return ["        %sknown hazards: none known" % whose]
    return ["        %sHAZARD: %s: %s (%s; %s)" % (whose, h["setting"], h["why"], h["refs"],
                                                     h["versions"]) for h in hazards]


def server_lines(facts: Dict[str, Any], adapter: EngineAdapter,
                 detected: bool = False) -> List[str]:
    """The header of a table, from a saved facts record."""
    return [
        "server: %s %s%s, model %s, %s"
        % (adapter.label, fmt_opt(facts.get("version"), "?"),
           " (found by asking the server)" if detected else "", facts.get("model"),
           describe_flag(facts.get("flag"), adapter)),
        "        attention %s, TP %s, max-num-seqs %s, max model length %s, graph sizes %s"
        % tuple([fmt_opt(facts.get(key), "?") for key in SHOWN_FACTS] + [fmt_graph_sizes(facts)])
    ] + hazard_lines(facts)


def fmt_setting(value: Any) -> str:
    """A setting as a table or a header line shows it: as JSON writes it (true, not True)."""
    text = json.dumps(value) if isinstance(value, (list, dict, bool)) or value is None \
        else str(value)
    return text if len(text) <= 26 else text[:23] + "..."


@dataclass(frozen=True)
class SettingDifference:
    """A setting two servers report otherwise (ServerFacts.differing): the baseline server
    against the server under test, or the flag-off arm against the flag-on arm. Saved as
    {"setting": ..., then each side under its own name}, the names the file gives them."""

    setting: str
    values: Dict[str, Any] = field(metadata=saved(flat=""))  # side's name -> its value

    @classmethod
    def between(cls, first: ServerFacts, second: ServerFacts, names: Tuple[str, str],
                flag: bool = False, flag_own: bool = False) -> List["SettingDifference"]:
        """Every setting the two report otherwise: the flag among them when asked (only where
        both say it), and with flag_own, leaving out what the second server's flag itself
        sets to what it reports (the arms of a cost run: the flag's own settings)."""
        found = []
        if flag and None not in (first.flag, second.flag) and first.flag != second.flag:
            found.append(cls("flag", dict(zip(names, (first.flag, second.flag)))))
        for label, a, b in first.differing(second):
            if flag_own and label in second.flag_sets and b == second.flag_sets[label]:
                continue
            found.append(cls(label, dict(zip(names, (a, b)))))
        return found

    def side(self, name: str) -> Any:
        return self.values[name]


# ----------------------------------------------------------------------------
# Configuration: argparse turned into plain values before any I/O


@dataclass
class Config:
    """What a run was asked for, checked before any request: what every mode shares (each
    field named as its option's argparse dest), and each mode's own options (sweep, cost)."""

    mode: str
    # harness: the part to print (None: both); sweep, cost: the adapter (None: ask the server)
    engine: Optional[str] = None
    engine_detected: bool = False  # the engine was found by asking the server, not named
    url: Optional[str] = None
    model: Optional[str] = None
    api_key: Optional[str] = field(default=None, repr=False)
    provenance: Json = field(default_factory=dict)  # how the results were made
    timeout: float = DEFAULT_TIMEOUT_S
    max_response_mb: int = DEFAULT_MAX_RESPONSE_MB
    json_out: bool = False
    quiet: bool = False  # no progress lines
    color: str = "auto"  # one of COLOR_CHOICES
    wait_ready: Optional[float] = None  # seconds to wait for the servers' health checks first
    save: Optional[str] = None
    prior_save: Optional[Json] = None  # the document already at --save (cost adds to it)
    sampling: Optional[Sampling] = None  # what every generation request asks for
    sweep: Optional["SweepOptions"] = None  # --mode sweep only
    cost: Optional["CostOptions"] = None  # --mode cost only

    @property
    def adapter(self) -> EngineAdapter:
        return ADAPTERS[self.engine]

    def client(self, url: str) -> HttpClient:
        return HttpClient(url, self.api_key, self.timeout, self.max_response_mb << 20)


OptionsT = TypeVar("OptionsT")
SweepCheckT = TypeVar("SweepCheckT")


def options_from(kind: Type[OptionsT], args: argparse.Namespace, **given: Any) -> OptionsT:
    """A dataclass of options, each field taken from the argparse value of the same name
    unless given (what was worked out from the arguments: checked, parsed, combined)."""
    names = [f.name for f in dataclasses.fields(kind) if f.init]
    values = {name: getattr(args, name) for name in names if hasattr(args, name)}
    values.update(given)
    return kind(**values)


class _Parser(argparse.ArgumentParser):
    argv: List[str] = []  # the words being parsed: where a key stands in them

    def parse_known_args(self, args=None, namespace=None):
        self.argv = [str(a) for a in (sys.argv[1:] if args is None else args)]
        return super().parse_known_args(args, namespace)

    def error(self, message):
        words = message.split(": ", 1)[-1].split() if "unrecognized arguments" in message else []
        if words:
            # more keys after --api-key's one, as an engine's --api-key K1 K2 takes them: the
            # lab takes one, and the words it does not know are keys all the same
            standing = {w for w, shown in zip(self.argv, key_free_command(
                self.argv, list(self._option_string_actions), engine=True))
                        if shown == "[api key]"}
            words = ["[api key]" if w in standing else w for w in words]
            message = "%s: %s" % (message.split(": ", 1)[0], " ".join(words))
        mode = next((word for word in words if word in MODES), None)
        if mode is not None:  # `run.py sweep`: a mode is an option's value here, not a command
            message += " (a mode is chosen with --mode: run.py --mode %s ...)" % mode
        hint = None
        for word in words:
            name = word.split("=")[0]
            # in any spelling bench serve's own parser takes: abbreviated, with "="
            meant = [o for o in BENCH_SERVE_HINTS if len(name) > 2 and o.startswith(name)]
            if name.startswith("--") and len(meant) == 1:
                hint = BENCH_SERVE_HINTS[meant[0]]
                break
        if hint is not None:
            message += " (%s)" % hint
        if message.startswith("argument --request-rate") and is_infinite(message):
            # bench serve's spelling of a burst (serve.py, 0.34.0 line 1748: its default)
            message += " (all requests at once, bench serve's --request-rate inf, is what " \
                       "--concurrency does without --request-rate: leave it out)"
        raise UsageError(key_free_message(message, words))


def is_infinite(message: str) -> bool:
    """Whether the value a parser's complaint quotes ('inf', 'Infinity') is an infinite
    number as float() reads it."""
    quoted = re.search(r"'([^']*)'", message)
    try:
        return quoted is not None and math.isinf(float(quoted.group(1)))
    except ValueError:
        return False


# Words in an option's name that say its value may be a key (--apikey, --token, --api_key)
KEY_LIKE = ("key", "token", "secret", "password")


def key_free_message(message: str, unknown: Sequence[str]) -> str:
    """A parser's complaint as it may be printed: the value of an option the lab does not
    know but whose name says it holds a key (--apikey K, --token=K) hidden where it stands,
    as key_free_command hides --api-key's, and $OPENAI_API_KEY's value wherever it shows."""
    # `--a=K could match --api-key, ...`: argparse quotes the word whole, value and all
    ambiguous = re.match(r"ambiguous option: (\S+?)=\S+ could match (.*)", message)
    if ambiguous and KEY_OPTION in ambiguous.group(2).split(", "):
        message = "ambiguous option: %s=[api key] could match %s" % ambiguous.groups()
    for i, word in enumerate(unknown):
        name = word.split("=", 1)[0]
        if not (name.startswith("-") and any(k in name.lower() for k in KEY_LIKE)):
            continue
        if "=" in word:
            message = message.replace(word, name + "=[api key]")
        elif i + 1 < len(unknown) and not unknown[i + 1].startswith("-"):
            message = message.replace("%s %s" % (word, unknown[i + 1]), word + " [api key]")
    key = os.environ.get("OPENAI_API_KEY") or ""
    # a key too short to tell from text is not searched for (Secrets)
    return message.replace(key, "[api key]") if len(key) >= SHORT_SECRET else message


# `vllm bench serve` options the lab does not take, and what it does instead: its saving
# options, and of its common load options those that are not the lab's own aliases
# (--base-url, --max-concurrency, --num-prompts, --request-rate are): vllm/benchmarks/
# serve.py, 0.34.0 lines 1755 (--burstiness), 1832 (--ignore-eos); datasets/datasets.py,
# lines 1593 (--dataset-name), 1889 (--random-input-len), 1895 (--random-output-len)
BENCH_SERVE_HINTS = {
    "--random-output-len": "--max-tokens N: every completion of a trial runs to it",
    "--ignore-eos": "a cost trial asks every completion for --max-tokens tokens already",
    "--burstiness": "--request-rate R sends Poisson arrivals (bench serve's burstiness 1, "
                    "its default); other arrival shapes are not offered",
    "--dataset-name": "a cost trial's prompts are its workload's: --workload cold or "
                      "shared-prefix",
    "--random-input-len": "a cost trial's prompts are its workload's: --workload "
                          "shared-prefix --prefix-tokens N sets their length",
    "--save-result": "the lab saves with --save FILE, or --result-filename FILE; under load "
                     "each arm's figures are there under bench serve's names too",
    "--result-dir": "give the folder in --save's path",
    "--save-detailed": "a cost file keeps every request's timing already (load.ARM.requests)",
    "--append-result": "--save adds each cost cell to its file already",
    "--metadata": "saved results record the command line, host, Python and code (lab)"}


WHOLE_NUMBER = r"[+-]?[0-9]+"  # ASCII digits only: int() also takes other scripts' digits


def parse_whole(text: str) -> Optional[int]:
    return int(text) if re.fullmatch(WHOLE_NUMBER, text.strip()) else None


def whole_number(low: int, high: Optional[int] = None) -> Callable[[str], int]:
    """An argparse type: a whole number from low (to high); its error is one line."""

    def parse(text: str) -> int:
        value = parse_whole(text)
        if value is None:
            raise argparse.ArgumentTypeError("%r is not a whole number" % text)
        if value < low or (high is not None and value > high):
            wanted = "at least %d" % low if high is None else "%d to %d" % (low, high)
            raise argparse.ArgumentTypeError("give %s (got %d)" % (wanted, value))
        return value

    return parse


def real_number(low: float, above: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number at least low (or above it, with above)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or not text.strip().isascii():
            raise argparse.ArgumentTypeError("%r is not a finite number" % text)
        if value < low or (above and value == low):
            raise argparse.ArgumentTypeError(
                "give %s %g (got %g)" % ("a number above" if above else "at least", low, value))
        return value

    return parse


def exit_codes_text(indent: str = "  ") -> str:
    return "\n".join("%s%-4d %s" % (indent, code, meaning) for code, meaning in EXIT_CODES)


@functools.lru_cache(maxsize=None)
def lab_code() -> str:
    """Which code this is, as --version, every saved result and the experiment's report name
    it: the commit of the git checkout run.py is tracked in (`git describe --always --dirty`:
    "-dirty" where the checkout holds changes, then the first 12 hex digits of the SHA-256 of
    run.py's own bytes, so that two edits of one commit read differently), else the version
    and that hash alone (a copy outside a checkout, or no git to ask)."""
    source = os.path.realpath(__file__)  # through a link, the checkout the file lives in
    git = ["git", "-C", os.path.dirname(source)]
    try:
        tracked = subprocess.run(git + ["ls-files", "--error-unmatch", os.path.basename(source)],
                                 capture_output=True, timeout=GIT_TIMEOUT_S)
        if tracked.returncode == 0:  # run.py is this checkout's own, not a copy dropped in one
            described = subprocess.run(git + ["describe", "--always", "--dirty"],
                                       capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
            name = described.stdout.strip()
            if described.returncode == 0 and name:
                edited = ", run.py sha256 %s" % source_digest(source) if name.endswith(
                    "-dirty") else ""
                return "%s, git %s%s" % (LAB_VERSION, name, edited)
    except (OSError, subprocess.SubprocessError):
        pass
    return "%s, run.py sha256 %s" % (LAB_VERSION, source_digest(source))


def source_digest(path: str) -> str:
    """The first 12 hex digits of the SHA-256 of a file's bytes."""
    with open(path, "rb") as code:
        return hashlib.sha256(code.read()).hexdigest()[:12]


class ShowVersion(argparse.Action):
    """--version: the lab's version and the code's own name (lab_code), asked only when
    --version is given (git runs then, not each time a parser is built)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the lab's version and the commit it runs from, and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        parser._print_message("run.py (batch-invariance lab) %s\n" % lab_code(), sys.stdout)
        parser.exit()


class OneSavePath(argparse.Action):
    """--save, or `vllm bench serve`'s --result-filename for it: one file a run. A second,
    other path is refused, not one of the two dropped without a word (nothing would be where
    the user looks), and so is an empty one (it would save nothing)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if not values.strip():  # `--save "$OUT"` with OUT unset: nothing would be saved
            parser.error("%s: an empty path; give the file to save the result in"
                         % option_string)
        given = getattr(namespace, self.dest, None)  # None, or a mark (given_options)
        if isinstance(given, str) and given != values:
            parser.error("%s: the result is already to be saved in %s; a run saves to one file "
                         "(--save and --result-filename name the same one)"
                         % (option_string, given))
        setattr(namespace, self.dest, values)


def provenance(argv: Sequence[str], options: Sequence[str]) -> Dict[str, Any]:
    """What a saved result records of how it was made: the lab's version and the code's own
    name (lab_code), the command line with any key replaced where it stands (options: every
    option string the parser takes), the client's host and when the run started."""
    return {
        "version": LAB_VERSION,
        "code": lab_code(),
        "command": ["run.py"] + key_free_command(argv, options),
        "host": socket.gethostname(),
        "python": "%d.%d.%d" % sys.version_info[:3],
        "started": now_stamp()}


SHARED_OPTIONS: List[Callable[[argparse._ArgumentGroup], None]] = []  # each slice adds its own
# The option groups of --help, by title, and the modes their options belong to: an option
# given to another mode is refused (refuse_foreign_options), never ignored
MODE_GROUPS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("every mode", MODES),
    ("--mode sweep and --mode cost", ("sweep", "cost")),
    ("--mode sweep", ("sweep",)),
    ("--mode sweep: the checks", ("sweep",)),
    ("--mode cost", ("cost",)))


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="run.py", formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Batch-invariance lab for vLLM and SGLang servers, over plain HTTP.",
                epilog="exit codes:\n" + exit_codes_text() + "\n\nlimits (larger is refused):\n"
                + "\n".join("  %-50s at most %d" % limit for limit in LIMITS))
    p.add_argument("--version", action=ShowVersion)
    p.add_argument(
        "--mode", choices=MODES, default="help",
        help="harness: upstream harnesses and commands (offline); sweep: unique completions "
        "and logprob ULPs across batch sizes; cost: the flag's overhead; help: the guide")
    common = p.add_argument_group(MODE_GROUPS[0][0])
    common.add_argument(
        "--engine", choices=sorted(ADAPTERS) + ["auto"], help="sweep and cost: vllm, sglang "
        "or auto (the default: ask the server which it is); harness: print only this engine's "
        "part")
    sweep_cost = p.add_argument_group(MODE_GROUPS[1][0])
    sweep_cost.add_argument(
        "--url", "--base-url", dest="url",
        help="the server (cost: the flag-off arm), as the engine logs it, as OpenAI clients "
        "take it (a trailing /v1 is understood) or as `vllm bench serve --base-url` does; "
        "default http://localhost:8000, or :30000 with --engine sglang")
    sweep_cost.add_argument(
        "--model", help="served model; default: the first of /v1/models (vllm), "
        "model_path of /server_info (sglang)")
    sweep_cost.add_argument("--api-key",
                            help="bearer token (default: $OPENAI_API_KEY); never printed or saved")
    sweep_cost.add_argument(
        "--max-tokens", type=whole_number(1, MAX_TOKENS), help="tokens per completion (default: "
        "sweep %d, cost %d)" % (DEFAULT_SWEEP_TOKENS, DEFAULT_COST_TOKENS))
    sweep_cost.add_argument(
        "--save", "--result-filename", metavar="PATH", action=OneSavePath,
        help="write the result as JSON (sweep: "
        "rewritten after every batch size; cost: adds its cell to the file)")
    sweep_cost.add_argument("--json", action="store_true", dest="json_out",
                            help="print the result as JSON, not a table")
    sweep_cost.add_argument(
        "--wait-ready", type=real_number(0.0, above=True), metavar="SECONDS",
        help="first wait up to this long for the server(s) to answer their health "
        "check (a server just started takes minutes to load)")
    for add_arguments in SHARED_OPTIONS:  # the options of both modes a slice owns
        add_arguments(sweep_cost)
    sweep_cost.add_argument(
        "--quiet", action="store_true", help="no progress lines on stderr (warnings "
        "and errors still appear)")
    sweep_cost.add_argument(
        "--color", choices=COLOR_CHOICES, default="auto",
        help="bold summary lines: auto (on a terminal, unless NO_COLOR is set to a "
        "non-empty value, as no-color.org asks), always, never (default auto)")
    sweep_cost.add_argument("--timeout", type=real_number(0.0, above=True),
                            default=DEFAULT_TIMEOUT_S,
                            help="seconds to wait for one answer (default %g)" % DEFAULT_TIMEOUT_S)
    sweep_cost.add_argument("--max-response-mb", type=whole_number(1),
                            default=DEFAULT_MAX_RESPONSE_MB,
                            help="refuse a larger answer (default %d)" % DEFAULT_MAX_RESPONSE_MB)
    SweepOptions.add_arguments(p.add_argument_group(MODE_GROUPS[2][0]), p.add_argument_group(
        MODE_GROUPS[3][0], "what a sweep can check beside batch 1 against every other batch"))
    CostOptions.add_arguments(p.add_argument_group(MODE_GROUPS[4][0]))
    return p


def server_address(url: str) -> Tuple[str, str, int, str]:
    """(scheme, host, port, path) with loopback names folded together, to tell two URLs'
    servers apart: two paths behind one gateway are two servers."""
    parts = urllib.parse.urlsplit(url)
    host = (parts.hostname or "").lower()
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, "loopback" if is_loopback(host) else host, port, parts.path.rstrip("/")


# Endpoints a base URL is mistaken for: the adapters add their own paths to the base URL
ENDPOINT_PATHS = sorted({p for a in ADAPTERS.values() for p in (a.generate_path, a.health_path)}
                        | {"/v1/chat/completions", "/v1/models"}, key=len, reverse=True)
# The paths the lab itself asks, as a refused URL's hint names them
ENDPOINTS_USED = ", ".join("%s on %s" % (a.generate_path, a.label) for a in ADAPTERS.values())


MAX_PORT = 65535  # TCP's ports are 1 to 65535 (0 asks the system for any free one)


def check_port(netloc: str, url: str, option: str) -> None:
    """Refuse a port that is no TCP port: not a number (digits only), or out of range (0, a
    negative, above MAX_PORT). A colon with no port after it is the scheme's default port,
    as urllib takes it."""
    host_end = netloc.rfind("]")  # an IPv6 address holds colons of its own
    _, colon, port = netloc[host_end + 1:].rpartition(":")
    if not colon or not port:
        return
    if re.fullmatch(r"-?[0-9]+", port) and not 1 <= int(port) <= MAX_PORT:
        raise UsageError("%s: %r has port %s, out of range: a port is from 1 to %d"
                         % (option, url, port, MAX_PORT))
    if not re.fullmatch(r"[0-9]+", port):
        raise UsageError("%s: %r has a port that is not a number" % (option, url))


def check_url(url: str, option: str) -> str:
    """The server's base URL: as an engine logs it (http://0.0.0.0:8000, which is this machine)
    or as OpenAI clients take it (ending in /v1, which the lab adds itself)."""
    if any(c.isspace() for c in url):
        raise UsageError("%s: the URL has a space in it (quote it whole, or remove it)" % option)
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as err:  # a malformed IPv6 address
        raise UsageError("%s: not a URL the lab can use (%s)" % (option, err)) from None
    if parts.username is not None or parts.password is not None:
        # Never echo the URL: it holds a secret. Credentials go in a header, never a URL.
        raise UsageError(
            "%s: a user name or password in the URL is not accepted (it would be printed "
            "and saved); give the key with --api-key or $OPENAI_API_KEY" % option)
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        # Never echo it: a query string is where a key is often put.
        raise UsageError(
            "%s: give the server's base URL without a query string or fragment (a key goes "
            "in --api-key or $OPENAI_API_KEY)" % option)
    if "://" not in url and not url.startswith("/"):  # localhost:8000: its port, as given
        check_port(urllib.parse.urlsplit("http://" + url).netloc, url, option)
    check_port(parts.netloc, url, option)
    if "://" not in url and not url.startswith("/"):  # localhost:8000, or a bare host
        raise UsageError("%s: %r has no scheme: the lab speaks plain HTTP to engines, so give "
                         "http://%s" % (option, url, url))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError("%s: %r is not an http:// or https:// URL" % (option, url))
    path = parts.path.rstrip("/")
    endpoint = next((e for e in ENDPOINT_PATHS if path.endswith(e)), None)
    if endpoint:
        base = parts._replace(path=path[:-len(endpoint)]).geturl()  # no query: refused above
        raise UsageError("%s: give the server's base URL, not an endpoint: %s (the lab sends "
                         "to its own paths under it: %s)" % (option, base, ENDPOINTS_USED))
    if path.endswith("/v1"):
        path = path[:-3]
    netloc = parts.netloc
    for any_address, local in (("0.0.0.0", "127.0.0.1"), ("[::]", "[::1]")):
        if parts.hostname == any_address.strip("[]"):
            netloc = netloc.replace(any_address, local)
    return urllib.parse.urlunsplit((parts.scheme, netloc, path, "", ""))


MAX_INPUT_FILE_MB = 1024  # a prompt file or lab result larger than this is refused, not read
MAX_KEPT_SWEEPS = 999  # finished sweeps kept beside one --save name (PATH.1.json and on)


def read_input_file(path: str, option: str) -> str:
    """A regular file's text, read only if it is one (a device, FIFO or folder is refused before
    anything is read from it) and no larger than MAX_INPUT_FILE_MB."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise UsageError("%s: %s is not a regular file" % (option, path))
        if info.st_size > MAX_INPUT_FILE_MB << 20:
            raise UsageError("%s: %s is larger than %d MB" % (option, path, MAX_INPUT_FILE_MB))
        with open(path, "rb") as f:
            raw = f.read((MAX_INPUT_FILE_MB << 20) + 1)
    except OSError as err:
        raise UsageError("%s: cannot read %s (%s)" % (option, path, err.strerror)) from None
    if len(raw) > MAX_INPUT_FILE_MB << 20:
        raise UsageError("%s: %s is larger than %d MB" % (option, path, MAX_INPUT_FILE_MB))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError("%s: %s is not UTF-8 text" % (option, path)) from None


def read_json_file(path: str, option: str) -> Dict[str, Any]:
    text = read_input_file(path, option)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise UsageError("%s: %s is not valid JSON (%s)" % (option, path, str(err)[:80])) from None
    if not isinstance(data, dict):
        raise UsageError("%s: %s is not a lab result" % (option, path))
    return data


def check_save_target(path: str, schemas: Sequence[str]) -> Optional[Dict[str, Any]]:
    """The document already at --save (None if there is none), checked before any request:
    the folder must exist and take a new file, and a file already there must hold this mode's
    results. A finished sweep is never replaced: a sweep file holds one sweep, so the sweep
    keeps it beside the new one before its first write (keep_finished_sweep); cost files
    gather cells, so they are added to."""
    if os.path.islink(path) and not os.path.isdir(os.path.dirname(os.path.realpath(path))):
        raise UsageError("--save: %s is a link to %s, in a folder that does not exist" %
                         (path, os.path.realpath(path)))
    folder = os.path.dirname(os.path.realpath(path))  # a link's target's, where it is written
    if not os.path.isdir(folder):
        raise UsageError("--save: folder %s does not exist" % folder)
    try:
        fd, probe = tempfile.mkstemp(prefix=".run-", suffix=".json", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise UsageError("--save: cannot write in %s (%s)" % (folder, err.strerror)) from None
    if not os.path.exists(path):  # nothing there yet (a link to a file still to be made)
        return None
    if read_only(path):
        raise UsageError("--save: %s is read-only; refusing to replace it" % path)
    data = read_json_file(path, "--save")
    if data.get("schema") not in schemas:
        raise UsageError("--save: %s holds %s, not %s results; refusing to overwrite it" %
                         (path, data.get("schema") or "something else", schemas[0].split("/")[1]))
    return data


def finished_sweep(doc: Optional[Json]) -> bool:
    return bool(doc) and doc.get("prompts") is not None and dig(
        doc, "summary", "state") == "complete"


def keep_finished_sweep(path: str, out: "Out") -> None:
    """The finished sweep at --save moved to the first free PATH.N.json beside it, and said,
    so that the same command run twice keeps both sweeps (the newer under the name asked
    for). A hard link, then the old name removed: an existing file is never overwritten."""
    root, ext = os.path.splitext(path)
    for n in range(1, MAX_KEPT_SWEEPS + 1):
        kept = "%s.%d%s" % (root, n, ext or ".json")
        try:
            os.link(path, kept)
        except FileExistsError:
            continue
        except OSError as err:
            raise UsageError("--save: %s holds a finished sweep that cannot be kept beside it "
                             "(%s); save to another file" % (path, err.strerror)) from None
        os.unlink(path)
        out.warn("--save: %s held a finished sweep; it is kept as %s" % (path, kept))
        return
    raise UsageError("--save: %s holds a finished sweep, and %s.1 to %s.%d%s are taken; save "
                     "to another file" % (path, root, root, MAX_KEPT_SWEEPS, ext))


def cell_fault(cell: Any) -> Optional[str]:
    if not isinstance(cell, dict):
        return "not an object"
    ci = cell.get("ci95_pct")
    checks = [
        ("model", isinstance(cell.get("model"), str)),
        ("workload", cell.get("workload") in WORKLOADS),
        ("tp", cell.get("tp") is None or is_count(cell.get("tp"))),
        *TrialLabels.checks(cell),
        ("max_tokens", is_count(cell.get("max_tokens"))),
        ("state", isinstance(cell.get("state"), str)),
        ("overhead_pct", cell.get("overhead_pct") is None or is_number(cell["overhead_pct"])),
        ("ci95_pct", ci is None or (isinstance(ci, list) and len(ci) == 2
                                    and all(map(is_number, ci))
                                    and isinstance(cell.get("significant"), bool)))]
    bad = next((name for name, good in checks if not good), None)
    return None if bad is None else "its %s is missing or malformed" % bad


def cost_file_fault(doc: Dict[str, Any]) -> Optional[str]:
    """What is wrong with a cost file's cells, as the cost table and the cell keys read them,
    or None: checked before the first request, so that no run measures and then cannot save."""
    for section in ("cells", "incomplete_cells"):
        cells = doc.get(section, [])
        if not isinstance(cells, list):
            return "%s is not a list" % section
        for i, cell in enumerate(cells, 1):
            fault = cell_fault(cell)
            if fault:
                return "%s %d: %s" % (section.replace("_", " ")[:-1], i, fault)
    return None


def given_options(parser: argparse.ArgumentParser,
                  argv: Optional[Sequence[str]]) -> List[argparse.Action]:
    """The options argv gives, in any spelling (abbreviated, with "="), whatever their value:
    argparse fills in a default only where the namespace it is handed lacks the attribute."""
    # a mark of its own for each: an appending option copies its list before it appends
    marks = {a.dest: [] if isinstance(a, argparse._AppendAction) else object()
             for a in parser._actions}
    marked = parser.parse_args(argv, argparse.Namespace(**marks))
    return [a for a in parser._actions if a.option_strings
            and getattr(marked, a.dest) is not marks[a.dest] and a.dest not in ("help", "version")]


def refuse_foreign_options(parser: argparse.ArgumentParser,
                           argv: Optional[Sequence[str]]) -> None:
    """An option of another mode is refused, naming the mode it belongs to, and so is any
    option given with no --mode (which would show the guide and ignore it)."""
    given = given_options(parser, argv)
    mode = next((a for a in given if a.dest == "mode"), None)
    chosen = parser.parse_args(argv).mode
    belongs = {a.dest: (title, modes) for group in parser._action_groups
               for title, modes in MODE_GROUPS if group.title == title
               for a in group._group_actions}
    for action in given:
        if action.dest not in belongs:
            continue
        title, modes = belongs[action.dest]
        # its own name: the first long spelling (--url, not its alias --base-url)
        name = next((o for o in action.option_strings if o.startswith("--")),
                    action.option_strings[0])
        if mode is None:
            raise UsageError("%s needs a --mode (%s): without one run.py shows the guide"
                             % (name, ", ".join(m for m in modes if m != "help")))
        if chosen not in modes:
            raise UsageError("%s belongs to %s, not to --mode %s" % (name, title, chosen))


def configure(argv: Optional[Sequence[str]]) -> Config:
    """Every check that needs no server, done before any request is sent."""
    parser = build_parser()
    args = parser.parse_args(argv)
    refuse_foreign_options(parser, argv)
    engine = None if args.engine == "auto" else args.engine
    made = provenance(sys.argv[1:] if argv is None else list(argv),
                      list(parser._option_string_actions))
    if args.mode in ("harness", "help"):
        return Config(mode=args.mode, engine=engine, provenance=made)
    default_port = ADAPTERS[engine or "vllm"].default_port  # vLLM's when it is to be found
    url = check_url(args.url or "http://localhost:%d" % default_port, "--url")
    prior_save = None
    if args.save:
        prior_save = check_save_target(
            args.save, SWEEP_SCHEMAS_READ if args.mode == "sweep" else (COST_SCHEMA,))
        fault = prior_save and args.mode == "cost" and cost_file_fault(prior_save)
        if fault:
            raise UsageError("--save: %s holds cost results the lab cannot add to (%s); save to "
                             "another file" % (args.save, fault))
    cfg = options_from(
        Config, args, engine=engine, url=url,
        api_key=check_api_key(args.api_key or os.environ.get("OPENAI_API_KEY") or None),
        provenance=made, prior_save=prior_save)
    if args.mode == "sweep":
        cfg.sweep = SweepOptions.from_args(args, url, engine)
        cfg.sampling = cfg.sweep.sampling
    else:
        cfg.cost = CostOptions.from_args(args, url)
        cfg.sampling = cfg.cost.sampling
    return cfg


# ----------------------------------------------------------------------------
# Arrivals and trials (--request-rate; --batch, --concurrency): when concurrent requests go
# out, and what one timed trial of cost mode is

MAX_REQUEST_RATE = 100000.0  # --request-rate above this is a burst in all but name
MIN_REQUEST_RATE = 0.001  # --request-rate below this waits longer than any --timeout between sends
LIMITS.append(("--request-rate (a second)", int(MAX_REQUEST_RATE)))


@dataclass(frozen=True)
class Arrivals:
    """When requests go out: all at once (rate None, a burst), or as a Poisson process at rate
    a second, its exponential gaps drawn from a seed so that a run can be repeated. Concurrent
    sweep traffic and load trials send so."""

    rate: Optional[float] = None

    @staticmethod
    def add_arguments(group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--request-rate", type=real_number(0.0, above=True), metavar="R",
            help="with --traffic concurrent (sweep) or --concurrency (cost): requests arrive at "
            "R a second, Poisson (exponential gaps drawn from --seed, so a run repeats), as vllm "
            "bench serve's --request-rate; default: all at once (a burst)")

    @classmethod
    def configure(cls, rate: Optional[float], needs: Optional[str]) -> "Arrivals":
        """--request-rate, checked; needs: what it goes with, when that was not asked for."""
        if rate is not None and rate > MAX_REQUEST_RATE:
            raise UsageError("--request-rate: at most %g a second" % MAX_REQUEST_RATE)
        if rate is not None and rate < MIN_REQUEST_RATE:
            raise UsageError(
                "--request-rate: at least %g a second (one request in %d minutes at most)" %
                (MIN_REQUEST_RATE, round(1 / MIN_REQUEST_RATE / 60)))
        if rate is not None and needs:
            raise UsageError("--request-rate goes with %s" % needs)
        return cls(rate)

    def schedule(self, n: int, seed: int) -> List[float]:
        """Each request's send time, in seconds after the first."""
        if not self.rate:
            return [0.0] * n
        rng, at, times = random.Random(seed), 0.0, []
        for _ in range(n):
            times.append(at)
            at += rng.expovariate(self.rate)
        return times

    def wait_until(self, when: float) -> None:
        """Sleep until the request's send time; a stop signal ends the wait (and the sending)."""
        if self.rate:
            STOP.event.wait(max(0.0, when - CLOCK()))
        if STOP.event.is_set():
            raise Stopped(STOP.signum)  # no request starts after a stop signal

    def describe(self) -> str:
        """As saved and shown: the rate exact (shortest round-trip form), so that two rates
        are never one label: 1.0000001 and 1.0000004 a second are two measurements."""
        if not self.rate:
            return "burst"
        rate = repr(self.rate)
        return "poisson at %s/s" % (rate[:-2] if rate.endswith(".0") else rate)


SHARED_OPTIONS.append(Arrivals.add_arguments)


# ----------------------------------------------------------------------------
# Requests as values, and the one executor that sends them: every generation request the lab
# makes (a sweep's traffic shapes, its checks' requests, the neighbours beside a decode, the
# cost mode's batch and load trials) is a Request handed to send_requests, the only place
# that builds a generation request's body, opens its connection and starts its thread


@dataclass(frozen=True)
class RequestTiming:
    """One streamed request of a load trial."""

    ttft_s: Optional[float]  # time to first token; None where the stream does not show it
    latency_s: float  # from sending to the last token
    tokens: int  # output tokens
    tpot_s: Optional[float]  # time per output token after the first
    progress_events: int  # stream events that reported more tokens
    # the gaps between those events, as `vllm bench serve` counts inter-token latency: kept
    # for the arm's ITL figures, not saved request by request
    itl_s: List[float] = field(default_factory=list, metadata=NOT_SAVED)


def token_by_token(first_count: int, events: int, count: int) -> bool:
    """Does a stream report its progress token by token, so that its first token's arrival
    and the time between tokens mean something? Its first progress event must report one
    token, and at least half its tokens must arrive in events of their own (an engine may
    coalesce a few under load); a stream that reports its count only at the end does not."""
    return first_count == 1 and 2 * events >= count


def most_in_flight(sent: Sequence[float], answered: Sequence[float]) -> Tuple[int, List[int]]:
    """From each request's send and answer times: the most requests at the server at once,
    and how many others each one had beside it."""
    events = sorted([(t, 1) for t in sent] + [(t, -1) for t in answered],
                    key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    beside = [sum(1 for j in range(len(sent)) if j != i and sent[j] < answered[i]
                  and sent[i] < answered[j]) for i in range(len(sent))]
    return most, beside


@dataclass(frozen=True)
class Request:
    """One generation request: what it asks, its cache key, streamed or not, and when it goes
    out."""

    prompts: Tuple[str, ...]  # one request of these prompts (a stream: one)
    sampling: Sampling
    cache_key: Optional[str] = None  # None: a fresh one where the cache is bypassed
    stream: bool = False  # streamed, and timed token by token (RequestTiming)
    at: float = 0.0  # seconds after its list's start (Arrivals.schedule); 0: at once
    # instead of prompts: a token-id prompt that prefills and writes one token, whose answer
    # is not read (a neighbour beside a measured request)
    ids: Optional[Tuple[int, ...]] = None

    def body(self, adapter: EngineAdapter, model: str, isolate: bool) -> Dict[str, Any]:
        """The one place a generation request's body is built (each engine's adapter writes
        it in its own wire format)."""
        if self.ids is not None:
            return adapter.prefill_only_body(model, list(self.ids))
        if self.stream:
            return adapter.stream_body(model, self.prompts[0], self.sampling)
        return adapter.body(model, list(self.prompts), self.sampling, isolate, self.cache_key)


@dataclass
class Answer:
    """What one request brought back, and when."""

    completions: List[Completion]  # one a prompt ([] for a stream or a neighbour)
    cached_tokens: Optional[int]  # the request's count, as the server reports it
    # per completion: its tokens served from the prefix cache, where the count can be its
    # own (None: not known)
    cached: List[Optional[int]]
    sent: float  # CLOCK() as it went out
    answered: float  # CLOCK() as its answer was in
    output_tokens: Optional[int] = None  # as the server counts them (a batch trial's figure)
    beside: Optional[int] = None  # other requests at the server with it (scheduled, or beside)
    timing: Optional[RequestTiming] = None  # a streamed request's
    prompt_tokens: Optional[int] = None  # every prompt's, as the server counts them


@dataclass
class Sent:
    """What a list of requests brought back: each request's answer, and the list's times."""

    answers: List[Answer]
    seconds: float  # from the first send (a burst: once every connection was open) to the last
    in_flight: Optional[int] = None  # scheduled lists: the most of them at the server at once
    background: int = 0  # requests sent beside the list (neighbours) that overlapped it
    # the prompt tokens of every request sent beside it, as the server counted them (None:
    # some answer did not say)
    background_tokens: Optional[int] = 0


@dataclass(frozen=True)
class Executor:
    """Sends lists of Requests to one server: send_requests is its only sending function."""

    client: HttpClient
    adapter: EngineAdapter
    model: str
    isolate: bool = False  # the cache policy: bypass (each body takes a fresh cache key)

    def read(self, request: Request, post: Exchange, sent: float) -> Answer:
        """One request's answer, parsed, from its open exchange."""
        if request.stream:
            timing = self.read_stream(request, post, sent)
            return Answer([], None, [], sent, CLOCK(), timing.tokens, timing=timing)
        return self.parse(request, post.answer(), sent, CLOCK())

    def parse(self, request: Request, answer: Any, sent: float, answered: float) -> Answer:
        """A whole answer, as the adapter reads it."""
        adapter = self.adapter
        if request.ids is not None:  # a neighbour: only its prompt tokens are read
            return Answer([], None, [], sent, answered,
                          prompt_tokens=parsed("the answer", adapter.prompt_tokens, answer))
        prompts = list(request.prompts)
        logprobs = request.sampling.logprobs is not None
        return Answer(parsed("the answer", adapter.completions, answer, len(prompts), logprobs),
                      parsed("the answer", adapter.cached_tokens, answer),
                      parsed("the answer", adapter.cached_per_prompt, answer, prompts),
                      sent, answered, parsed("the answer", adapter.output_tokens, answer)
                      if not logprobs else None,
                      prompt_tokens=parsed("the answer", adapter.prompt_tokens, answer))

    def read_stream(self, request: Request, post: Exchange, start: float) -> RequestTiming:
        """A streamed request, read event by event: time to first token, time per output
        token after it, end-to-end latency."""
        adapter, sampling = self.adapter, request.sampling
        first = last = None
        count = first_count = events = 0
        gaps: List[float] = []
        for event in post.events():
            seen = parsed("a stream event", adapter.streamed_tokens, event)
            if seen is not None and seen > count:
                now = CLOCK()
                if last is not None:
                    gaps.append(now - last)
                count, last, events = seen, now, events + 1
                if first is None:
                    first, first_count = last, seen
        if first is None:
            raise shape_error("the stream held no token")
        if count > sampling.max_tokens:
            raise shape_error(
                "the stream reported %d output tokens, more than --max-tokens %d "
                "allows" % (count, sampling.max_tokens))
        ttft = tpot = None
        if token_by_token(first_count, events, count):
            ttft = first - start
            tpot = (last - first) / (count - 1) if count > 1 else None
        return RequestTiming(ttft, last - start, count, tpot, events, gaps)

    def exchange(self, request: Request) -> Exchange:
        return Exchange(self.client, "POST", self.adapter.generate_path,
                        request.body(self.adapter, self.model, self.isolate))

    def one(self, request: Request) -> Answer:
        """A request in the calling thread, its whole answer read (a plain one through the
        client's request, which refuses a POST's redirect)."""
        # its body is built before its time starts; its connection's set-up is part of its
        # time, as a client sees it
        if not request.stream:
            body = request.body(self.adapter, self.model, self.isolate)
            sent = CLOCK()
            answer = self.client.request(self.adapter.generate_path, body)
            return self.parse(request, answer, sent, CLOCK())
        post = self.exchange(request)
        sent = CLOCK()
        try:
            post.connect()
            post.send()
            return self.read(request, post, sent)
        finally:
            post.close()  # whatever ended it, its connection goes with it


def send_requests(executor: Executor, requests: Sequence[Request], what: str,
                  concurrency: Optional[int] = None, arrivals: Optional[Arrivals] = None,
                  beside: Optional[Callable[[], Request]] = None, streams: int = 0) -> Sent:
    """Send a list of requests to one server, the one function that hands request threads to
    in_threads, and return what each brought back (a failure is labelled with what, and the
    worst one raised in the calling thread, a stop signal first):
    - one request alone: in the calling thread;
    - concurrency None: each request its own connection, opened first; then every request
      written from the calling thread at its time (Request.at after the start: all at once,
      a burst, so they reach the server within milliseconds; or on a schedule, each answer
      read as soon as its request is out), so that the answers show which were at the
      server together (Answer.beside, Sent.in_flight);
    - concurrency C: at most C in flight, a closed loop (a request leaves, the next goes at
      its time), and once one fails no other starts;
    - beside: while the list's one request runs, streams clients keep sending beside()'s
      requests (neighbours), and Sent.background counts those that overlapped it."""
    wait = (arrivals or Arrivals()).wait_until
    n = len(requests)
    if beside is None and concurrency is None and n == 1:
        answer = executor.one(requests[0])
        return Sent([answer], answer.answered - answer.sent)
    answers: List[Any] = [None] * n  # an Answer, or what failed
    start = 0.0
    jobs: List[Callable[[], Any]] = []
    meanwhile: Optional[Callable[[], None]] = None
    if beside is not None:  # the list's requests in the calling thread, neighbours beside
        done = threading.Event()
        spans: List[Tuple[float, float]] = []
        tokens: List[Optional[int]] = []  # each neighbour's prompt tokens
        lock = threading.Lock()

        def background() -> None:
            while not done.is_set() and not STOP.event.is_set():
                with lock:
                    request = beside()
                sent = CLOCK()
                answer = executor.one(request)
                with lock:
                    spans.append((sent, CLOCK()))
                    tokens.append(answer.prompt_tokens)

        def measured() -> None:
            nonlocal start
            try:
                start = CLOCK()
                for i, request in enumerate(requests):
                    answers[i] = executor.one(request)
            finally:
                done.set()

        jobs, meanwhile = [background] * streams, measured
        failed_outcome(in_threads(jobs, meanwhile), what)
        failed_outcome(answers, what)
        first, last = answers[0].sent, answers[-1].answered
        overlapped = sum(1 for a, b in spans if a < last and b > first)
        for answer in answers:
            answer.beside = overlapped
        return Sent(answers, CLOCK() - start, background=overlapped,
                    background_tokens=total_count(tokens) if tokens else 0)
    if concurrency is not None:  # a closed loop
        pending = list(enumerate(requests))[::-1]  # popped from the end
        failed: List[BaseException] = []  # once a request fails, no worker starts another
        lock = threading.Lock()

        def worker() -> None:
            while True:
                with lock:
                    if not pending or failed:
                        return
                    i, request = pending.pop()
                try:
                    wait(start + request.at)
                    answers[i] = executor.one(request)
                except BaseException as err:  # raised in the calling thread, below
                    answers[i] = err
                    failed.append(err)

        allow_open_files(concurrency)
        start = CLOCK()
        in_threads([worker] * min(concurrency, n))
        seconds = CLOCK() - start
        failed_outcome(answers, what)
        return Sent(answers, seconds)
    # each request its own connection, every one written from the calling thread
    allow_open_files(n)
    posts = [executor.exchange(r) for r in requests]
    ready, all_sent = threading.Semaphore(0), threading.Event()
    scheduled = any(r.at for r in requests) or bool(arrivals and arrivals.rate)
    # A burst's threads wait for every request to be out; scheduled ones for their own
    went = [threading.Event() for _ in range(n)] if scheduled else [all_sent] * n
    sent_at: List[float] = [0.0] * n

    def client_thread(i: int) -> None:
        try:
            posts[i].connect()
        except BaseException as err:  # raised in the calling thread, by failed_outcome
            answers[i] = err
        ready.release()
        went[i].wait()
        if answers[i] is None:
            try:
                answers[i] = executor.read(requests[i], posts[i], sent_at[i])
            except BaseException as err:
                answers[i] = err
            finally:
                posts[i].close()

    def send_all() -> None:
        nonlocal start
        try:
            for _ in range(n):
                ready.acquire()
            start = CLOCK()
            for i, post in enumerate(posts):
                if answers[i] is None:
                    try:
                        wait(start + requests[i].at)
                        sent_at[i] = CLOCK()
                        post.send()
                    except BaseException as err:
                        answers[i] = err
                went[i].set()
        finally:
            all_sent.set()  # even on a second stop signal: no thread waits for ever
            for event in went:
                event.set()

    in_threads([functools.partial(client_thread, i) for i in range(n)], send_all)
    seconds = CLOCK() - start
    failed_outcome(answers, what)
    for answer, sent in zip(answers, sent_at):  # a burst's readers may start before its send
        answer.sent = sent
    found = Sent(answers, seconds)
    if scheduled:  # which requests were at the server together?
        found.in_flight, beside_of = most_in_flight(sent_at, [a.answered for a in answers])
        for answer, others in zip(answers, beside_of):
            answer.beside = others
    return found


# ----------------------------------------------------------------------------
# The cost trials, continued: a batch request, or streamed requests under load


@dataclass(frozen=True)
class BatchTrials:
    """--batch: a trial is one request of --batch prompts, timed from its sending to its last
    byte (the default)."""

    prompts: int  # --batch: prompts in one request

    @staticmethod
    def add_arguments(group: argparse._ArgumentGroup) -> None:
        group.add_argument("--batch", type=whole_number(1, MAX_BATCH_SIZE),
                           help="prompts per timed request (default %d; not with --concurrency)"
                           % DEFAULT_BATCH)

    def run(self, arm: "Arm", prompts: List[str], adapter: EngineAdapter,
            sampling: Sampling) -> Tuple[float, int, None]:
        """One timed request: (seconds, output tokens, None). The answer's shape must hold even
        when timing."""
        # one request carrying every prompt, so that the engine schedules them as one batch
        sent = send_requests(Executor(arm.client, adapter, arm.facts.model_id),
                             [Request(tuple(prompts), sampling)], "the batch request")
        return sent.seconds, sent.answers[0].output_tokens, None

    def cell_parts(self, arms: Sequence["Arm"], pairs: int,
                   primary: "Overhead") -> Tuple[int, None]:
        """What the cell holds of its trials: their batch size, and nothing under load."""
        return self.prompts, None





LOAD_FIGURES = ("latency", "ttft", "tpot")  # what each request of a load trial is timed on
UNMEASURED_STREAM = (
    "the stream does not report its progress token by token (its first event carries several "
    "tokens, or most tokens arrive together), so neither the first token's arrival nor the time "
    "between tokens can be seen: latency and throughput stand")


@dataclass(frozen=True)
class Spread:
    """A figure over every request of an arm (every gap between tokens, for ITL): mean,
    median, 90th and 99th percentile, the four `vllm bench serve` prints."""

    mean_s: float
    median_s: float
    p90_s: float
    p99_s: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Optional["Spread"]:
        if not values:
            return None
        return cls(statistics.fmean(values), statistics.median(values),
                   percentile(values, 0.90), percentile(values, 0.99))

    def text(self) -> str:
        """The four in milliseconds, as a load report's row shows them."""
        return "/".join("%.1f" % (1000 * value) for value in
                        (self.mean_s, self.median_s, self.p90_s, self.p99_s))


@dataclass(frozen=True)
class LoadStats:
    """One cost arm under load: the Spread of every request's latency, TTFT and TPOT and of
    every inter-token gap (ITL), the medians of the trials' throughputs, and every request's
    timing."""

    latency: Optional[Spread]
    ttft: Optional[Spread]
    tpot: Optional[Spread]
    itl: Optional[Spread] = field(metadata=saved(omit_none=True))  # None: a token-less stream
    unmeasured: Optional[str] = field(metadata=saved(omit_none=True))  # why there is no TTFT
    median_tokens_per_s: Optional[float]
    median_requests_per_s: Optional[float]
    requests: List[List[RequestTiming]]  # trial by trial
    # the same figures under `vllm bench serve --save-result`'s flat names and units
    # (BenchServeResult.figures)
    bench_serve: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, requests: List[List[RequestTiming]], samples_s: List[float],
           output_tokens: List[int],
           bench_serve: Optional["BenchServeResult"] = None) -> "LoadStats":
        spreads = {}
        for figure in LOAD_FIGURES:
            found = (getattr(r, figure + "_s") for trial in requests for r in trial)
            spreads[figure] = Spread.of([v for v in found if v is not None])
        # only streams whose tokens came one by one (a TTFT was seen) have gaps that mean ITL
        spreads["itl"] = Spread.of([gap for trial in requests for r in trial
                                    if r.ttft_s is not None for gap in r.itl_s])
        # A trial shorter than the clock's resolution has no rate: it is left out.
        timed = [t for t in zip(requests, output_tokens, samples_s) if t[2] > 0]
        tokens_per_s = statistics.median(n / s for _, n, s in timed) if timed else None
        requests_per_s = statistics.median(len(r) / s for r, _, s in timed) if timed else None
        flat = bench_serve.figures(requests, samples_s) if bench_serve else {}
        return cls(unmeasured=None if spreads["ttft"] else UNMEASURED_STREAM,
                   median_tokens_per_s=tokens_per_s, median_requests_per_s=requests_per_s,
                   requests=requests, bench_serve=flat, **spreads)


def linear_percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0 to 100) interpolated between the two nearest ranks, as numpy's
    np.percentile computes it by default (what `vllm bench serve` reports)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * p / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# `vllm bench serve --percentile-metrics`' names the lab measures, each with what it reads of
# a request (vllm/benchmarks/serve.py, 0.34.0 lines 1848-1857 list them; lines 782-806
# compute them)
BENCH_SERVE_METRICS = ("ttft", "tpot", "itl", "e2el")
BENCH_SERVE_NOT_MEASURED = ("client_queue_time", "e2el_including_client_queue")


@dataclass(frozen=True)
class BenchServeResult:
    """An arm's load figures as `vllm bench serve --save-result` names them (its result
    dictionary, vllm/benchmarks/serve.py, 0.34.0 lines 1319-1328 and 1426-1432): every
    trial of the arm taken as one run, so duration is the trials' time together and a
    throughput is what they did in it; times in milliseconds. --percentile-metrics and
    --metric-percentiles choose the figures as they do there."""

    metrics: Tuple[str, ...] = BENCH_SERVE_METRICS
    percentiles: Tuple[float, ...] = (99.0,)  # bench serve's default, "99"
    max_concurrency: Optional[int] = None
    request_rate: Any = "inf"  # as bench serve writes a burst

    @staticmethod
    def add_arguments(group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--percentile-metrics", metavar="M,M",
            help="load trials: the figures saved under `vllm bench serve` result names "
            "(mean_X_ms, median_X_ms, std_X_ms, pP_X_ms), of ttft, tpot, itl, e2el "
            "(default: all four)")
        group.add_argument(
            "--metric-percentiles", metavar="P,P",
            help="load trials: the percentiles saved under those names (default 99)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "BenchServeResult":
        # given empty is refused below, not taken for the default
        chosen = (",".join(BENCH_SERVE_METRICS) if args.percentile_metrics is None
                  else args.percentile_metrics)
        metrics = tuple(m.strip() for m in chosen.split(",") if m.strip())
        for metric in metrics:
            if metric in BENCH_SERVE_NOT_MEASURED:
                raise UsageError(
                    "--percentile-metrics: %s is not measured here: a load trial's requests "
                    "wait in no queue of the client (each goes when a slot is free); give "
                    "some of %s" % (metric, ",".join(BENCH_SERVE_METRICS)))
            if metric not in BENCH_SERVE_METRICS:
                raise UsageError("--percentile-metrics: %r is none of %s"
                                 % (metric, ",".join(BENCH_SERVE_METRICS)))
        if not metrics:
            raise UsageError("--percentile-metrics: give some of %s"
                             % ",".join(BENCH_SERVE_METRICS))
        percentiles = []
        for text in ("99" if args.metric_percentiles is None
                     else args.metric_percentiles).split(","):
            try:
                value = float(text)
            except ValueError:
                value = math.nan
            if not (0.0 <= value <= 100.0) or not text.strip().isascii():
                raise UsageError("--metric-percentiles: %r is not a percentile from 0 to 100"
                                 % text.strip())
            percentiles.append(value)
        return cls(tuple(dict.fromkeys(metrics)), tuple(dict.fromkeys(percentiles)))

    def figures(self, requests: List[List[RequestTiming]],
                samples_s: List[float]) -> Dict[str, Any]:
        """The flat result: None where the lab measured nothing (bench serve writes 0 there,
        which a reader would take for a figure), never a guess."""
        done = [r for trial in requests for r in trial]
        duration = sum(samples_s[:len(requests)])
        tokens = sum(r.tokens for r in done)
        values = {
            "ttft": [r.ttft_s for r in done if r.ttft_s is not None],
            "tpot": [r.tpot_s for r in done if r.tpot_s is not None],
            # only streams that came token by token have gaps that are inter-token latency
            "itl": [gap for r in done if r.ttft_s is not None for gap in r.itl_s],
            "e2el": [r.latency_s for r in done]}
        result: Dict[str, Any] = {
            "duration": duration, "completed": len(done), "total_output_tokens": tokens,
            "request_throughput": len(done) / duration if duration > 0 else None,
            "output_throughput": tokens / duration if duration > 0 else None,
            # the lab's streams do not count prompt tokens: no total to divide
            "total_token_throughput": None,
            "max_concurrency": self.max_concurrency, "request_rate": self.request_rate,
            "num_prompts": len(done)}  # every trial's, as one run
        for metric in self.metrics:
            found = [1000.0 * v for v in values[metric]]
            result["mean_%s_ms" % metric] = statistics.fmean(found) if found else None
            result["median_%s_ms" % metric] = statistics.median(found) if found else None
            result["std_%s_ms" % metric] = statistics.pstdev(found) if found else None
            for p in self.percentiles:
                word = str(int(p)) if int(p) == p else str(p)
                result["p%s_%s_ms" % (word, metric)] = (linear_percentile(found, p)
                                                        if found else None)
        return result





@dataclass(frozen=True)
class LoadCell:
    """What a cost cell of load trials holds beyond a batch cell's fields (saved among them)."""

    concurrency: int
    requests: int  # a trial
    primary: str  # the overhead the cell reports first: throughput
    arrivals: str  # Arrivals.describe()
    load: Dict[str, LoadStats]  # each arm's
    overheads: Dict[str, "Overhead"]  # throughput, then LOAD_FIGURES

    def report(self, compared_on: str, out: Out) -> None:
        """Each arm's throughput and latencies, and what the flag costs in each."""

        for name, stats in self.load.items():
            out.line("  flag %-3s %s tokens/s, %s requests/s" % (
                name, fmt_opt(stats.median_tokens_per_s, "?", "%.1f"),
                fmt_opt(stats.median_requests_per_s, "?", "%.2f")))
            shown = ("%s %s" % (label, spread.text() if spread else "unmeasured")
                     for label, spread in (("TTFT", stats.ttft), ("TPOT", stats.tpot),
                                           ("ITL", stats.itl), ("E2E", stats.latency)))
            out.line("           mean/median/p90/p99 ms: %s" % ", ".join(shown))
        for figure in LOAD_FIGURES:
            overhead = self.overheads[figure]
            label = figure.upper() if figure != "latency" else "latency"
            if overhead.unmeasured:
                out.line("  %-8s unmeasured: %s" % (label, overhead.unmeasured))
                continue
            shown = overhead.text("%+.1f%% [%+.1f%%, %+.1f%%]%s", "%+.1f%% (no interval)", " n.s.")
            out.line("  %-8s overhead %s" % (label, shown))
        if compared_on != "time per trial":
            out.line("  compared on %s" % compared_on)


def per_trial_medians(arm: "Arm", figure: str) -> List[float]:
    """Each trial's median of a figure ("latency", "ttft" or "tpot"); NaN where none has it."""
    medians = []
    for trial in arm.timings:
        values = [getattr(r, figure + "_s") for r in trial]
        medians.append(statistics.median([v for v in values if v is not None] or [math.nan]))
    return medians


@dataclass(frozen=True)
class Overhead:
    """What the flag costs by one measure, from paired trials: the median on/off ratio - 1 in
    per cent, with its 95% interval (none, and never significant, below
    MIN_PAIRS_FOR_INTERVAL pairs), or why it could not be measured."""

    pct: Optional[float] = field(metadata=saved("overhead_pct"))
    ci95_pct: Optional[List[float]]
    significant: bool
    ratios: List[float] = field(default_factory=list, metadata=NOT_SAVED)  # on/off, by pair
    unmeasured: Optional[str] = field(default=None, metadata=saved(omit_none=True))

    @classmethod
    def of(cls, off_s: Sequence[float], on_s: Sequence[float]) -> "Overhead":
        # no ratio (infinite) where the flag-off figure is none or infinite, not 0 or NaN
        ratios = [b / a if 0 < a < math.inf else math.inf for a, b in zip(off_s, on_s)]
        rounded = [round(r, 6) for r in ratios]
        if len(ratios) < MIN_PAIRS_FOR_INTERVAL or not all(map(math.isfinite, ratios)):
            median = statistics.median(ratios) if ratios else math.nan
            pct = round((median - 1.0) * 100.0, 3) if math.isfinite(median) else None
            why = None
            if pct is None and ratios:  # pairs there are, but no ratio of them means anything
                why = cls.unmeasurable(off_s, on_s)
            return cls(pct, None, False, rounded, why)
        lo, hi = bootstrap_median_ci(ratios)
        ci = [round((lo - 1.0) * 100.0, 3), round((hi - 1.0) * 100.0, 3)]
        pct = round((statistics.median(ratios) - 1.0) * 100.0, 3)
        return cls(pct, ci, not (ci[0] <= 0.0 <= ci[1]), rounded)

    @staticmethod
    def unmeasurable(off_s: Sequence[float], on_s: Sequence[float]) -> str:
        """Why pairs give no ratio, naming the arm: a figure of no time (a trial shorter than
        the clock's resolution) or an infinite one (a time per token where a trial reported
        no output tokens: per_token)."""
        for name, values in (("off", off_s), ("on", on_s)):
            if any(math.isinf(v) for v in values):
                return "a flag-%s trial reported no output tokens" % name
        for name, values in (("off", off_s), ("on", on_s)):
            if any(v <= 0 for v in values):
                return "a flag-%s trial took no time the clock could measure" % name
        return "a flag-off trial took no time the clock could measure"

    @classmethod
    def from_record(cls, record: Json) -> "Overhead":
        return cls(record.get("overhead_pct"), record.get("ci95_pct"),
                   bool(record.get("significant")), unmeasured=record.get("unmeasured"))

    def text(self, with_interval: str, without: str, not_significant: str) -> str:
        """with_interval % (value, low, high, mark), mark being not_significant when the
        interval contains 0; without % value when there are too few pairs for one."""
        if self.pct is None:
            return "no overhead (%s)" % (self.unmeasured or "no complete trial pair")
        if self.ci95_pct is None:
            return without % self.pct
        lo, hi = self.ci95_pct
        return with_interval % (self.pct, lo, hi, "" if self.significant else not_significant)


@dataclass(frozen=True)
class LoadTrials:
    """--concurrency: a trial is --requests one-prompt streamed requests, at most
    --concurrency in flight (a closed loop: a request leaves, the next goes), each timed on
    its latency, time to first token and time per output token; the cell then holds each
    arm's LoadStats and an overhead for throughput and each figure."""

    concurrency: int  # requests in flight at once
    prompts: int  # --requests: requests a trial, one prompt each
    arrivals: Arrivals  # when each request goes out (--request-rate)
    bench_serve: BenchServeResult = BenchServeResult()  # its figures under bench serve's names

    @staticmethod
    def add_arguments(group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--concurrency", "--max-concurrency", dest="concurrency",
            type=whole_number(1, MAX_BATCH_SIZE), metavar="C",
            help="time a server under load instead of one batch request: each trial is "
            "--requests one-prompt streamed requests, at most C in flight (throughput, TTFT, "
            "TPOT, ITL and latency of both arms), as `vllm bench serve --max-concurrency C`")
        group.add_argument("--requests", "--num-prompts", dest="requests",
                           type=whole_number(1, MAX_REQUESTS), metavar="R",
                           help="requests per load trial, as one `vllm bench serve "
                           "--num-prompts R` run (default 4 x --concurrency; at least C)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Optional["LoadTrials"]:
        """--concurrency, --requests and --request-rate, checked (None: batch trials)."""
        concurrency, requests = args.concurrency, args.requests
        if requests is not None and concurrency is None:
            raise UsageError("--requests goes with --concurrency")
        if args.batch is not None and concurrency is not None:
            raise UsageError("--batch times one request of that many prompts; --concurrency "
                             "times streamed requests under load instead: give one of them")
        if concurrency:
            requests = 4 * concurrency if requests is None else requests
            if requests < concurrency:
                raise UsageError(
                    "--requests: give at least --concurrency (%d), or some slots stay empty"
                    % concurrency)
        needs = None if concurrency else "--concurrency (one streamed request a prompt)"
        arrivals = Arrivals.configure(args.request_rate, needs)
        if not concurrency:
            given = [name for name, value in (("--percentile-metrics", args.percentile_metrics),
                                              ("--metric-percentiles", args.metric_percentiles))
                     if value is not None]
            if given:
                raise UsageError("%s goes with --concurrency: it chooses figures of load "
                                 "trials" % given[0])
            return None
        chosen = BenchServeResult.from_args(args)
        bench_serve = dataclasses.replace(chosen, max_concurrency=concurrency,
                                          request_rate=arrivals.rate or "inf")
        return cls(concurrency, requests, arrivals, bench_serve)

    def run(self, arm: "Arm", prompts: List[str], adapter: EngineAdapter,
            sampling: Sampling) -> Tuple[float, int, List[RequestTiming]]:
        """A closed-loop load run: every prompt its own streamed request, at most concurrency
        in flight. Per request: time to first token, time per output token after it,
        end-to-end latency. Returns (seconds, output tokens, timings)."""
        # Each trial's arrivals drawn from a seed of its own, the same on both arms
        arrivals = self.arrivals
        schedule = arrivals.schedule(len(prompts), DEFAULT_SEED + len(arm.samples))
        requests = [Request((prompt,), sampling, stream=True, at=at)
                    for prompt, at in zip(prompts, schedule)]
        sent = send_requests(Executor(arm.client, adapter, arm.facts.model_id), requests,
                             "streamed requests", concurrency=self.concurrency,
                             arrivals=arrivals)
        timings = [answer.timing for answer in sent.answers]
        return sent.seconds, sum(t.tokens for t in timings), timings

    def cell_parts(self, arms: Sequence["Arm"], pairs: int,
                   primary: "Overhead") -> Tuple[None, "LoadCell"]:
        """What the cell holds of its trials: no batch size, and a LoadCell of each arm's
        LoadStats and what the flag costs in throughput (the primary figure: the on/off ratio of
        the time each trial took for the same tokens; +30 %: throughput falls to 1/1.3) and in
        each figure (paired per-trial medians)."""
        off, on = arms
        load = {arm.name: LoadStats.of(arm.timings, arm.samples, arm.tokens, self.bench_serve)
                for arm in arms}
        overheads = {"throughput": primary}
        for figure in LOAD_FIGURES:
            a, b = per_trial_medians(off, figure)[:pairs], per_trial_medians(on, figure)[:pairs]
            if all(map(math.isfinite, a + b)):
                overheads[figure] = Overhead.of(a, b)
                continue
            one_token = all(r.tokens < 2 for arm in arms for t in arm.timings for r in t)
            if figure == "latency":
                why = "a trial had no latency"
            elif figure == "tpot" and one_token:
                why = "time per output token needs at least two tokens a request"
            else:
                why = UNMEASURED_STREAM
            overheads[figure] = Overhead(None, None, False, unmeasured=why)
        return None, LoadCell(self.concurrency, self.prompts, "throughput",
                              self.arrivals.describe(), load, overheads)


@dataclass(frozen=True)
class TrialLabels:
    """What a cost cell's labels say of its trials, read from a saved cell (CellLabels)."""

    batch: Optional[int]  # batch trials: prompts a request
    concurrency: Optional[int]  # load trials: requests in flight
    requests: Optional[int]  # load trials: requests a trial
    arrivals: Optional[str]  # load trials; None in files saved before --request-rate

    @classmethod
    def from_record(cls, cell: Json) -> "TrialLabels":
        return cls(*map(cell.get, ("batch", "concurrency", "requests", "arrivals")))

    def shape(self) -> str:
        if not self.concurrency:
            return "batch %d" % self.batch
        rate = "" if self.arrivals in (None, "burst") else ", " + self.arrivals
        return "concurrency %d, %d requests a trial%s" % (self.concurrency, self.requests, rate)

    @staticmethod
    def checks(cell: Json) -> List[Tuple[str, bool]]:
        """Each label, and whether a saved cell holds it well formed (cell_fault)."""
        load = cell.get("concurrency")
        return [("batch", is_count(cell.get("batch")) or (load and cell.get("batch") is None)),
                ("concurrency", load is None or is_count(load)),
                ("requests", not load or is_count(cell.get("requests"))),
                ("arrivals", cell.get("arrivals") is None or isinstance(cell["arrivals"], str))]


# ----------------------------------------------------------------------------
# The sweep's core: one batch sent and compared, request by request; its records; the
# interface every sweep check shares (the checks follow, each in a section of its own, and
# --mode sweep lists them in SWEEP_CHECKS)


@dataclass(frozen=True)
class Evidence:
    """What one completion of a batch showed against the baseline, and what it can show: a
    request the prefix cache served compares the cache, not the batch, in either direction;
    a request that was alone at the server compares nothing about batching. Verdicts read
    these, request by request and pass by pass, never a sum over a size."""

    delta: Delta  # against the baseline
    text_moved: bool  # its text is not the baseline's
    tokens: int  # generated tokens compared
    served: Optional[bool]  # the cache served its request (None: the server does not say)
    beside: Optional[int]  # other requests of its batch at the server with it (None: unknown)
    unclear: bool = False  # served is not known even under the bypass (SentBatch.unclear)

    def cold(self, cache_kept: bool) -> Optional[bool]:
        """Was its request computed, not served from the prefix cache? None: not known (the
        server does not say, and the cache was kept or the bypass is known not to have held
        for it: under the bypass every request asked to be cold, and the bypass's proof is
        BypassCheck's)."""
        if self.served is not None:
            return not self.served
        return None if cache_kept or self.unclear else True

    @property
    def moved(self) -> bool:
        d = self.delta
        return bool(d.max_ulp or d.first_token_divergence is not None
                    or d.first_ulp_step is not None or self.text_moved
                    or any(u in MOVED_NOTES for u in d.ulp_notes))

    def what_moved(self) -> Optional[str]:
        """The first kind of move, in the verdict's order: tokens, then text, then logprobs
        (a top-k change among them)."""
        if self.delta.first_token_divergence is not None:
            return "tokens"
        if self.text_moved:
            return "text"
        if "top-k changed" in self.delta.ulp_notes and not self.delta.max_ulp:
            return "top-k"
        return "logprobs" if self.moved else None


@dataclass
class SentBatch:
    """What one batch size's traffic brought back: the completions to compare (the measured
    prompt's only), what the server said about each one's request, and when they ran."""

    completions: List[Completion]
    seconds: float  # from the first send to the last answer
    cached_tokens: Optional[int]  # prompt tokens served from the prefix cache, if the server says
    # per completion: the cached-token count of its own request (None: the server does not say)
    cached: List[Optional[int]] = field(default_factory=list)
    # per completion: how many other requests of the batch were at the server with it
    beside: List[Optional[int]] = field(default_factory=list)
    send_spread: Optional[float] = None  # concurrent: first to last request's send time
    # scheduled concurrent requests: were any two ever in flight together (None: a burst,
    # all in flight by construction, or one request)
    overlapped: Optional[bool] = None
    in_flight: Optional[int] = None  # scheduled: the most requests at the server at once
    # one request's cache key (copies under the bypass): a repeat under it is served from
    # the cache its prefill filled (the cache check)
    cache_key: Optional[str] = None
    prompt_tokens: Optional[int] = None  # every prompt sent, fillers too, as the server counts
    # what the server showed of its prefix cache around the batch, against its answers'
    # counts: its counters, or its cache switched off (None: it showed nothing)
    cache_seen: Optional[CacheEvidence] = None
    # the server's counters have shown it serving what its answers did not count, and could
    # not say of this batch: its answers' counts of 0 prove nothing here (CounterWatch)
    counts_doubted: bool = False
    background: int = 0  # requests sent beside it (neighbours) that overlapped it
    fillers: int = 0  # prompts sent in its request and not kept (mixed traffic)

    def served(self, count: Optional[int]) -> Optional[bool]:
        """Did the prefix cache serve a completion's request, given its own cached-token count
        (None: not known)? Served where the counters show the cache serving more of the batch
        than its answers counted (which request, they do not say) or where its count says so;
        cold where the counters show the cache serving none of the batch, or where its count
        is 0 and not doubted. A count that belongs to another prompt of its request (vLLM
        counts a request's last prompt) says nothing of it."""
        counters = self.cache_seen
        if counters is not None and counters.uncounted:
            # served: the batch's every request, or, with fillers beside it, one of its
            # prompts, which the counters do not say
            return None if self.fillers else True
        if counters is not None and counters.verdict == CACHE_NEITHER:
            return False
        if count is not None and count > 0:
            return True
        return False if count == 0 and not self.counts_doubted else None

    def unclear(self, count: Optional[int]) -> bool:
        """Is whether the cache served a completion's request not known even under the
        bypass? So where its count is doubted, or belongs to another prompt of a request the
        cache served (the bypass did not hold there)."""
        counters = self.cache_seen
        return self.served(count) is None and (
            self.counts_doubted or (self.cached_tokens or 0) > 0
            or (counters is not None and counters.uncounted))

    @property
    def served_tokens(self) -> Optional[int]:
        """The prompt tokens the cache served the batch, by its answers' counts and the
        server's counters together: the counters' figure where they saw more served than the
        answers counted, 0 where they saw none (None: neither says, or only a doubted 0)."""
        seen = self.cache_seen
        if seen is not None and seen.uncounted:
            return seen.served
        if seen is not None and seen.verdict == CACHE_NEITHER:
            return 0
        if self.counts_doubted and not self.cached_tokens:
            return None
        return self.cached_tokens

    def computed(self, count: Optional[int], isolate: bool) -> bool:
        """Was a completion's request (of that cached-token count) computed, not served from
        the prefix cache, as a check trusts it: known cold, or, with no word either way, sent
        under the bypass (a fresh cache key each), as the sweep's own comparison trusts it. A
        run the cache served compares the cache, not what the check varied."""
        served = self.served(count)
        return not served if served is not None else isolate and not self.unclear(count)

    def cold(self, isolate: bool) -> bool:
        """Was its first completion's request computed (SentBatch.computed)?"""
        return self.computed(self.cached[0] if self.cached else self.cached_tokens, isolate)

    def evidence(self, deltas: List[Delta], baseline: Completion) -> List[Evidence]:
        n = len(self.completions)
        cached = self.cached or [self.cached_tokens] * n
        beside = self.beside or [n - 1] * n  # one request: its prompts are together
        return [Evidence(d, c.text != baseline.text, len(c.tokens), self.served(k), b,
                         self.unclear(k))
                for c, d, k, b in zip(self.completions, deltas, cached, beside)]


@dataclass
class Sender:
    """How a sweep sends one batch size in each traffic shape, to one server."""

    client: HttpClient
    adapter: EngineAdapter
    model: str
    sampling: Sampling
    isolate: bool  # bypass the prefix cache
    arrivals: Arrivals = Arrivals()  # when concurrent requests go out
    # the server's prefix-cache counters, read around every batch (None: it exposes none)
    watch: Optional[CounterWatch] = None
    cache_off: bool = False  # the server's settings say its prefix cache is off

    def shape(self, traffic: str) -> Callable[[str, int, int], SentBatch]:
        """The sender of a traffic shape (TRAFFIC_SHAPES; what each measures: --mode help)."""
        return {"copies": self.copies, "concurrent": self.concurrent, "mixed": self.mixed}[traffic]

    def send(self, traffic: str, prompt: str, n: int, seed: int) -> SentBatch:
        """Batch size n in a traffic shape, watched (Sender.watched)."""
        return self.watched(lambda: self.shape(traffic)(prompt, n, seed))

    def watched(self, send: Callable[[], SentBatch]) -> SentBatch:
        """What send() brought back, with what the server showed of its prefix cache around
        it (SentBatch.cache_seen): its counters read before and after where it exposes them,
        or its cache switched off. Every batch the sweep and its checks compare is sent so."""
        watch = self.watch
        before = watch.before() if watch is not None else None
        batch = send()
        if self.cache_off:
            batch.cache_seen = CacheEvidence(CACHE_NEITHER, 0, batch.cached_tokens,
                                             "the server's settings say its prefix cache is off")
            return batch
        if watch is None:
            return batch
        batch.cache_seen = watch.after(before, batch.prompt_tokens, batch.cached_tokens)
        batch.counts_doubted = watch.uncounted_seen and (
            batch.cache_seen is None or batch.cache_seen.verdict == CACHE_EVIDENCE_UNKNOWN)
        return batch

    @property
    def executor(self) -> Executor:
        """What sends its requests, to its server, under its cache policy."""
        return Executor(self.client, self.adapter, self.model, self.isolate)

    def one_request(self, prompts: List[str], cache_key: Optional[str] = None,
                    sampling: Optional[Sampling] = None, what: str = "the request",
                    beside: Optional[Callable[[], Request]] = None,
                    streams: int = 0) -> SentBatch:
        """One request of the prompts (sampling: the sweep's unless given), alone or with
        streams clients sending beside()'s requests meanwhile (send_requests); its prompt
        tokens count theirs too, as the server's counters do."""
        if cache_key is None and self.isolate:
            cache_key = fresh_cache_key()  # kept: a repeat under it is served from the cache
        request = Request(tuple(prompts), sampling or self.sampling, cache_key)
        sent = send_requests(self.executor, [request], what, beside=beside, streams=streams)
        answer = sent.answers[0]
        return SentBatch(answer.completions, sent.seconds, answer.cached_tokens, answer.cached,
                         cache_key=cache_key, background=sent.background,
                         prompt_tokens=total_count([answer.prompt_tokens,
                                                    sent.background_tokens]))

    def copies(self, prompt: str, n: int, seed: int, cache_key: Optional[str] = None) -> SentBatch:
        """n copies of the prompt in one request (cache_key: see EngineAdapter.body), each with
        its own cached-token count where the server gives one a prompt (SGLang), else the
        request's (the copies are one text)."""
        return self.one_request([prompt] * n, cache_key)

    def mixed(self, prompt: str, n: int, seed: int) -> SentBatch:
        """The prompt once among n-1 fillers in one request; only its own completion counts."""
        prompts, position = mixed_batch(prompt, n, seed)
        batch = self.one_request(prompts)
        return dataclasses.replace(batch, completions=[batch.completions[position]],
                                   cached=[batch.cached[position]], beside=[n - 1],
                                   fillers=n - 1)

    def concurrent(self, prompt: str, n: int, seed: int) -> SentBatch:
        """n one-prompt requests in flight at once, as independent clients send them: all at
        once (a burst), or one by one on the --request-rate schedule, so that the batch shows
        which requests were at the server together (SentBatch.beside, in_flight); see
        send_requests. Each request keeps its own cached-token count."""
        if n == 1:
            return self.copies(prompt, 1, seed)
        requests = [Request((prompt,), self.sampling, at=at)
                    for at in self.arrivals.schedule(n, seed + n)]
        sent = send_requests(self.executor, requests, "concurrent requests",
                             arrivals=self.arrivals)
        answers = sent.answers
        cached = [answer.cached_tokens for answer in answers]
        counted = [c for c in cached if c is not None]
        batch = SentBatch([answer.completions[0] for answer in answers], sent.seconds,
                          sum(counted) if counted else None, cached,
                          send_spread=round(answers[-1].sent - answers[0].sent, 6),
                          prompt_tokens=total_count([a.prompt_tokens for a in answers]))
        if self.arrivals.rate:  # which requests were at the server together?
            batch.in_flight = sent.in_flight
            batch.beside = [answer.beside for answer in answers]
            batch.overlapped = sent.in_flight > 1
        return batch


@dataclass(frozen=True)
class BatchRow:
    """One pass of one batch size against the baseline: what its completions showed, what the
    server said of them, and the checks' parts."""

    completions: int
    distinct_in_batch: int  # distinct texts
    same_as_baseline: int  # completions whose tokens and text are the baseline's
    text_only: int  # completions whose tokens held but whose text differs
    first_token_divergence: Optional[int]  # the earliest step any completion chose otherwise
    divergence_margin: Optional[Margin]  # how near a tie that step was
    first_ulp_step: Optional[int]  # the earliest step whose logprobs moved
    max_ulp: int
    ulp_notes: List[str]
    matched: bool  # every completion equals the baseline bitwise
    distinct_texts: List[str]
    # the largest logprob drift in nats, and the share of batch 1's steps whose top two lay
    # within it (flip_risk); saved after the ULP fields' row kin
    max_nats: float = 0.0
    flip_risk: Optional[float] = None
    pass_no: int = field(default=0, metadata=saved("pass"))  # which pass through the ladder
    seconds: float = 0.0  # from the first send to the last answer
    cached_tokens: Optional[int] = None  # prompt tokens served from the prefix cache
    # completions whose request the cache served, where any was: they compare nothing
    served: Optional[int] = field(default=None, metadata=saved(omit_none=True))
    # concurrent traffic: SEND_SPREAD_MEANS
    send_spread_s: Optional[float] = field(default=None, metadata=saved(omit_none=True))
    # scheduled concurrent traffic: were any two requests in flight together? A pass whose
    # requests never overlapped formed no batch: it compares nothing (SentBatch.overlapped)
    overlapped: Optional[bool] = field(default=None, metadata=saved(omit_none=True))
    # scheduled concurrent traffic: the most of its requests at the server at once
    in_flight: Optional[int] = field(default=None, metadata=saved(omit_none=True))
    # what the server showed of its prefix cache around the pass (its counters, or its cache
    # switched off), against its answers' counts
    cache_seen: Optional[CacheEvidence] = field(default=None, metadata=saved(omit_none=True))
    # each check's part of this pass (SweepCheck.batch_part), saved as the part says
    checks: Dict[str, Any] = field(default_factory=dict, metadata=saved(parts=True))
    # what each completion showed, for the verdict (Evidence)
    evidence: List[Evidence] = field(default_factory=list, metadata=NOT_SAVED)

    @property
    def tokens(self) -> int:
        return sum(e.tokens for e in self.evidence)


def compare_batch(batch: SentBatch, baseline: Completion, clamps: Sequence[float]) -> BatchRow:
    """What one batch's completions show against the baseline, each with its evidence (the
    row's other fields are the sender's and the checks' to fill in)."""
    completions = batch.completions
    deltas, previous, last = [], None, IDENTICAL
    for c in completions:
        # Copies of one completion are common; compare each distinct one once.
        if previous is None or not same_completion(c, previous):
            last = compare_completions(baseline, c, clamps)
            previous = c
        deltas.append(last)
    diverged = [d for d in deltas if d.first_token_divergence is not None]
    first = min(diverged, key=lambda d: d.first_token_divergence) if diverged else None
    ulp_steps = [d.first_ulp_step for d in deltas if d.first_ulp_step is not None]
    texts = [c.text for c in completions]
    held = [c.text == baseline.text for c, d in zip(completions, deltas)
            if d.first_token_divergence is None]
    identical = all(d is IDENTICAL or d == IDENTICAL for d in deltas)
    evidence = batch.evidence(deltas, baseline)
    served = sum(1 for e in evidence if e.served)
    return BatchRow(
        completions=len(completions), distinct_in_batch=len(set(texts)),
        same_as_baseline=sum(held), text_only=held.count(False),
        first_token_divergence=first.first_token_divergence if first else None,
        divergence_margin=first.margin if first else None,
        first_ulp_step=min(ulp_steps) if ulp_steps else None,
        max_ulp=max(d.max_ulp for d in deltas),
        ulp_notes=sorted({u for d in deltas for u in d.ulp_notes}),
        matched=sum(held) == len(completions) and identical, distinct_texts=sorted(set(texts)),
        max_nats=max(d.max_nats for d in deltas),
        flip_risk=flip_risk(baseline, max(d.max_nats for d in deltas)),
        seconds=round(batch.seconds, 4), cached_tokens=batch.cached_tokens,
        served=served or None, send_spread_s=batch.send_spread, overlapped=batch.overlapped,
        in_flight=batch.in_flight, cache_seen=batch.cache_seen, evidence=evidence)


@dataclass(frozen=True)
class SizeResult:
    """One batch size over every pass so far, in the fields a single pass has (and how many
    passes matched the baseline bitwise): what the table prints and the plots read."""

    batch_size: int
    bucket: Bucket
    completions: int
    distinct_in_batch: int  # distinct texts over every pass
    same_as_baseline: int
    text_only: int
    first_token_divergence: Optional[int]
    divergence_margin: Optional[Margin]
    first_ulp_step: Optional[int]
    max_ulp: int
    ulp_notes: List[str]
    max_nats: float  # the largest drift of any pass, in nats
    flip_risk: Optional[float]  # the largest share of batch 1's steps within a pass's drift
    seconds: float
    runs_matched: int
    cached_tokens: Optional[int]  # over every pass, where the server says
    # each check's record over the size's passes (SweepCheck.summary_part, sizes None)
    checks: Dict[str, Any] = field(metadata=saved(parts=True))
    distinct_texts: List[str]
    runs: List[BatchRow]
    # scheduled concurrent traffic: False when no pass's requests were ever in flight together
    overlapped: Optional[bool] = field(default=None, metadata=saved(omit_none=True))
    in_flight: Optional[int] = field(default=None, metadata=saved(omit_none=True))

    @classmethod
    def of(cls, batch_size: int, bucket: Bucket, runs: List[BatchRow],
           checks: Sequence["SweepCheck"]) -> "SizeResult":
        texts = sorted({t for r in runs for t in r.distinct_texts})
        diverged = [r for r in runs if r.first_token_divergence is not None]
        first = min(diverged, key=lambda r: r.first_token_divergence) if diverged else None
        ulp_steps = [r.first_ulp_step for r in runs if r.first_ulp_step is not None]
        cached = [r.cached_tokens for r in runs if r.cached_tokens is not None]
        # scheduled passes: True where any overlapped, False where none did
        scheduled = [r.overlapped for r in runs if r.overlapped is not None]
        reached = [r.in_flight for r in runs if r.in_flight is not None]
        parts = {}
        for check in checks:
            part = check.summary_part([r.checks[check.NAME] for r in runs
                                       if check.NAME in r.checks], None)
            if part is not None:
                parts[check.NAME] = part
        return cls(batch_size=batch_size, bucket=bucket,
                   completions=sum(r.completions for r in runs), distinct_in_batch=len(texts),
                   same_as_baseline=sum(r.same_as_baseline for r in runs),
                   text_only=sum(r.text_only for r in runs),
                   first_token_divergence=first.first_token_divergence if first else None,
                   divergence_margin=first.divergence_margin if first else None,
                   first_ulp_step=min(ulp_steps) if ulp_steps else None,
                   max_ulp=max((r.max_ulp for r in runs), default=0),
                   ulp_notes=sorted({u for r in runs for u in r.ulp_notes}),
                   max_nats=max((r.max_nats for r in runs), default=0.0),
                   flip_risk=max((r.flip_risk for r in runs if r.flip_risk is not None),
                                 default=None),
                   seconds=round(sum(r.seconds for r in runs), 4),
                   runs_matched=sum(1 for r in runs if r.matched),
                   cached_tokens=sum(cached) if cached else None, checks=parts,
                   distinct_texts=texts, runs=runs,
                   overlapped=any(scheduled) if scheduled else None,
                   in_flight=max(reached) if reached else None)

    @property
    def served(self) -> int:
        """Completions whose request the cache served, over every pass."""
        return sum(r.served or 0 for r in self.runs)


@dataclass(frozen=True)
class PromptRecord:
    """One prompt's sweep as saved: its baseline, each batch size, and its own verdict."""

    prompt: str
    baseline: Optional[Completion]
    baseline_source: str
    sizes: List[SizeResult]
    unique_completions: int
    total_completions: int
    max_ulp: int
    batch1_repeatable: Optional[bool]
    verdict: str


@dataclass(frozen=True)
class FirstMoved:
    """Where the evidence the verdict reads first moved: the smallest batch size, the kind of
    move (tokens, text, top-k or logprobs) and its step."""

    batch: int
    what: str
    step: Optional[int]

    def text(self) -> str:
        step = "" if self.step is None else ", step %d" % self.step
        return "%s at batch %d%s" % (self.what, self.batch, step)


@dataclass(frozen=True)
class SweepSummary:
    """A whole sweep: what it measured, its verdict (decided by verdict() alone) and how far
    it got, with each check's summary where it ran."""

    unique_completions: int
    total_completions: int
    max_ulp: int
    max_nats: float  # the largest drift in nats, beside the ULPs
    flip_risk: Optional[float]  # the largest share of batch 1's steps within a drift measured
    batch1_repeatable: Optional[bool]
    traffic: str
    repeat: int
    verdict: str
    first_moved: Optional[FirstMoved]  # what the verdict read first moved (None: nothing did)
    # batch sizes where the cache served a request, which compares nothing: the verdict holds
    # only where the requests were computed
    served_sizes: List[int] = field(metadata=saved(omit_none=True))
    ulp_notes: List[str]
    state: str  # "complete", "running", or what stopped it
    checks: Dict[str, Any] = field(metadata=saved(parts=True))  # SweepCheck.summary_part
    measured: Measured = field(metadata=NOT_SAVED)
    # each check's summary: did it hold (what its --expect would read)? None: no check ran
    checks_held: Optional[Dict[str, bool]] = field(default=None, metadata=saved(omit_none=True))
    # what --expect came to, once the sweep is complete (None: none was asked)
    expect: Optional["ExpectResult"] = field(default=None, metadata=saved(omit_none=True))


@dataclass(frozen=True)
class ExpectResult:
    """--expect, as decided (expectation) and saved: what the experiment and the readers of a
    saved sweep read, never working it out again from the exit code."""

    asked: str  # the --expect value
    held: bool
    said: str  # the line printed


@dataclass
class PromptSweep:
    """Everything measured for one prompt so far: per batch size, one row per pass."""

    prompt: str
    baseline: Optional[Completion] = None
    baseline_source: str = "batch 1"
    runs: Dict[int, List[BatchRow]] = field(default_factory=dict)  # batch size -> its passes
    buckets: Dict[int, Bucket] = field(default_factory=dict)
    stored_served: bool = False  # the cache served the stored baseline: nothing is compared
    batch1: List[Completion] = field(default_factory=list)  # batch 1's completion in every pass
    batch1_rows: List[int] = field(default_factory=list)  # each one's row in runs[1]
    unseeded: bool = False  # sampled at temperature > 0 by a server that ignores the seed
    sampled: bool = False  # sampled at temperature > 0: batch 1's control checks the seed
    # --prefix-cache keep: a request whose cache state is not known may have been served
    cache_kept: bool = False
    checks: Sequence["SweepCheck"] = ()  # the sweep's checks, for each size's parts
    finished: bool = False  # every pass is in: nothing it holds changes any more
    # What a finished prompt's saves and summaries would work out again and again (a sweep
    # of 1000 prompts saves many times): kept once the prompt is finished
    kept_measured: Optional[Measured] = field(default=None, compare=False, repr=False)
    kept_text: Optional[str] = field(default=None, compare=False, repr=False)
    doubted: bool = False  # its passes' zero counts were doubted after the fact (doubt)

    def set_baseline(self, baseline: Completion, source: str, served: bool = False) -> None:
        """served: a stored baseline the prefix cache served (--baseline's server said so)."""
        self.baseline, self.baseline_source = baseline, source
        self.stored_served = served

    def add(self, n: int, bucket: Bucket, row: BatchRow, completions: List[Completion]) -> None:
        self.runs.setdefault(n, []).append(row)
        self.buckets[n] = bucket
        # batch 1's run-to-run control: only a computed batch 1 repeats the computation (one
        # the cache served repeats the cache)
        if n == 1 and row.evidence and row.evidence[0].cold(self.cache_kept):
            self.batch1.append(completions[0])
            self.batch1_rows.append(len(self.runs[1]) - 1)

    def doubt(self) -> None:
        """The server's counters have since shown it serving what its answers did not count:
        a pass whose counters could not say, judged cold by its answers' count of 0 or by the
        bypass where they gave none, is no longer known to be cold (SentBatch.counts_doubted,
        after the fact), nor its batch 1 a run of the control."""
        doubted = set()
        for n, rows in self.runs.items():
            for i, row in enumerate(rows):
                seen = row.cache_seen
                if seen is None or seen.verdict != CACHE_EVIDENCE_UNKNOWN:
                    continue
                evidence = [e if e.served else dataclasses.replace(e, served=None, unclear=True)
                            for e in row.evidence]
                if evidence != row.evidence:
                    rows[i] = dataclasses.replace(row, evidence=evidence)
                    doubted.update([i] if n == 1 else [])
        self.doubted = True
        kept = [(c, i) for c, i in zip(self.batch1, self.batch1_rows) if i not in doubted]
        self.batch1, self.batch1_rows = [c for c, _ in kept], [i for _, i in kept]
        self.kept_measured = self.kept_text = None

    def finish(self) -> None:
        """Every pass is in: what it measured is kept."""
        self.finished = True
        self.measured()

    def size(self, n: int) -> SizeResult:
        """Batch size n over every pass so far."""
        return SizeResult.of(n, self.buckets[n], self.runs[n], self.checks)

    def sizes(self) -> List[SizeResult]:
        return [self.size(n) for n in self.runs]

    def rows(self) -> List[Tuple[int, BatchRow]]:
        """(batch size, row) of every pass."""
        return [(n, r) for n, runs in self.runs.items() for r in runs]

    def batch1_repeatable(self) -> Optional[bool]:
        """Batch 1's passes against each other: None until there are two, or when a NaN
        leaves nothing to compare (NaN against NaN is no evidence either way)."""
        if len(self.batch1) < 2 or any(map(has_nan, self.batch1)):
            return None
        return all(same_completion(c, self.batch1[0]) and c.text == self.batch1[0].text
                   for c in self.batch1[1:])

    def measured(self) -> Measured:
        """What the verdict reads, request by request: a completion counts for batching only
        where it was computed (not served from the cache) beside other requests of its batch;
        a stored baseline makes batch 1 a comparison too."""
        if self.kept_measured is not None:
            return self.kept_measured
        # A pass whose scheduled requests were never in flight together formed no batch:
        # it compares nothing, and is left out (its row says so)
        included = [(n, r) for n, r in self.rows() if r.overlapped is not False]
        rows = [r for _, r in included]
        texts = {t for r in rows for t in r.distinct_texts}
        if self.baseline is not None:
            texts.add(self.baseline.text)
        other = self.baseline_source != "batch 1"  # a stored baseline: batch 1 is compared too
        candidates = [(n, e) for n, r in included if n > 1 or other for e in r.evidence
                      if e.tokens and (n == 1 or e.beside != 0)]
        # batch 1 as the baseline, or a stored one: one the cache served (or may have) makes
        # every comparison one with the cache, not with a computed batch 1
        baseline_row = self.runs.get(1, [None])[0] if not other else None
        baseline_cold = (baseline_row.evidence[0].cold(self.cache_kept)
                         if baseline_row is not None and baseline_row.evidence
                         else not (other and self.stored_served))
        unknown = [(n, e) for n, e in candidates if e.cold(self.cache_kept) is None]
        computed = [(n, e) for n, e in candidates if e.cold(self.cache_kept)]
        served = [(n, e) for n, e in candidates if e.served]
        if not baseline_cold:
            computed = []
            if baseline_cold is None:
                unknown += [(1, e) for e in baseline_row.evidence[:1]]
        moved = [(n, e) for n, e in computed if e.moved]
        first = None
        if moved:
            n, e = min(moved, key=lambda m: (m[0], m[1].delta.first_ulp_step or 0))
            step = e.delta.first_token_divergence
            step = e.delta.first_ulp_step if step is None else step
            first = FirstMoved(n, e.what_moved(), step)
        measured = Measured(
            total=sum(r.completions for r in rows),
            unique=len(texts) if rows else 0,  # no count of completions where none came back
            max_ulp=max((r.max_ulp for r in rows), default=0),
            tokens_diverged=any(e.delta.first_token_divergence is not None for _, e in computed),
            text_only=any(e.text_moved and e.delta.first_token_divergence is None
                          for _, e in computed),
            moved=bool(moved), compared=bool(computed),
            batch1_repeatable=self.batch1_repeatable(), unseeded=self.unseeded,
            uncontrolled=self.sampled and self.batch1_repeatable() is None,
            served_moved=any(e.moved for _, e in served),
            served_sizes=sorted({n for n, _ in served}),
            alone_sizes=sorted({n for n, r in included if n > 1
                                and any(e.beside == 0 for e in r.evidence)}),
            unknown_sizes=sorted({n for n, _ in unknown}),
            unoverlapped=len(included) < len(self.rows()), first_moved=first,
            baseline_served=baseline_cold is False, cache_kept=self.cache_kept)
        if self.finished:
            self.kept_measured = measured
        return measured

    def record(self) -> PromptRecord:
        measured = self.measured()
        return PromptRecord(prompt=self.prompt, baseline=self.baseline,
                            baseline_source=self.baseline_source, sizes=self.sizes(),
                            unique_completions=measured.unique, total_completions=measured.total,
                            max_ulp=measured.max_ulp, batch1_repeatable=measured.batch1_repeatable,
                            verdict=verdict(measured))

    def record_text(self) -> str:
        """The prompt's record as saved JSON, kept once the prompt is finished."""
        if self.kept_text is not None:
            return self.kept_text
        text = json_text(as_record(self.record()))
        if self.finished:
            self.kept_text = text
        return text


@dataclass
class SweepRun:
    """What a sweep's checks may use once the server under test is known."""

    cfg: Config
    facts: ServerFacts
    sender: Sender  # to the server under test
    out: Out


def samples_unseeded(sampling: Sampling, facts: ServerFacts) -> bool:
    """Sampling that the server does not seed: its differences may be plain sampling noise."""
    return sampling.temperature > 0 and facts.seed_honoured is False


# The rules no check's verdict may break, kept here and nowhere else: every check's verdict
# is worded by check_verdict from what it found (CheckFinding), and tests/test_check_rules.py
# runs every entry of SWEEP_CHECKS against the practice engine's faults to hold them to it
NOT_SERVED = "not measured: the server could not serve it (%s)"
CONTROL_MOVED = ("not put down to what was varied: the run-to-run control moved (the same "
                 "request alone, again, differed)")
SEED_NOT_HONOURED = ("not put down to what was varied: the server does not honour the seed, "
                     "so runs differ by sampling alone")


@dataclass(frozen=True)
class CheckFinding:
    """What a check found, in the terms the rules read."""

    parts: int  # parts it ran (lengths, settings, batches): none is no data
    compared: int  # of them, parts that compared anything
    held: str  # its verdict where every part compared and nothing moved
    moved: Optional[str] = None  # what moved where compared, in its words (None: nothing)
    # the compared parts' own held wording, where some parts compared nothing
    held_where_compared: Optional[str] = None
    uncompared: Sequence[str] = ()  # each part that compared nothing, saying why
    failure: Optional[str] = None  # why the server could not serve it, if it could not
    compares_runs: bool = False  # it compares one request's runs with each other
    control_moved: bool = False  # the run-to-run control (the same request alone, again) moved
    unseeded: bool = False  # sampled at temperature > 0 by a server that ignores the seed


def check_verdict(found: CheckFinding) -> str:
    """A check's verdict, by the rules: nothing claimed where nothing was compared (each part
    that compared nothing says so; with no part compared, "nothing compared"); a check that
    compares runs never blames what it varied where the seed is not honoured or its control
    moved; "held" only where every part compared."""
    if found.failure and not found.compared:
        return NOT_SERVED % found.failure
    if not found.parts:
        return NO_DATA
    if not found.compared:
        why = "; ".join(found.uncompared)
        return NOTHING_COMPARED + (": %s" % why if why else "")
    if found.compares_runs and found.unseeded and (found.moved or found.control_moved):
        return SEED_NOT_HONOURED
    if found.compares_runs and found.control_moved:
        return CONTROL_MOVED
    if found.moved:
        verdict = found.moved
    elif found.uncompared or found.failure:
        verdict = found.held_where_compared or found.held
    else:
        return found.held
    stopped = ["then stopped: the server could not serve it (%s)" % found.failure
               ] if found.failure else []
    return verdict + "".join("; %s" % part for part in list(found.uncompared) + stopped)


class SweepCheck:
    """One check a sweep runs beside its comparison of every batch with batch 1: its name and
    --expect values, its options (add_arguments, from_args, params), what the server's
    limits refuse before the first request (open), the requests it adds for a prompt and
    batch and what it reads of their answers (batch_part), and its summary record
    (summary_part). Each check is one section below, and one entry of SWEEP_CHECKS; the
    sweep names no check. Every member has a default that does nothing, so a check defines
    what it uses; its state while it runs is kept in the check, never in the options. The
    host writes the --expect line, the check's lines and the saved params from what these
    give (check_expectation; the summary record's lines), and every verdict is worded by
    check_verdict.

    Its records (a batch's part, a size's part, the summary's part) are saved where the core
    saves its parts, each as its own class's SAVED_AS says (saved(): under a name, or flat
    behind a prefix)."""

    NAME = ""  # the key its parts are kept under in rows, sizes and the summary
    # the --expect values it answers, each with what --help says of it; the host writes the
    # expect line from its summary record (check_expectation)
    EXPECT: Dict[str, str] = {}

    @classmethod
    def add_arguments(cls, group: argparse._ArgumentGroup) -> None:
        """Its options, under the sweep checks' heading of --help."""

    @classmethod
    def from_args(cls, args: argparse.Namespace, asked: "SweepAsked") -> "SweepCheck":
        """Its options, checked before any request (UsageError on a bad one)."""
        return cls()

    def params(self) -> Json:
        """What the saved params hold of it."""
        return {}

    def open(self, run: SweepRun) -> List[str]:
        """Once the server is known, before the first generation request: refuse
        (UsageError) what the server's stated limits cannot serve; its lines in the header."""
        return []

    def batch_part(self, run: SweepRun, prompt: str, n: int, batch: SentBatch) -> Any:
        """Its record of one pass of one batch size (None: nothing)."""
        return None

    def summary_part(self, parts: List[Any], sizes: Optional[List[SizeResult]]) -> Any:
        """Its summary record over some passes, from their parts: of the whole sweep (sizes:
        every size so far), or of one batch size (sizes None; None: it keeps no such
        record). The record has its verdict (worded by check_verdict), whether it held, what
        it compared, its lines (lines(sizes)), and what the expect line says (WHAT,
        evidence)."""
        return None




@dataclass(frozen=True)
class SweepAsked:
    """What a check's options are checked against: the rest of what the sweep was asked."""

    url: str
    engine: Optional[str]
    model: Optional[str]
    sampling: Sampling
    prompts: List[str]  # [] where --prompt-tokens builds the prompt once the server is known
    traffic: str
    expect: Optional[str]


class SwitchedCheck(SweepCheck):
    """A check that one switch turns on (OPTION, a store_true option whose dest is the
    option's name), which its own --expect values need."""

    OPTION = ""  # e.g. "--cache-check"
    HELP = ""  # what --help says of it

    def __init__(self, asked: bool = False):
        self.asked = asked

    @classmethod
    def dest(cls) -> str:
        return cls.OPTION.lstrip("-").replace("-", "_")

    @classmethod
    def add_arguments(cls, group: argparse._ArgumentGroup) -> None:
        group.add_argument(cls.OPTION, action="store_true", help=cls.HELP)

    @classmethod
    def from_args(cls, args: argparse.Namespace, asked: SweepAsked) -> "SweepCheck":
        on = getattr(args, cls.dest())
        if asked.expect in cls.EXPECT and not on:
            raise UsageError("--expect %s needs %s" % (asked.expect, cls.OPTION))
        if on:
            cls.refuse(args, asked)
        return cls(on)

    @classmethod
    def refuse(cls, args: argparse.Namespace, asked: SweepAsked) -> None:
        """What it cannot run with, refused (UsageError) when it is asked for."""

    def params(self) -> Json:
        return {self.dest(): self.asked}


# ----------------------------------------------------------------------------
# Prefix-cache bypass (--prefix-cache): no sweep request served from another's cache

PREFIX_CACHE_CHOICES = ("bypass", "keep")  # bypass: no request served from an earlier's cache
DEFAULT_PREFIX_CACHE = "bypass"  # a cache hit would compare the cache, not the batch
BYPASS_HELD, BYPASS_FAILED, BYPASS_UNVERIFIED = "held", "did not hold", "unverified"


@dataclass(frozen=True)
class BypassCheck:
    """Did --prefix-cache bypass hold? Proven by the cached-token counts the server reports
    and by its own prefix-cache counters read around each pass: any count above 0, or any
    token the counters saw the cache serve, is a prefill served from the cache; a pass with
    neither counts nor counters that say proves nothing."""

    SAVED_AS: ClassVar[Dict[str, Any]] = saved("prefix_cache_bypass")

    status: str  # BYPASS_HELD, BYPASS_FAILED or BYPASS_UNVERIFIED
    hit_sizes: List[int]  # batch sizes with a cache hit

    @classmethod
    def of(cls, rows: Sequence[Tuple[int, BatchRow]]) -> "BypassCheck":
        """rows: (batch size, its row) of every pass."""
        # counters that saw other clients' traffic served say nothing of the pass's own
        hits = sorted({n for n, row in rows if (row.cached_tokens or 0) > 0
                       or (row.cache_seen is not None and row.cache_seen.uncounted)})
        known = [row for _, row in rows if row.cached_tokens is not None
                 or (row.cache_seen is not None
                     and row.cache_seen.verdict != CACHE_EVIDENCE_UNKNOWN)]
        if not known:
            return cls(BYPASS_UNVERIFIED, hits)
        return cls(BYPASS_FAILED if hits else BYPASS_HELD, hits)


class CachePolicy:
    """--prefix-cache, the sweep's cache policy (SweepOptions.cache, used by the core by
    name): bypass (the default) gives every request a cache key of its own, and empties the
    cache before every batch where the engine has no such key, so that no prefill is served
    from an earlier request's cache; whether that held, the cached-token counts the server
    reports say (BypassCheck), and a bypass that did not hold makes the requests the cache
    served compare nothing (PromptSweep.measured), named in the summary. keep leaves the
    cache alone; a request the cache served compares nothing either way."""

    NAME = "prefix_cache"  # the key of its proof among the summary's parts

    def __init__(self, choice: str = DEFAULT_PREFIX_CACHE):
        self.choice = choice  # one of PREFIX_CACHE_CHOICES
        self.hint = ""  # how the engine reports cached tokens, once the server is known
        # the server's prefix-cache counters (None: it exposes none, or its cache is off):
        # read around each batch too, a second source beside the answers' counts
        self.watch: Optional[CounterWatch] = None
        self.off = False  # the server's settings say its prefix cache is off

    @classmethod
    def add_arguments(cls, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--prefix-cache", choices=PREFIX_CACHE_CHOICES, default=DEFAULT_PREFIX_CACHE,
            help="bypass: no request may be served from an earlier one's prefix cache; keep: "
            "leave the cache alone and save the cached-token counts (default %s)"
            % DEFAULT_PREFIX_CACHE)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "CachePolicy":
        return cls(args.prefix_cache)

    @property
    def bypass(self) -> bool:
        return self.choice == "bypass"

    def open(self, adapter: EngineAdapter, client: HttpClient, facts: ServerFacts) -> None:
        self.hint = adapter.CACHE_COUNTS_HINT
        self.off = adapter.prefix_cache_off(facts.settings)
        start = None if self.off else adapter.prefix_cache_counters(client)
        self.watch = None if start is None else CounterWatch(adapter, client, start)

    def header_lines(self) -> List[str]:
        if self.off:
            return ["        prefix cache off (the server's settings): no request can be "
                    "served from it"]
        if self.watch is None:
            return []
        return ["        prefix-cache counters read around each batch (%s)"
                % self.watch.start.source]

    def params(self) -> Json:
        return {"prefix_cache": self.choice}

    def size_notes(self, size: SizeResult) -> List[str]:
        """Where a size's requests hit the cache (despite the bypass, or as kept), and where
        the server's counters saw it serve more than the answers counted."""
        notes = []
        if (size.cached_tokens or 0) > 0:
            notes.append("cache hit%s (%s cached tokens)"
                         % (": bypass did not hold" if self.bypass else "", size.cached_tokens))
        uncounted = [r.cache_seen for r in size.runs
                     if r.cache_seen is not None and r.cache_seen.uncounted]
        if uncounted:
            notes.append(CacheEvidence(CACHE_SERVED_NOT_COUNTED,
                                       sum(e.served for e in uncounted),
                                       sum(e.counted or 0 for e in uncounted), "").note())
        if notes:
            # requests whose own state the server did not say (a count of another prompt of
            # theirs, or none under keep) compare nothing either
            unknown = sum(1 for r in size.runs for e in r.evidence
                          if e.cold(not self.bypass) is None)
            notes[-1] += (" (%d of %d requests served%s, not compared)"
                          % (size.served, size.completions,
                             ", %d not known to be cold" % unknown if unknown else ""))
        return notes

    def proof(self, sizes: List[SizeResult]) -> Optional[BypassCheck]:
        """The bypass's proof over every pass so far (None when the cache was kept)."""
        if not self.bypass:
            return None
        return BypassCheck.of([(s.batch_size, r) for s in sizes for r in s.runs])

    def summary_reasons(self, summary: SweepSummary) -> List[str]:
        check = summary.checks.get(self.NAME)
        if check is None or check.status != BYPASS_FAILED:
            return []
        sizes = check.hit_sizes
        return ["cache hit: bypass did not hold at batch size%s %s" % (
            "" if len(sizes) == 1 else "s", ",".join(map(str, sizes)))]

    def summary_notes(self, summary: SweepSummary, sizes: List[SizeResult]) -> List[str]:
        """What the summary holds only so far as the cache's evidence goes: a bypass nothing
        proved, counters that could not say of some batches, counters no longer read."""
        notes = []
        check = summary.checks.get(self.NAME)
        if check is not None and check.status == BYPASS_UNVERIFIED:
            notes.append("prefix cache bypass unverified: the server reports no cached-token "
                         "counts (%s)%s" % (self.hint, "" if self.watch is None else
                                            ", and its prefix-cache counters could not say"))
        if self.watch is None:
            return notes
        runs = [r for size in sizes for r in size.runs]
        unknown = [r.cache_seen for r in runs
                   if r.cache_seen is not None and r.cache_seen.verdict == CACHE_EVIDENCE_UNKNOWN]
        if unknown:
            notes.append("prefix-cache counters could not say of %d of %d passes (%s): there "
                         "the answers' counts alone say what the cache served"
                         % (len(unknown), len(runs), unknown[0].why))
        if self.watch.stopped:
            notes.append("prefix-cache counters read no more once %s: %d of %d passes rest on "
                         "the answers' counts alone" % (self.watch.stopped,
                                                        sum(r.cache_seen is None for r in runs),
                                                        len(runs)))
        return notes


# ----------------------------------------------------------------------------
# Cache check (--cache-check): a cache hit against the cold prefill

CACHE_EQUAL = "cache hit equals cold prefill bitwise"  # the cache check's verdicts, kept apart
CACHE_DIFFER = "cache hit differs from cold prefill"
CACHE_UNVERIFIED = "equal, but the hit is unverified (the server reports no cached-token counts)"
CACHE_MISSED = "nothing compared: the repeat was not served from the cache (cached-token count 0)"
CACHE_COLD_HIT = "nothing compared: every cold request was itself served from the cache"


@dataclass(frozen=True)
class CacheComparison:
    """One batch sent cold, then at once again with the same cache key: served from the
    prefix cache, it must equal the cold answer bit for bit."""

    SAVED_AS: ClassVar[Dict[str, Any]] = saved("cache_check")

    max_ulp: int
    first_step: Optional[int]  # first step whose token or logprob differs
    tokens_diverged: bool
    notes: Tuple[str, ...]
    margin: Optional[Margin]  # at the first token divergence
    # of the repeat, the prompt tokens the cache served: as its answers count them, or as the
    # server's counters saw them served where those saw more (SentBatch.served_tokens)
    cached_tokens: Optional[int]
    cold_cached_tokens: Optional[int]  # the same, of the cold request

    @classmethod
    def of(cls, cold: SentBatch, warm: SentBatch, clamps: Sequence[float]) -> "CacheComparison":
        pairs = list(zip(cold.completions, warm.completions))
        deltas = [compare_completions(c, w, clamps) for c, w in pairs]
        steps = [s for d in deltas for s in (d.first_token_divergence, d.first_ulp_step)
                 if s is not None]
        diverged = [d for d in deltas if d.first_token_divergence is not None]
        first = min(diverged, key=lambda d: d.first_token_divergence) if diverged else None
        notes = {u for d in deltas for u in d.ulp_notes}
        if any(c.text != w.text for c, w in pairs):
            notes.add("text differs")
        return cls(max((d.max_ulp for d in deltas), default=0),
                   min(steps) if steps else None, bool(diverged), tuple(sorted(notes)),
                   first.margin if first else None, warm.served_tokens, cold.served_tokens)


@dataclass(frozen=True)
class CacheSummary:
    """The cache check over every batch: its verdict, proven by the repeats' cached-token
    counts (saved flat in the sweep's summary, each field behind "cache_")."""

    SAVED_AS: ClassVar[Dict[str, Any]] = saved(flat="cache_")
    COMPARES_RUNS: ClassVar[bool] = True  # one request's runs, compared with each other

    verdict: str
    batches: int
    max_ulp: Optional[int]
    first_step: Optional[int]
    # batches whose cold request the cache did not serve and whose repeat it did: the only
    # ones that compare a cache hit with a cold prefill (copies of one vLLM request share the
    # cache, so a cold batch of several copies is partly served from it)
    verified: int = field(default=0, metadata=NOT_SAVED)

    @classmethod
    def of(cls, checked: Sequence[CacheComparison], unseeded: bool = False,
           control_moved: bool = False, failure: Optional[str] = None) -> "CacheSummary":
        """unseeded: sampled at temperature > 0 by a server that ignores the seed;
        control_moved: the run-to-run control (batch 1's passes, each cold) moved; failure:
        why the server could not serve it, if it could not."""
        verified = [c for c in checked if c.cold_cached_tokens == 0 and (c.cached_tokens or 0) > 0]
        # a batch compares a hit with a cold prefill unless its counts show it did not: its
        # repeat not served (0), or its cold request served; without counts it is unverified
        missed = [c for c in checked if c.cached_tokens == 0]
        cold_hit = [c for c in checked if c.cached_tokens != 0 and (c.cold_cached_tokens or 0) > 0]
        compared = [c for c in checked if c not in missed and c not in cold_hit]

        def part(found: Sequence[CacheComparison], why: str, each: str) -> List[str]:
            if not found:
                return []
            if len(found) == len(checked):
                return [why]
            return ["%d of %d batches compared nothing (%s)" % (len(found), len(checked), each)]

        verdict = check_verdict(CheckFinding(
            parts=len(checked), compared=len(compared),
            held=CACHE_EQUAL if len(verified) == len(compared) else CACHE_UNVERIFIED,
            moved=CACHE_DIFFER if any(c.max_ulp or c.tokens_diverged or c.notes
                                      for c in compared) else None,
            uncompared=part(missed, "the repeat was not served from the cache (cached-token "
                            "count 0)", "their repeat was not served from the cache")
            + part(cold_hit, "every cold request was itself served from the cache",
                   "their cold request was itself served from the cache"),
            failure=failure, compares_runs=True, control_moved=control_moved,
            unseeded=unseeded))
        steps = [c.first_step for c in checked if c.first_step is not None]
        return cls(verdict, len(checked), max((c.max_ulp for c in checked), default=None),
                   min(steps) if steps else None, len(verified))

    @property
    def compared(self) -> int:
        return self.batches if not self.verdict.startswith(NOTHING_COMPARED) else 0

    @property
    def held(self) -> bool:
        """A verified hit equals its cold prefill, and none differs (batches whose counts show
        they compared no hit are named in the verdict, and asked nothing of)."""
        return self.verdict.split(";")[0] == CACHE_EQUAL and self.verified > 0

    WHAT: ClassVar[str] = "cache check"

    @property
    def evidence(self) -> str:
        return "max ULP 0 over %d batches with a cold request" % self.verified

    def lines(self, sizes: List["SizeResult"]) -> List[str]:
        """Its lines after the sweep's summary line (a Bold one states its verdict)."""
        part = self
        return [Bold("cache check, over %d batches each sent again from the cache (%d with a "
                     "cold request the cache did not serve): max ULP %s, first differing step "
                     "%s: %s" % (part.batches, part.verified, fmt_opt(part.max_ulp, "?"),
                                 fmt_opt(part.first_step), part.verdict))]


class CacheCheck(SwitchedCheck):
    """--cache-check: every batch is sent cold with a cache key of its own, then at once again
    with the same key, so that the prefix cache serves the repeat; the two must agree bit for
    bit (CacheComparison), and the repeat's cached-token count proves the hit. It needs copies
    traffic and the bypass: its cold request must be cold."""

    NAME = "cache_check"
    OPTION = "--cache-check"
    HELP = ("also send every batch again at once, with the cold request's cache key, so that "
            "the prefix cache serves it, and compare it with the cold one bitwise; the "
            "cached-token counts prove the hit (copies traffic, bypass)")
    EXPECT = {"cache-equal": "(with --cache-check) a verified cache hit equals the cold prefill "
              "bitwise"}

    def __init__(self, asked: bool = False):
        super().__init__(asked)
        self.unseeded = False  # its runs sampled by a server that ignores the seed
        self.failure: Optional[str] = None  # why the server could not serve it

    @classmethod
    def refuse(cls, args: argparse.Namespace, asked: SweepAsked) -> None:
        if asked.traffic != "copies" or args.prefix_cache != "bypass":
            raise UsageError("--cache-check goes with --traffic copies and --prefix-cache bypass "
                             "(its cold request must be cold)")

    def batch_part(self, run: SweepRun, prompt: str, n: int,
                   batch: SentBatch) -> Optional[CacheComparison]:
        """The same batch again under the cold one's key, against the cold one."""
        if not self.asked or self.failure is not None:
            return None
        self.unseeded = samples_unseeded(run.cfg.sampling, run.facts)
        try:
            sender = run.sender
            warm = sender.watched(lambda: sender.copies(prompt, n, run.cfg.sweep.seed,
                                                        batch.cache_key))
        except ServerError as err:
            if err.kind == ServerError.NETWORK:  # the server itself is gone: the sweep stops
                raise ServerError("cache check at batch size %d: %s" % (n, err)) from None
            self.failure = str(err)
            run.out.warn("the cache check stops at batch size %d, the sweep goes on: %s"
                         % (n, err))
            return None
        return CacheComparison.of(batch, warm, run.sender.adapter.logprob_clamps)

    def summary_part(self, parts: List[Any],
                     sizes: Optional[List[SizeResult]]) -> Optional[CacheSummary]:
        if not self.asked or sizes is None:
            return None
        # the run-to-run control: batch 1 sent cold again in each pass (the same request alone)
        control_moved = any(s.batch_size == 1 and s.runs_matched < len(s.runs) for s in sizes)
        return CacheSummary.of(parts, self.unseeded, control_moved, self.failure)




# ----------------------------------------------------------------------------
# Prefill check (--prefill-check): decode against prefill, with KL

PREFILL_AGREE = "decode and prefill agree bitwise"  # the prefill check's verdict, kept apart
PREFILL_DIFFER = "decode and prefill differ"


def margin_text(margin: Optional[Margin]) -> str:
    """A near-tie margin as the table shows it."""
    if not margin:
        return "-"
    if margin.note:
        return margin.note
    return "%s ULP" % fmt_opt(margin.ulp, "?")


@dataclass(frozen=True)
class PrefillRow:
    """The prefill check of one batch: each distinct completion's decoded logprobs against
    the ones the server computes prefilling the same tokens at once (saved flat in the
    batch's row, each field behind "prefill_")."""

    SAVED_AS: ClassVar[Dict[str, Any]] = saved(flat="prefill_")

    max_ulp: int
    first_step: Optional[int]  # the first generated step whose two logprobs differ
    notes: List[str]  # ULP notes of the comparison
    margin: Optional[Margin]  # the decode's runner-up at that step
    tokens: int  # generated tokens compared
    divergent: int  # of them, those whose two logprobs differ
    kl_sum: float  # K3 terms of the divergent tokens, summed (KlEstimate)
    kl_max: Optional[float]  # the largest of them; None with none divergent
    # completions not compared: the prefix cache served their request (or may have), and a
    # decode from the cache compares the cache, not decode with prefill (None: none)
    served: Optional[int] = field(default=None, metadata=saved(omit_none=True))


@dataclass(frozen=True)
class PrefillSummary:
    """The prefill check over many batches (a size's passes, or a whole sweep), and, for the
    whole sweep, its verdict: nothing is claimed where no token was compared (saved flat,
    behind "prefill_")."""

    SAVED_AS: ClassVar[Dict[str, Any]] = saved(flat="prefill_")
    KEY: ClassVar[str] = "prefill"  # PrefillCheck.NAME: where each size keeps its record

    checked: int = field(metadata=NOT_SAVED)  # batches the check ran on
    max_ulp: Optional[int]
    first_step: Optional[int]
    margin: Optional[Margin]  # at the first differing step
    tokens: int
    divergent: int
    kl_sum: float
    kl_mean: Optional[float]  # over the divergent tokens
    kl_max: Optional[float]
    notes: List[str]
    verdict: Optional[str] = field(default=None, metadata=saved(omit_none=True))  # a sweep's
    served: Optional[int] = field(default=None, metadata=saved(omit_none=True))  # PrefillRow's

    @classmethod
    def of(cls, rows: Sequence[PrefillRow]) -> "PrefillSummary":
        moved = [r for r in rows if r.first_step is not None]
        first = min(moved, key=lambda r: r.first_step) if moved else None
        largest = [r.kl_max for r in rows if r.kl_max is not None]
        divergent = sum(r.divergent for r in rows)
        kl_sum = sum(r.kl_sum for r in rows)
        return cls(checked=len(rows), max_ulp=max((r.max_ulp for r in rows), default=None),
                   first_step=first.first_step if first else None,
                   margin=first.margin if first else None, tokens=sum(r.tokens for r in rows),
                   divergent=divergent, kl_sum=kl_sum,
                   kl_mean=kl_sum / divergent if divergent else None,
                   kl_max=max(largest) if largest else None,
                   notes=sorted({n for r in rows for n in r.notes}),
                   served=sum(r.served or 0 for r in rows) or None)

    def judged(self, failure: Optional[str] = None) -> "PrefillSummary":
        """This summary with its verdict (failure: why the server could not serve the
        check, if it could not)."""
        served = ["the cache served %d completion%s, not compared"
                  % (self.served, "" if self.served == 1 else "s")] if self.served else []
        found = check_verdict(CheckFinding(
            parts=self.checked, compared=1 if self.tokens else 0, held=PREFILL_AGREE,
            moved=PREFILL_DIFFER if self.max_ulp or self.notes else None,
            held_where_compared=PREFILL_AGREE + " where compared", uncompared=served,
            failure=failure))
        return dataclasses.replace(self, verdict=found)

    @property
    def compared(self) -> int:
        return self.tokens

    @property
    def held(self) -> bool:
        return self.verdict == PREFILL_AGREE

    WHAT: ClassVar[str] = "prefill check"

    @property
    def evidence(self) -> str:
        return "max ULP 0 over %d tokens" % self.tokens

    def lines(self, sizes: List["SizeResult"]) -> List[str]:
        """Its lines after the sweep's summary line (a Bold one states its verdict)."""
        part = self
        def size_ulp(size: SizeResult) -> str:  # "-": none of its tokens was compared
            found = size.checks.get(self.KEY)
            if found is not None and not found.tokens:
                return "-"
            return fmt_opt(found and found.max_ulp, "?")

        per_size = ", ".join("%d: %s" % (size.batch_size, size_ulp(size)) for size in sizes)
        lines = ["prefill check, max ULP per batch size: %s" % per_size]
        margin = ""
        if part.margin:
            margin = " (there, the decode's runner-up was %s behind)" % margin_text(part.margin)
        lines.append(Bold("prefill check: max ULP %s, first differing step %s%s: %s"
                          % (fmt_opt(part.max_ulp, "?") + ("*" if part.notes else ""),
                             fmt_opt(part.first_step), margin, part.verdict)))
        if part.notes:
            lines.append("  * %s" % "; ".join(ULP_NOTE_TEXT.get(n, n) for n in part.notes))
        if part.divergent:
            lines.append("prefill check, KL(decode || prefill), K3 estimate over the %d divergent "
                         "of %d tokens: mean %.3g, max %.3g" %
                         (part.divergent, part.tokens, part.kl_mean, part.kl_max))
        return lines


@dataclass
class KlEstimate:
    """KL(decode || prefill) over the tokens whose two logprobs differ, by the K3 estimator
    SGLang's p_vs_d mode reports: with log r = prefill - decode at a decoded token,
    (exp(log r) - 1) - log r, never negative, 0 where the two agree. Clamped and non-finite
    values give no estimate (their ULP notes say so)."""

    divergent: int = 0  # tokens whose decode and prefill logprobs differ
    total: float = 0.0  # their K3 terms, summed
    largest: float = 0.0

    def add(self, decode: Sequence[float], prefill: Sequence[float],
            clamps: Sequence[float]) -> None:
        for d, p in zip(decode, prefill):
            if d == p or not (math.isfinite(d) and math.isfinite(p)) or d in clamps or p in clamps:
                continue
            log_r = p - d
            # a prefill logprob far above the decode's: a term beyond any float is infinite
            term = math.expm1(log_r) - log_r if log_r < 709.0 else math.inf
            self.divergent += 1
            self.total += term
            self.largest = max(self.largest, term)


def runner_up_margin(c: Completion, step: int, clamps: Sequence[float] = ()) -> Margin:
    """How near the decode's choice at step was to flipping: its chosen token against the best
    other candidate of its own top-k list there."""
    top = c.top_logprobs[step] if step < len(c.top_logprobs) else {}
    chosen = c.tokens[step]
    others = [v for k, v in top.items() if k != chosen]
    if chosen not in top or not others:
        return Margin(note=NOT_IN_TOP_K)
    best = max(others)
    ulp, _ = logprob_distance(top[chosen], best, clamps)
    return Margin(logprob=top[chosen] - best, ulp=ulp)





class PrefillCheck(SwitchedCheck):
    """--prefill-check, decode versus prefill: each distinct completion is sent back as one
    token-id prompt (the prompt's ids, then the generated ids: never re-tokenised text), and
    each generated token's logprob as the server decoded it is compared with the one it
    computes reading the whole sequence at once. Prefills are cached by token sequence, so the
    cost is one request per distinct sequence (plus one per prompt to learn its ids), not one
    per completion."""

    NAME = PrefillSummary.KEY
    OPTION = "--prefill-check"
    HELP = ("also read every distinct completion back as one token-id prompt and compare each "
            "token's decode-time logprob with its prefill-time one (what RL training on-policy "
            "needs; see --mode help)")
    EXPECT = {"prefill-equal": "(with --prefill-check) decode and prefill agree bitwise"}

    def __init__(self, asked: bool = False) -> None:
        super().__init__(asked)
        self.prompt_ids: Dict[str, List[int]] = {}
        self.prefills: Dict[Tuple[str, Tuple[str, ...]], List[float]] = {}
        # why the server could not serve the check (a gateway without /tokenize, say): the
        # check stops there, the sweep goes on
        self.failure: Optional[str] = None

    def prefill(self, sender: Sender, prompt: str, tokens: List[str]) -> List[float]:
        key = (prompt, tuple(tokens))
        if key not in self.prefills:
            s = sender
            if prompt not in self.prompt_ids:
                self.prompt_ids[prompt] = parsed("the prompt's token ids",
                                                 s.adapter.prompt_token_ids, s.client, s.model,
                                                 prompt)
            head = self.prompt_ids[prompt]
            generated = [token_id(t) for t in tokens]
            if not head or None in generated:
                raise ServerError(
                    "the prefill check needs token ids, and %s" %
                    ("the prompt has none" if not head else "the server's tokens are not ids"),
                    kind=ServerError.ANSWER)
            ids = head + generated
            self.prefills[key] = parsed("the prefill answer", s.adapter.prefill_logprobs, s.client,
                                        s.model, ids, len(head), s.isolate)
        return self.prefills[key]

    def batch_part(self, run: SweepRun, prompt: str, n: int,
                   batch: SentBatch) -> Optional[PrefillRow]:
        """Each distinct completion of one batch (of size n) against its prefill; None once
        the server has shown it cannot serve the check (it answered the check's requests with
        an error, or without the prompt logprobs it needs)."""
        if not self.asked or self.failure is not None:
            return None
        sender = run.sender
        clamps = sender.adapter.logprob_clamps
        worst, first, notes, margin, compared = 0, None, set(), None, 0
        kl = KlEstimate()
        seen: List[Completion] = []
        cached = batch.cached or [batch.cached_tokens] * len(batch.completions)
        # a completion whose request the cache served (or may have) compares nothing
        cold = [batch.computed(k, sender.isolate) for k in cached]
        try:
            for c, is_cold in zip(batch.completions, cold):
                if not is_cold or any(same_completion(c, s) for s in seen):
                    continue
                seen.append(c)
                prefill = self.prefill(sender, prompt, c.tokens)
                ulps, units = pair_ulps(list(c.logprobs), prefill, clamps)
                kl.add(c.logprobs, prefill, clamps)
                compared += len(ulps)
                notes |= units
                worst = max([worst] + [u for u in ulps if u])
                moved = next((i for i, u in enumerate(ulps) if u != 0), None)
                if moved is not None and (first is None or moved < first):
                    first, margin = moved, runner_up_margin(c, moved, clamps)
        except ServerError as err:
            if err.kind == ServerError.NETWORK:  # the server itself is gone: the sweep stops
                raise ServerError("prefill check at batch size %d: %s" % (n, err)) from None
            self.failure = str(err)
            run.out.warn("the prefill check stops at batch size %d, the sweep goes on: %s"
                         % (n, err))
            return None
        return PrefillRow(max_ulp=worst, first_step=first, notes=sorted(notes), margin=margin,
                          tokens=compared, divergent=kl.divergent, kl_sum=kl.total,
                          kl_max=kl.largest if kl.divergent else None,
                          served=cold.count(False) or None)

    def summary_part(self, parts: List[Any],
                     sizes: Optional[List[SizeResult]]) -> Optional[PrefillSummary]:
        if sizes is None:  # a batch size's passes
            return PrefillSummary.of(parts) if parts else None
        return PrefillSummary.of(parts).judged(self.failure) if self.asked else None




# ----------------------------------------------------------------------------
# Neighbour check (--neighbours L,...): batch 1 decoding beside other requests' prefills

NEIGHBOUR_RUNS = 2  # runs of the measured request beside each neighbour length, per pass
NEIGHBOUR_STREAMS = 3  # clients that keep neighbours coming while it decodes
NEIGHBOUR_IDS = (100, 1000)  # a neighbour's fresh random token ids: inside any vocabulary
MAX_NEIGHBOUR_TOKENS = 100000  # a neighbour prompt longer than this fits no context
NEIGHBOURS_HELD = "held beside every neighbour length"


def fmt_nats(nats: float) -> str:
    """A drift in nats as the table shows it: 0 where nothing moved, else two figures."""
    return "0" if not nats else "%.2g" % nats


@dataclass(frozen=True)
class NeighbourLength:
    """The measured prompt's runs while neighbours of one prompt length prefilled beside it,
    each compared bitwise with the lone run of the same pass (its batch 1)."""

    length: int  # tokens of each neighbour's prompt
    runs: int  # runs with a neighbour at the server beside the measured request: compared
    equal: int  # of them, bitwise equal to the lone run
    first_step: Optional[int]  # the first step any compared run moved at (first_moved says how)
    max_ulp: int
    max_nats: float
    alone: int = 0  # runs no neighbour overlapped: compared nothing
    neighbours: int = 0  # neighbour requests that overlapped a compared run
    served: int = 0  # runs the prefix cache served: compared nothing
    first_moved: Optional[str] = None  # what moved at first_step: "logprobs" or "tokens"

    @classmethod
    def combined(cls, parts: Sequence["NeighbourLength"]) -> "NeighbourLength":
        """One length over every pass."""
        moved = [p for p in parts if p.first_step is not None]
        first = min(moved, key=lambda p: p.first_step) if moved else None
        return cls(parts[0].length, sum(p.runs for p in parts), sum(p.equal for p in parts),
                   first.first_step if first else None, max(p.max_ulp for p in parts),
                   max(p.max_nats for p in parts), sum(p.alone for p in parts),
                   sum(p.neighbours for p in parts), sum(p.served for p in parts),
                   first.first_moved if first else None)

    def why_uncompared(self) -> str:
        """Why none of its runs compared anything."""
        why = []
        if self.served:
            why.append("the cache served %d run%s"
                       % (self.served, "" if self.served == 1 else "s"))
        if self.alone:
            why.append("no neighbour overlapped %d run%s"
                       % (self.alone, "" if self.alone == 1 else "s"))
        return "%d tokens: nothing compared (%s)" % (self.length, ", ".join(why) or "no run")

    @property
    def moved(self) -> bool:
        return self.equal < self.runs


@dataclass(frozen=True)
class NeighbourRow:
    """The neighbour check of one pass, in the batch-1 row (saved under "neighbours")."""

    SAVED_AS: ClassVar[Dict[str, Any]] = saved("neighbours")

    lengths: List[NeighbourLength]
    # the run-to-run control: the measured request alone again, against the lone run
    control_runs: int = 0
    control_equal: int = 0


@dataclass(frozen=True)
class NeighbourSummary:
    """The neighbour check over every pass: each length's runs, and its verdict (saved flat
    in the sweep's summary, behind "neighbours_")."""

    SAVED_AS: ClassVar[Dict[str, Any]] = saved(flat="neighbours_")
    COMPARES_RUNS: ClassVar[bool] = True  # one request's runs, compared with each other

    verdict: str
    lengths: List[NeighbourLength]
    control_runs: int = 0  # the measured request alone again, over every pass
    control_equal: int = 0  # of them, bitwise equal to the lone run

    @classmethod
    def of(cls, rows: Sequence[NeighbourRow], failure: Optional[str],
           unseeded: bool = False) -> "NeighbourSummary":
        by_length: Dict[int, List[NeighbourLength]] = {}
        for row in rows:
            for part in row.lengths:
                by_length.setdefault(part.length, []).append(part)
        lengths = [NeighbourLength.combined(parts) for parts in by_length.values()]
        moved = [p.length for p in lengths if p.moved]
        compared = [p.length for p in lengths if p.runs]
        control_runs = sum(r.control_runs for r in rows)
        control_equal = sum(r.control_equal for r in rows)
        found = check_verdict(CheckFinding(
            parts=len(lengths), compared=len(compared), held=NEIGHBOURS_HELD,
            moved="moved beside neighbours of %s tokens" % ", ".join(map(str, moved))
            if moved else None,
            held_where_compared="held beside neighbours of %s tokens"
            % ", ".join(map(str, compared)),
            uncompared=[p.why_uncompared() for p in lengths if not p.runs], failure=failure,
            compares_runs=True, control_moved=control_equal < control_runs, unseeded=unseeded))
        return cls(found, lengths, control_runs, control_equal)

    @property
    def compared(self) -> int:
        return sum(p.runs for p in self.lengths)

    @property
    def held(self) -> bool:
        return self.verdict == NEIGHBOURS_HELD

    WHAT: ClassVar[str] = "neighbour check"

    @property
    def evidence(self) -> str:
        return "%d runs beside neighbours" % self.compared

    def lines(self, sizes: List["SizeResult"]) -> List[str]:
        """Its lines after the sweep's summary line (a Bold one states its verdict)."""
        part = self
        lines = []
        if part.control_runs:
            lines.append("neighbour check, control (the request alone, again): %d of %d runs "
                         "equal to the lone run" % (part.control_equal, part.control_runs))
        for p in part.lengths:
            moved = "" if p.first_step is None else ", %s first moved at step %d" % (
                p.first_moved or "logprobs", p.first_step)
            lines.append("neighbour check, %d tokens beside: %d of %d runs equal to the lone run"
                         "%s, max ULP %d, max %s nats%s%s"
                         % (p.length, p.equal, p.runs, moved, p.max_ulp, fmt_nats(p.max_nats),
                            " (%d run%s no neighbour overlapped: not compared)"
                            % (p.alone, "" if p.alone == 1 else "s") if p.alone else "",
                            " (%d run%s the cache served: not compared)"
                            % (p.served, "" if p.served == 1 else "s") if p.served else ""))
        lines.append(Bold("neighbour check: %s" % part.verdict))
        return lines


def parse_lengths(text: str) -> List[int]:
    """--neighbours: comma-separated prompt lengths, each a whole number of tokens."""
    parts = [p.strip() for p in text.split(",")]
    bad = next((p for p in parts if parse_whole(p) is None), None)
    if not text.strip() or bad is not None:
        raise UsageError("--neighbours: give comma-separated prompt lengths in tokens, e.g. "
                         "16,64 (%r is not one)" % (bad if bad is not None else text))
    lengths = [int(p) for p in parts]
    if not all(1 <= n <= MAX_NEIGHBOUR_TOKENS for n in lengths):
        raise UsageError("--neighbours: a length is from 1 to %d tokens" % MAX_NEIGHBOUR_TOKENS)
    if len(set(lengths)) != len(lengths):
        raise UsageError("--neighbours: a length is listed twice")
    return lengths





class NeighbourCheck(SweepCheck):
    """--neighbours L,...: in every pass, batch 1's prompt is sent again (NEIGHBOUR_RUNS times
    for each length L) while NEIGHBOUR_STREAMS clients keep sending neighbours: requests of L
    fresh random token ids, a cache key each, that write one token, so that their prefills
    share the measured request's decode steps until it ends. Each run is compared bitwise
    with the lone run (batch 1 of the pass): a kernel whose tile or split follows the step's
    longest query moves the decode beside a long enough prefill (vLLM #51902). A run that no
    neighbour overlapped, or that the cache served, compares nothing."""

    NAME = "neighbours"
    EXPECT = {"neighbours-equal": "(with --neighbours) batch 1 held bitwise beside every "
              "neighbour length"}

    def __init__(self, lengths: Sequence[int] = ()):
        self.lengths = list(lengths)
        self.failure: Optional[str] = None  # why the server could not serve it
        self.unseeded = False  # its runs sampled by a server that ignores the seed
        self.rng = random.Random(DEFAULT_SEED)  # the neighbours' ids, the same run to run

    @classmethod
    def add_arguments(cls, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--neighbours", metavar="L,...",
            help="also send batch 1 again while other clients keep prefilling prompts of L "
            "fresh tokens beside it (one token each, a cache key each), for each length L, "
            "and compare it bitwise with the lone run: a decode beside a neighbour's prefill")

    @classmethod
    def from_args(cls, args: argparse.Namespace, asked: SweepAsked) -> "NeighbourCheck":
        if asked.expect in cls.EXPECT and args.neighbours is None:
            raise UsageError("--expect neighbours-equal needs --neighbours")
        return cls(parse_lengths(args.neighbours) if args.neighbours is not None else ())

    def params(self) -> Json:
        if not self.lengths:
            return {}
        return {"neighbours": self.lengths, "neighbour_runs": NEIGHBOUR_RUNS,
                "neighbour_streams": NEIGHBOUR_STREAMS}

    def open(self, run: SweepRun) -> List[str]:
        """Every neighbour prompt, and the one token it writes, must fit the server."""
        limit = run.facts.max_model_len
        if self.lengths and is_count(limit) and max(self.lengths) + 1 > limit:
            raise UsageError(
                "--neighbours: a neighbour of %d tokens and the token it writes do not fit the "
                "server's maximum model length of %d tokens (%s): give lengths below %d"
                % (max(self.lengths), limit, run.facts.max_model_len_source or "the server",
                   limit))
        if not self.lengths:
            return []
        return ["        neighbours: batch 1 again %d times beside %d clients prefilling "
                "prompts of %s tokens" % (NEIGHBOUR_RUNS, NEIGHBOUR_STREAMS,
                                          ", ".join(map(str, self.lengths)))]

    def beside(self, run: SweepRun, prompt: str, length: int,
               lone: Completion) -> Tuple[Optional[Delta], int, bool]:
        """One run of the measured prompt beside neighbours of length tokens: its delta from
        the lone run (None: it compared nothing), how many neighbours overlapped it, and
        whether the cache served it."""
        sender = run.sender

        def neighbour() -> Request:  # fresh random token ids, the same run to run
            ids = tuple(self.rng.randrange(*NEIGHBOUR_IDS) for _ in range(length))
            return Request((), sender.sampling, ids=ids)

        sent = sender.watched(lambda: sender.one_request(
            [prompt], what="neighbour requests", beside=neighbour, streams=NEIGHBOUR_STREAMS))
        overlapped, served = sent.background, not sent.cold(sender.isolate)
        if not overlapped or served:
            return None, overlapped, served
        return compare_completions(lone, sent.completions[0],
                                   sender.adapter.logprob_clamps), overlapped, served

    def control(self, run: SweepRun, prompt: str, lone: Completion) -> Optional[int]:
        """The run-to-run control: the measured request alone again; 1 where it equals the
        lone run bitwise (a server that does not honour the seed, or moves run to run, shows
        here, and nothing is put down to the neighbours); None where the cache served it."""
        sender = run.sender
        sent = sender.watched(lambda: sender.copies(prompt, 1, run.cfg.sweep.seed))
        if not sent.cold(sender.isolate):
            return None
        again = sent.completions[0]
        return int(compare_completions(lone, again, run.sender.adapter.logprob_clamps)
                   == IDENTICAL and again.text == lone.text)

    def batch_part(self, run: SweepRun, prompt: str, n: int,
                   batch: SentBatch) -> Optional[NeighbourRow]:
        if not self.lengths or n != 1 or self.failure is not None:
            return None
        lone, parts = batch.completions[0], []
        self.unseeded = samples_unseeded(run.cfg.sampling, run.facts)
        # the lone run the cache served is no reference: every run against it compares the
        # cache, and is counted as served
        lone_cold = batch.cold(run.sender.isolate)
        try:
            control = self.control(run, prompt, lone) if lone_cold else None
            for length in self.lengths:
                deltas, alone, served, overlapped = [], 0, 0, 0
                for _ in range(NEIGHBOUR_RUNS):
                    delta, beside, was_served = self.beside(run, prompt, length, lone)
                    was_served = was_served or not lone_cold
                    if delta is None or was_served:
                        served += was_served
                        alone += not was_served
                        continue
                    deltas.append(delta)
                    overlapped += beside
                # where each run first moved, and what: its logprobs, or a token chosen
                # (at one step, a token chosen otherwise is named over its logprobs)
                firsts = [(s, what) for d in deltas for s, what in (
                    (d.first_token_divergence, "tokens"), (d.first_ulp_step, "logprobs"))
                    if s is not None]
                first = min(firsts, key=lambda f: (f[0], f[1] != "tokens")) if firsts else (
                    None, None)
                parts.append(NeighbourLength(
                    length, len(deltas), sum(1 for d in deltas if d == IDENTICAL),
                    first[0], max((d.max_ulp for d in deltas), default=0),
                    max((d.max_nats for d in deltas), default=0.0), alone, overlapped,
                    served, first[1]))
        except ServerError as err:
            if err.kind == ServerError.NETWORK:  # the server itself is gone: the sweep stops
                raise ServerError("neighbour check: %s" % err) from None
            self.failure = str(err)
            run.out.warn("the neighbour check stops, the sweep goes on: %s" % err)
            return None
        return NeighbourRow(parts, 0 if control is None else 1, control or 0)

    def summary_part(self, parts: List[Any],
                     sizes: Optional[List[SizeResult]]) -> Optional[NeighbourSummary]:
        if not self.lengths or sizes is None:
            return None
        return NeighbourSummary.of(parts, self.failure, self.unseeded)




# ----------------------------------------------------------------------------
# Observer check (--observer-check): does asking for logprobs change what is generated?

OBSERVER_LOGPROBS = (None, 0, 5, 20)  # the settings compared: none asked, then top-k lists
OBSERVER_HELD = "the same text with and without logprobs"


@dataclass(frozen=True)
class ObserverSetting:
    """Batch 1's prompt sent with one logprobs setting, against the same prompt sent with
    none asked: the text is compared (with no logprobs asked, vLLM returns no token ids)."""

    logprobs: Optional[int]  # None: none asked (the reference)
    runs: int  # runs compared: the run and its reference both computed, not cache-served
    equal: int  # runs whose text equals the reference's
    served: int = 0  # runs the prefix cache served (the run or its reference): compared nothing


def observer_uncompared(setting: ObserverSetting, allowed: Optional[int]) -> str:
    """Why a logprobs setting compared nothing: the cache served its runs, or it was not asked
    (above what the server allows)."""
    if setting.served:
        return "top-%d: nothing compared (the cache served %d run%s)" % (
            setting.logprobs, setting.served, "" if setting.served == 1 else "s")
    return "top-%d: not asked (the server allows at most %s)" % (
        setting.logprobs, fmt_opt(allowed, "fewer"))


@dataclass(frozen=True)
class ObserverRow:
    """The observer check of one pass, in the batch-1 row (saved under "observer")."""

    SAVED_AS: ClassVar[Dict[str, Any]] = saved("observer")

    settings: List[ObserverSetting]


@dataclass(frozen=True)
class ObserverSummary:
    """The observer check over every pass (saved flat in the summary, behind "observer_")."""

    SAVED_AS: ClassVar[Dict[str, Any]] = saved(flat="observer_")
    COMPARES_RUNS: ClassVar[bool] = True  # one request's runs, compared with each other

    verdict: str
    settings: List[ObserverSetting]  # the first (logprobs None) is the run-to-run control

    @classmethod
    def of(cls, rows: Sequence[ObserverRow], failure: Optional[str] = None,
           unseeded: bool = False, allowed: Optional[int] = None) -> "ObserverSummary":
        """allowed: the most top logprobs the server allows, where it says."""
        by_setting: Dict[Optional[int], List[ObserverSetting]] = {}
        for row in rows:
            for part in row.settings:
                by_setting.setdefault(part.logprobs, []).append(part)
        settings = [ObserverSetting(k, sum(p.runs for p in parts), sum(p.equal for p in parts),
                                    sum(p.served for p in parts))
                    for k, parts in by_setting.items()]
        asked = [s for s in settings if s.logprobs is not None]
        control = [s for s in settings if s.logprobs is None]
        changed = [s.logprobs for s in asked if s.equal < s.runs]
        compared = [s.logprobs for s in asked if s.runs]
        found = check_verdict(CheckFinding(
            parts=len(asked), compared=len(compared), held=OBSERVER_HELD,
            moved="the text changed when logprobs %s were asked for" % ", ".join(
                "top-%d" % k for k in changed) if changed else None,
            held_where_compared="the same text with and without logprobs %s" % ", ".join(
                "top-%d" % k for k in compared),
            uncompared=[observer_uncompared(s, allowed) for s in asked if not s.runs],
            failure=failure, compares_runs=True,
            control_moved=any(s.equal < s.runs for s in control), unseeded=unseeded))
        return cls(found, settings)

    @property
    def compared(self) -> int:
        return sum(s.runs for s in self.settings if s.logprobs is not None)

    @property
    def held(self) -> bool:
        return self.verdict == OBSERVER_HELD

    WHAT: ClassVar[str] = "observer check"

    @property
    def evidence(self) -> str:
        return "%d runs with logprobs" % self.compared

    def lines(self, sizes: List["SizeResult"]) -> List[str]:
        """Its lines after the sweep's summary line (a Bold one states its verdict)."""
        part = self
        def served(s: ObserverSetting) -> str:
            return " (%d the cache served)" % s.served if s.served else ""

        held = ", ".join("top-%d %d/%d%s" % (s.logprobs, s.equal, s.runs, served(s))
                         if s.runs or s.served else "top-%d not asked" % s.logprobs
                         for s in part.settings if s.logprobs is not None)
        control = ", control %s" % next(("%d/%d%s" % (s.equal, s.runs, served(s))
                                         for s in part.settings if s.logprobs is None), "0/0")
        return [Bold("observer check (runs whose text equals the one with no logprobs: %s%s): %s"
                     % (held, control, part.verdict))]


class ObserverCheck(SwitchedCheck):
    """--observer-check: in every pass, batch 1's prompt is sent once with no logprobs asked,
    then once with each top-k of OBSERVER_LOGPROBS: asking for logprobs must not change what
    is generated (a server may take another sampling path when it must return them). The
    text is compared, only where the run and the first no-logprobs run were both computed:
    a run the prefix cache served (by its own cached-token count) compares nothing."""

    NAME = "observer"
    OPTION = "--observer-check"
    HELP = ("also send batch 1 with no logprobs asked, then with top-0, 5 and 20 lists, and "
            "compare what is generated: asking for logprobs must not change it")
    EXPECT = {"observer-equal": "(with --observer-check) the text held with and without "
              "logprobs"}

    def __init__(self, asked: bool = False):
        super().__init__(asked)
        self.failure: Optional[str] = None  # why the server could not serve it
        self.unseeded = False  # its runs sampled by a server that ignores the seed
        self.allowed: Optional[int] = None  # the most top logprobs the server allows, if said

    def once(self, run: SweepRun, prompt: str, logprobs: Optional[int]) -> Tuple[str, bool]:
        """The text of one request with that logprobs setting, and whether it was computed:
        not known to be served by the prefix cache (by its own cached-token count; a count
        the server does not give is trusted cold only under the bypass, as the sweep's own
        comparison does)."""
        sampling = dataclasses.replace(run.cfg.sampling, logprobs=logprobs)
        sender = run.sender
        sent = sender.watched(lambda: sender.one_request(
            [prompt], sampling=sampling, what="the observer check's request"))
        return sent.completions[0].text, sent.cold(sender.isolate)

    @staticmethod
    def setting(logprobs: Optional[int], reference: Tuple[str, bool],
                run: Tuple[str, bool]) -> ObserverSetting:
        """One run against the reference: compared only where neither was cache-served."""
        if not (reference[1] and run[1]):
            return ObserverSetting(logprobs, 0, 0, 1)
        return ObserverSetting(logprobs, 1, int(run[0] == reference[0]))

    def batch_part(self, run: SweepRun, prompt: str, n: int,
                   batch: SentBatch) -> Optional[ObserverRow]:
        if not self.asked or n != 1 or self.failure is not None:
            return None
        self.unseeded = samples_unseeded(run.cfg.sampling, run.facts)
        self.allowed = logprobs_limit(run.facts.max_logprobs)
        allowed = MAX_LOGPROBS if self.allowed is None else min(self.allowed, MAX_LOGPROBS)
        try:
            reference = self.once(run, prompt, None)
            # the run-to-run control: none asked, again
            settings = [self.setting(None, reference, self.once(run, prompt, None))]
            for k in OBSERVER_LOGPROBS[1:]:
                if k > allowed:  # asked only what the server allows: this one compares nothing
                    settings.append(ObserverSetting(k, 0, 0))
                    continue
                settings.append(self.setting(k, reference, self.once(run, prompt, k)))
        except ServerError as err:
            if err.kind == ServerError.NETWORK:  # the server itself is gone: the sweep stops
                raise ServerError("observer check: %s" % err) from None
            self.failure = str(err)
            run.out.warn("the observer check stops, the sweep goes on: %s" % err)
            return None
        return ObserverRow(settings)

    def summary_part(self, parts: List[Any],
                     sizes: Optional[List[SizeResult]]) -> Optional[ObserverSummary]:
        if not self.asked or sizes is None:
            return None
        return ObserverSummary.of(parts, self.failure, self.unseeded, self.allowed)




# ----------------------------------------------------------------------------
# Server baseline (--baseline PATH|URL): batch 1 from a file or another server


def saved_number(x: Any) -> bool:
    """A number as a save writes it: a JSON number, or a word for a value JSON has none for."""
    return is_number(x) or x in ("NaN", "Infinity", "-Infinity")


def baseline_fault(rec: Any) -> Optional[str]:
    """What is wrong with a stored baseline completion, naming the field; None if nothing."""
    if not isinstance(rec, dict):
        return "baseline is not a record"
    if not isinstance(rec.get("text"), str):
        return "baseline.text is not a string"
    tokens, logprobs, top = rec.get("tokens"), rec.get("logprobs"), rec.get("top_logprobs")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        return "baseline.tokens is not a list of strings"
    if not isinstance(logprobs, list) or not all(map(saved_number, logprobs)):
        return "baseline.logprobs is not a list of numbers"
    if len(logprobs) != len(tokens):
        return "baseline.logprobs has %d entries for %d tokens" % (len(logprobs), len(tokens))
    if top is None:
        return None
    if not isinstance(top, list) or len(top) != len(tokens):
        return "baseline.top_logprobs is not a list of one entry per token"
    for t, step in enumerate(top):
        if not isinstance(step, dict) or not all(
                isinstance(k, str) and saved_number(v) for k, v in step.items()):
            return "baseline.top_logprobs[%d] is not a map of token to logprob" % t
    if rec.get("finish_reason") is not None and not isinstance(rec["finish_reason"], str):
        return "baseline.finish_reason is not a string"
    return None


def baseline_served_why(entry: Json) -> Optional[str]:
    """Why the baseline a saved prompt record holds was served from the prefix cache, not
    computed (None: nothing says so): its verdict, or (its own batch 1 the baseline) its
    first batch-1 pass's count of served requests or cached tokens (a first-schema file
    keeps one pass, and no runs)."""
    if entry.get("verdict") == BASELINE_SERVED:
        return "its verdict: %s" % BASELINE_SERVED
    if entry.get("baseline_source") not in (None, "batch 1"):
        return None  # another file's or server's batch 1: that sweep's verdict says
    sizes = entry.get("sizes")
    size = next((s for s in sizes if isinstance(s, dict) and s.get("batch_size") == 1),
                None) if isinstance(sizes, list) else None
    if size is None:
        return None
    runs = size.get("runs")
    row = size if "runs" not in size else runs[0] if isinstance(runs, list) and runs else None
    if not isinstance(row, dict):
        return None
    if is_count(row.get("cached_tokens")):
        return "its batch 1 came with %d cached tokens" % row["cached_tokens"]
    if is_count(row.get("served")):
        return "its batch 1's request was served"
    seen = row.get("cache_seen") if isinstance(row.get("cache_seen"), dict) else {}
    served, counted = seen.get("served"), seen.get("counted")
    if seen.get("verdict") == CACHE_SERVED_NOT_COUNTED or (
            seen.get("verdict") == CACHE_COUNTED_AND_SERVED and is_count(served)
            and served > (counted if is_count(counted) else 0)):
        return "the server's counters saw its batch 1 served"
    if entry.get("verdict") == CACHE_UNCLEAR:
        return "its verdict: %s" % CACHE_UNCLEAR
    return None


@dataclass
class BaselineFile:
    """--baseline PATH: the batch-1 completions an earlier sweep saved."""

    path: str
    doc: Json

    def check(self, engine: Optional[str], model: Optional[str], sampling: Sampling,
              prompts: List[str]) -> None:
        """Refuse a baseline recorded for another engine, model, prompt or sampling."""
        doc, path = self.doc, self.path
        if doc.get("schema") not in SWEEP_SCHEMAS_READ or not isinstance(doc.get("prompts"), list):
            raise UsageError("--baseline: %s is not a sweep result" % path)
        if engine is not None:
            self.check_engine(engine)
        if model is not None and doc.get("model") != model:
            raise UsageError("--baseline: %s was recorded for model %s, not %s" %
                             (path, doc.get("model"), model))
        mine, theirs = as_record(sampling), doc.get("params") or {}
        # every request setting that changes what is compared (logprobs: the top-k lists)
        for key in ("temperature", "top_p", "max_tokens", "seed", "logprobs", "top_k", "min_p",
                    "repetition_penalty"):
            # a file saved before the lab sent top_k, min_p and repetition_penalty does not
            # hold them: what the server used then is not known, and not held against it
            if key not in theirs and key in ("top_k", "min_p", "repetition_penalty"):
                continue
            if theirs.get(key) != mine[key]:
                raise UsageError("--baseline: %s was recorded with %s=%s, this sweep uses %s" %
                                 (path, key, theirs.get(key), mine[key]))
        for i, entry in enumerate(doc["prompts"], 1):
            if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str):
                raise UsageError("--baseline: %s: prompts[%d] is not a prompt record" % (path, i))
        if prompts:  # --prompt-tokens: the prompt is built first, and checked then (open)
            self.check_prompts(prompts)

    def check_prompts(self, prompts: List[str]) -> None:
        path = self.path
        recorded = {p["prompt"]: p for p in self.doc["prompts"]}
        for prompt in prompts:
            entry = recorded.get(prompt)
            if entry is None:
                raise UsageError("--baseline: %s has no baseline for the prompt %r" %
                                 (path, prompt[:60]))
            fault = baseline_fault(entry.get("baseline"))
            if fault:
                raise UsageError("--baseline: %s: the baseline of %r: %s" %
                                 (path, prompt[:60], fault))
            served = baseline_served_why(entry)
            if served:
                raise UsageError(
                    "--baseline: %s: the baseline of %r was served from the prefix cache, not "
                    "computed (%s): it is no baseline; save a sweep whose batch 1 was computed"
                    % (path, prompt[:60], served))

    def check_engine(self, engine: str) -> None:
        recorded = self.doc.get("engine")
        if recorded != engine:
            raise UsageError("--baseline: %s was recorded on %s, this sweep is on %s" %
                             (self.path, recorded, engine))

    def open(self, run: SweepRun) -> None:
        """Once the server under test is known: the file must be of its engine and model, and
        hold the prompt --prompt-tokens built."""
        cfg = run.cfg
        if cfg.sweep.long_prompt is not None:
            self.check_prompts(cfg.sweep.prompts)
        self.check_engine(cfg.engine)
        if self.doc.get("model") != run.facts.model:
            raise UsageError("--baseline: %s was recorded for model %s, this server serves %s" %
                             (self.path, self.doc.get("model"), run.facts.model))

    def batch1(self, prompt: str) -> Tuple[Completion, str, bool]:
        """The prompt's baseline, where it came from, and that the cache did not serve it (a
        served one is refused before any request: check_prompts)."""
        entry = next(p for p in self.doc["prompts"] if p.get("prompt") == prompt)
        return Completion.from_record(entry["baseline"]), self.path, False

    def params(self) -> Json:
        return {"baseline_file": self.path}

    def header_lines(self) -> List[str]:
        return []

    def summary_lines(self) -> List[str]:
        return []


@dataclass
class BaselineServer:
    """--baseline URL: another server whose batch 1 is the baseline (another restart, TP degree
    or version of the same model), asked with the same prompts and sampling before the sweep."""

    url: str
    sender: Optional[Sender] = None  # once open
    differences: List[SettingDifference] = field(default_factory=list)  # theirs and ours
    served: int = 0  # prompts whose batch 1 there the prefix cache served: no baseline

    def open(self, run: SweepRun) -> None:
        """Once the server under test is known: the same model, and what the two report
        differently."""
        cfg, facts = run.cfg, run.facts
        theirs = server_facts(cfg, self.url, "the baseline server (--baseline)")
        if theirs.model != facts.model:
            raise UsageError("--baseline: %s serves %s, the server under test %s" %
                             (self.url, theirs.model, facts.model))
        client, adapter = cfg.client(self.url), cfg.adapter
        # its prefix cache read as the sweep reads its own server's (CachePolicy.open)
        off = adapter.prefix_cache_off(theirs.settings)
        start = None if off else adapter.prefix_cache_counters(client)
        watch = None if start is None else CounterWatch(adapter, client, start)
        if watch is not None:  # one batch a prompt: worth the longest wait for its count
            watch.settle = COUNTERS_SETTLE_MAX_S
        self.sender = Sender(client, adapter, theirs.model_id, cfg.sampling, run.sender.isolate,
                             watch=watch, cache_off=off)
        self.differences = SettingDifference.between(theirs, facts, ("baseline", "here"),
                                                     flag=True)

    def batch1(self, prompt: str) -> Tuple[Completion, str, bool]:
        """Batch 1 of the baseline server, where it came from, and whether its prefix cache
        served it (by its answer's count and its counters), or may have where the bypass did
        not hold beside it: one it served is no baseline."""
        sender = self.sender
        try:
            sender.adapter.before_batch(sender.client, sender.isolate)
            batch = sender.watched(lambda: sender.copies(prompt, 1, 0))
        except ServerError as err:
            raise ServerError("the baseline server, batch 1: %s" % err) from None
        count = batch.cached[0] if batch.cached else batch.cached_tokens
        served = batch.served(count) is True or batch.unclear(count)
        if served:
            self.served += 1
        return batch.completions[0], "batch 1 of %s" % self.url, served

    def params(self) -> Json:
        return {"baseline_server": self.url, "baseline_differences": as_record(self.differences)}

    def header_lines(self) -> List[str]:
        differences = "; ".join(
            "%s %s there, %s here"
            % (d.setting, fmt_setting(d.side("baseline")), fmt_setting(d.side("here")))
            for d in self.differences)
        shown = differences or "reporting the same settings"
        return ["        baseline: batch 1 of %s, %s" % (self.url, shown)]

    def summary_lines(self) -> List[str]:
        served = (", which its prefix cache served (%d prompt%s): no baseline, nothing compared"
                  % (self.served, "" if self.served == 1 else "s")) if self.served else ""
        return ["  against batch 1 of %s%s" % (self.url, served)]


class BaselineSource:
    """--baseline PATH|URL, the sweep's baseline source (SweepOptions.baseline_source, used
    by the core by name): batch 1 of an earlier sweep's file or of another server stands in
    for the server's own batch 1, so that batch 1 is compared too (restart to restart, TP to
    TP, version to version). Without it the baseline is the server's own batch 1."""

    def __init__(self, source: Optional[Union[BaselineFile, BaselineServer]] = None):
        self.source = source

    @classmethod
    def add_arguments(cls, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--baseline", metavar="PATH|URL",
            help="compare with the batch-1 completions of an earlier sweep's --save file "
            "(same model and prompts), or of another server, measured first with the same "
            "prompts and sampling: restart to restart, TP to TP, version to version")

    @classmethod
    def from_args(cls, args: argparse.Namespace, asked: SweepAsked) -> "BaselineSource":
        """A server's URL (never the server under test), or a saved sweep recorded for this
        engine, model, sampling and every prompt, checked before any request."""
        text = args.baseline
        if not text:
            return cls()
        if urllib.parse.urlsplit(text).scheme in ("http", "https"):
            url = check_url(text, "--baseline")
            if server_address(url) == server_address(asked.url):
                raise UsageError(
                    "--baseline names the server under test (--url); give another server")
            return cls(BaselineServer(url))
        source = BaselineFile(text, read_json_file(text, "--baseline"))
        source.check(asked.engine, asked.model, asked.sampling, asked.prompts)
        return cls(source)

    def servers(self) -> List[Tuple[str, str]]:
        if isinstance(self.source, BaselineServer):
            return [(self.source.url, "the baseline server (--baseline)")]
        return []

    def open(self, run: SweepRun) -> None:
        if self.source:
            self.source.open(run)

    def batch1(self, prompt: str) -> Optional[Tuple[Completion, str, bool]]:
        """(the prompt's baseline, where it came from, whether the prefix cache served it)."""
        return self.source.batch1(prompt) if self.source else None

    def params(self) -> Json:
        return self.source.params() if self.source else {}

    def header_lines(self) -> List[str]:
        return self.source.header_lines() if self.source else []

    def summary_lines(self) -> List[str]:
        return self.source.summary_lines() if self.source else []


# ----------------------------------------------------------------------------
# --mode sweep: unique completions and logprob ULPs across batch sizes

# The checks a sweep can run, in the order they run, print and are saved: each is one
# section above, and its own options, request changes, records, lines and --expect rules
SWEEP_CHECKS: Tuple[Type[SweepCheck], ...] = (CacheCheck, PrefillCheck, NeighbourCheck,
                                               ObserverCheck)


def check_prompts(prompts: List[str], option: str) -> List[str]:
    if len(prompts) > MAX_PROMPTS:
        raise UsageError("%s: at most %d prompts (got %d)" % (option, MAX_PROMPTS, len(prompts)))
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    if len(prompts[longest]) > MAX_PROMPT_CHARS:
        raise UsageError("%s: prompt %d has %d characters; at most %d" %
                         (option, longest + 1, len(prompts[longest]), MAX_PROMPT_CHARS))
    return prompts


def parse_sizes(text: str) -> List[int]:
    parts = [p.strip() for p in text.split(",")]
    if not text.strip():
        raise UsageError("--sizes: give comma-separated batch sizes, e.g. 1,15,16,17")
    if any(not p for p in parts):
        raise UsageError("--sizes: entry %d of %r is empty; give comma-separated batch sizes, "
                         "e.g. 1,15,16,17" % (parts.index("") + 1, text))
    bad = next((p for p in parts if parse_whole(p) is None), None)
    if bad is not None:
        raise UsageError("--sizes: %r is not a whole number" % bad)
    sizes = [int(p) for p in parts]
    if any(s < 1 for s in sizes):
        raise UsageError("--sizes: batch sizes start at 1 (got %d)" % min(sizes))
    if max(sizes) > MAX_BATCH_SIZE:
        raise UsageError("--sizes: batch sizes go up to %d (got %d)" %
                         (MAX_BATCH_SIZE, max(sizes)))
    if len(set(sizes)) != len(sizes):
        raise UsageError("--sizes: %d is listed twice"
                         % next(s for s in sizes if sizes.count(s) > 1))
    return sizes


def read_prompt_file(path: str) -> List[str]:
    lines = read_input_file(path, "--prompt-file").split("\n")
    prompts = [line.rstrip("\r") for line in lines if line.strip()]
    if not prompts:
        raise UsageError("--prompt-file: %s holds no prompt" % path)
    return check_prompts(prompts, "--prompt-file")


@dataclass(frozen=True)
class LongPrompt:
    """--prompt-tokens: a prompt built to about a number of tokens, as the server counts them."""

    text: str = field(metadata=NOT_SAVED)
    asked: int  # --prompt-tokens
    tokens: int  # what the server's tokenizer made of it
    budget: Optional[int] = field(metadata=saved("prefill_budget"))  # where the server says
    chunks: Optional[int] = field(metadata=saved("prefill_chunks"))  # of the budget it takes


# --expect NAME of the sweep's own verdict, and what --help says of it
SWEEP_EXPECT_HELP = {
    "invariant": "the result is invariant (flag on; needs --repeat 2 or more: batch 1 "
    "repeated is its control)",
    "variant": "it shows a difference (flag off, the negative control)"}


@dataclass
class SweepOptions:
    """--mode sweep's own options, checked before any request (each field named as its
    option's argparse dest), and the checks it runs (SWEEP_CHECKS, configured)."""

    sampling: Sampling
    sizes: Optional[List[int]]  # None: a ladder to max_batch straddling the graph sizes
    max_batch: int
    prompts: List[str]
    traffic: str  # one of TRAFFIC_SHAPES
    arrivals: Arrivals  # when concurrent traffic's requests go out (--request-rate)
    repeat: int  # passes through the ladder
    seed: int  # the sampling seed; it also places mixed traffic's fillers
    expect: Optional[str]  # a key of SWEEP_EXPECT_HELP or a check's EXPECT
    prompt_tokens: Optional[int]  # build a prompt of about this many tokens
    checks: List[SweepCheck]  # one of each of SWEEP_CHECKS, in its order
    cache: CachePolicy  # --prefix-cache: bypass or keep, and what a bypass showed
    baseline_source: BaselineSource  # --baseline: a file or server, else batch 1
    long_prompt: Optional[LongPrompt] = None  # the prompt so built, as the server counted it

    @staticmethod
    def add_arguments(group: argparse._ArgumentGroup,
                      checks: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--sizes", help="batch sizes, e.g. 1,15,16,17 (default: a ladder to --max-batch that "
            "straddles every CUDA-graph size)")
        group.add_argument(
            "--max-batch", type=whole_number(1, MAX_BATCH_SIZE), default=DEFAULT_MAX_BATCH,
            help="largest batch of the default ladder (default %d)" % DEFAULT_MAX_BATCH)
        group.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                           help="a prompt; repeat for more (each gets its own sweep)")
        group.add_argument("--prompt-file", metavar="PATH", help="prompts, one per line")
        group.add_argument(
            "--temperature", type=real_number(0.0), default=DEFAULT_TEMPERATURE,
            help="default %g (greedy); above 0 a --seed is always sent" % DEFAULT_TEMPERATURE)
        group.add_argument("--seed", type=whole_number(0, MAX_SEED), default=DEFAULT_SEED,
                           help="sampling seed when temperature > 0 (default %d)" % DEFAULT_SEED)
        group.add_argument(
            "--logprobs", type=whole_number(0, MAX_LOGPROBS), default=DEFAULT_LOGPROBS,
            help="top-k logprobs per step, 0..%d (default %d)" % (MAX_LOGPROBS, DEFAULT_LOGPROBS))
        group.add_argument(
            "--traffic", choices=TRAFFIC_SHAPES, default=DEFAULT_TRAFFIC,
            help="copies: one request of n copies of the prompt; concurrent: n one-prompt "
            "requests in flight at once; mixed: the prompt once among n-1 other prompts "
            "(default %s; see --mode help)" % DEFAULT_TRAFFIC)
        group.add_argument(
            "--repeat", type=whole_number(1, MAX_REPEAT), default=DEFAULT_REPEAT,
            help="passes through the whole ladder, batch 1 included; batch 1's passes are the "
            "run-to-run control (default %d)" % DEFAULT_REPEAT)
        group.add_argument(
            "--prompt-tokens", type=whole_number(1, MAX_PROMPT_TOKENS), metavar="N",
            help="measure a prompt of about N tokens, built of plain words until the server's "
            "own tokenizer counts N within a few, instead of --prompt (to cross the "
            "chunked-prefill budget)")
        expects = dict(SWEEP_EXPECT_HELP)
        for kind in SWEEP_CHECKS:
            expects.update(kind.EXPECT)
        group.add_argument(
            "--expect", choices=tuple(expects),
            help="exit 1 unless " + "; ".join("%s: %s" % item for item in expects.items()))
        CachePolicy.add_arguments(checks)
        BaselineSource.add_arguments(checks)
        for kind in SWEEP_CHECKS:
            kind.add_arguments(checks)

    @classmethod
    def from_args(cls, args: argparse.Namespace, url: str,
                  engine: Optional[str]) -> "SweepOptions":
        max_tokens = DEFAULT_SWEEP_TOKENS if args.max_tokens is None else args.max_tokens
        sampling = Sampling.of(args.temperature, max_tokens, args.logprobs, args.seed)
        sizes = parse_sizes(args.sizes) if args.sizes is not None else None
        read = read_prompt_file(args.prompt_file) if args.prompt_file else []
        prompts = list(args.prompt) + read
        if any(not p.strip() for p in prompts):
            raise UsageError("--prompt: a prompt is empty")
        if not all(p.encode("utf-8", "surrogatepass").decode("utf-8", "replace") == p
                   for p in prompts):
            raise UsageError("--prompt: a prompt is not UTF-8 text (as --prompt-file requires)")
        prompts = check_prompts(prompts or [DEFAULT_PROMPT], "--prompt")
        if len(set(prompts)) != len(prompts):
            raise UsageError("--prompt: the same prompt is given twice")
        if args.prompt_tokens and (args.prompt or args.prompt_file):
            raise UsageError(
                "--prompt-tokens builds the prompt itself: leave out --prompt and --prompt-file")
        if args.traffic == "mixed" and (max(sizes) if sizes else args.max_batch) == 1:
            raise UsageError(
                "--traffic mixed: batch 1 has no room for other prompts; give sizes above 1")
        if args.expect == "invariant" and args.repeat < 2:
            raise UsageError(
                "--expect invariant needs --repeat 2 or more: its rule needs batch 1 sent "
                "again, the run-to-run control, and one pass sends it once")
        built = [] if args.prompt_tokens else prompts  # a built prompt is checked once built
        asked = SweepAsked(url, engine, args.model, sampling, built, args.traffic, args.expect)
        checks = [kind.from_args(args, asked) for kind in SWEEP_CHECKS]
        concurrent = args.traffic == "concurrent"
        needs = None if concurrent else "--traffic concurrent (one request a prompt)"
        arrivals = Arrivals.configure(args.request_rate, needs)
        return options_from(cls, args, sampling=sampling, sizes=sizes, prompts=prompts,
                            arrivals=arrivals, checks=checks, cache=CachePolicy.from_args(args),
                            baseline_source=BaselineSource.from_args(args, asked))

    def check(self, kind: Type[SweepCheckT]) -> SweepCheckT:
        """The configured check of one kind of SWEEP_CHECKS."""
        return next(c for c in self.checks if isinstance(c, kind))


PROMPT_FIT_TRIES = 6  # rounds of counting and resizing a built prompt
MAX_WORDS_A_TOKEN = 8  # a built prompt's words per token at most (a common word is one token)


def built_prompt(client: HttpClient, adapter: EngineAdapter, facts: ServerFacts,
                 n: int) -> LongPrompt:
    """Plain words, resized until the server's own tokenizer counts n within max(2, n/100)."""

    def count(text: str) -> int:
        ids = parsed("the prompt's token ids", adapter.prompt_token_ids, client, facts.model_id,
                     text)
        return len(ids)

    words = n
    tokens = count(filler_words(words))
    for _ in range(PROMPT_FIT_TRIES):
        if abs(tokens - n) <= max(2, n // 100):
            break
        # Never more than MAX_WORDS_A_TOKEN words a token: a tokenizer that counts far fewer
        # tokens than words is not one the lab can build a prompt for
        words = min(MAX_WORDS_A_TOKEN * n, max(1, round(words * n / max(tokens, 1))))
        tokens = count(filler_words(words))
    if abs(tokens - n) > max(2, n // 100) and words == MAX_WORDS_A_TOKEN * n:
        raise ServerError(
            "--prompt-tokens: the server's tokenizer counts %d tokens for %d words, so no "
            "prompt of about %d tokens can be built of words" % (tokens, words, n),
            kind=ServerError.ANSWER)
    budget = facts.settings.get(adapter.PREFILL_BUDGET)
    budget = budget if is_count(budget) else None
    chunks = -(-tokens // budget) if budget else None
    return LongPrompt(filler_words(words), n, tokens, budget, chunks)


def sweep_ladder(options: SweepOptions, facts: ServerFacts) -> List[int]:
    """The batch sizes to run: --sizes, else a ladder straddling the server's graph sizes
    (the engine's own when the server runs none)."""
    limit = facts.max_num_seqs if is_count(facts.max_num_seqs) else None
    if options.sizes is not None:
        sizes = list(options.sizes)
        # one request of n prompts above the limit is never one batch; n concurrent requests
        # above it are what a loaded server meets (they queue), and sweep_warnings says so
        if limit is not None and max(sizes) > limit and options.traffic != "concurrent":
            raise UsageError(
                "--sizes: the server runs at most %d requests at once (%s), so one request of "
                "%d prompts is never one batch: give sizes up to %d" % (
                    limit, facts.max_num_seqs_source, max(sizes), limit))
    else:
        top = options.max_batch if limit is None else min(options.max_batch, limit)
        sizes = straddling_ladder(top, facts.graph_sizes or facts.default_graph_sizes)
    # The plan's first step, whatever order the sizes were given in: batch 1 is the baseline
    # (and the stored baseline's peer), so it is sent before any size compared with it
    return [1] + [n for n in sizes if n != 1]


def sweep_summary(options: SweepOptions, sweeps: List[PromptSweep], state: str) -> SweepSummary:
    """The whole sweep so far, its verdict decided by verdict() from what every prompt
    measured, with each check's summary where it ran."""
    rows = [row for sweep in sweeps for row in sweep.rows()]
    sizes = [size for sweep in sweeps for size in sweep.sizes()]
    measured = Measured.combined([s.measured() for s in sweeps])
    parts = {}
    proof = options.cache.proof(sizes)
    if proof is not None:
        parts[CachePolicy.NAME] = proof
    for check in options.checks:
        part = check.summary_part([r.checks[check.NAME] for _, r in rows
                                   if check.NAME in r.checks], sizes)
        if part is not None:
            parts[check.NAME] = part
    held = {check.NAME: bool(parts[check.NAME].held) for check in options.checks
            if check.NAME in parts}
    return SweepSummary(
        unique_completions=measured.unique, total_completions=measured.total,
        max_ulp=measured.max_ulp, max_nats=max((r.max_nats for _, r in rows), default=0.0),
        flip_risk=max((r.flip_risk for _, r in rows if r.flip_risk is not None), default=None),
        batch1_repeatable=measured.batch1_repeatable,
        traffic=options.traffic, repeat=options.repeat, verdict=verdict(measured),
        first_moved=measured.first_moved, served_sizes=measured.served_sizes or None,
        ulp_notes=sorted({u for _, r in rows for u in r.ulp_notes}), state=state,
        checks=parts, measured=measured, checks_held=held or None)


def sweep_params(cfg: Config, facts: ServerFacts, sizes: List[int]) -> Json:
    """How the sweep was asked for, as its saved document holds it."""
    options = cfg.sweep
    params = dict(as_record(cfg.sampling), sizes=sizes, prompts=len(options.prompts),
                  prompt_tokens=as_record(options.long_prompt), traffic=options.traffic,
                  arrivals=options.arrivals.describe(), repeat=options.repeat,
                  seed_honoured=facts.seed_honoured)
    params.update(options.cache.params())
    params.update(options.baseline_source.params())
    for check in options.checks:
        params.update(check.params())
    if options.traffic == "mixed":
        params["mixed_seed"] = options.seed
    if options.traffic == "concurrent":
        params["send_spread_s"] = SEND_SPREAD_MEANS
    return params


def sweep_document(cfg: Config, facts: ServerFacts, prompts: List[Json], sizes: List[int],
                   summary: SweepSummary) -> Json:
    """The saved sweep (schema SWEEP_SCHEMA): the server, how the sweep was asked for, every
    prompt's record (a PromptRecord: its baseline, and per batch size a SizeResult holding a
    BatchRow per pass) and the summary (a SweepSummary)."""
    return {
        "schema": SWEEP_SCHEMA,
        "engine": cfg.engine,
        "engine_detected": cfg.engine_detected,
        "url": cfg.url,
        "model": facts.model,
        "server": as_record(facts),
        "params": sweep_params(cfg, facts, sizes),
        "prompts": prompts,
        "summary": as_record(summary),
        "created": now_stamp(),
        "lab": dict(cfg.provenance, ended=None if summary.state == "running" else now_stamp())}





def sweep_warnings(facts: ServerFacts, sizes: List[int], ladder_to: Optional[int],
                   sampling: Sampling, out: Out) -> None:
    """ladder_to: the default ladder's --max-batch (None with --sizes)."""
    if samples_unseeded(sampling, facts):
        out.warn("the server does not honour the seed (%s): at temperature %g every request "
                 "samples unseeded, so differences include plain sampling noise, and the verdict "
                 "will not put them down to batching" % (facts.seed_note, sampling.temperature))
    limit = facts.max_num_seqs
    if ladder_to is not None and is_count(limit) and ladder_to > limit:
        out.warn("the ladder stops at batch %d, the most requests the server runs at once (%s), "
                 "not at --max-batch %d" % (limit, facts.max_num_seqs_source, ladder_to))
    elif is_count(limit) and max(sizes) > limit:
        out.warn("batch sizes above %d exceed the server's max-num-seqs: those requests are not "
                 "all scheduled together (they queue, as on a loaded server)" % limit)
    if facts.load_format == "dummy":
        out.warn("the server runs dummy weights (--load-format dummy): flat logits have no "
                 "near-ties, so a clean flag-off result is expected and means nothing")
    if facts.flag is None:
        out.warn("the server does not say whether the flag is on%s" %
                 (" (%s)" % facts.settings_hint if facts.settings_hint else ""))


SWEEP_COLUMNS = ("  batch  bucket  distinct  same/all  runs matched  first token  tie margin  max "
                 "ULP  max nats  flip risk  first ULP step  seconds  notes")


def control_text(repeatable: Optional[bool], repeat: int, sweeps: List[PromptSweep]) -> str:
    """The run-to-run control as the table's last line says it: how many batch-1 runs it
    compared (PromptSweep.batch1 holds only the computed ones), or why there is none."""
    if repeatable is False:
        return "batch 1 NOT repeatable"
    if repeatable is None and repeat == 1:
        return "no run-to-run control (one pass)"
    # the prompt whose control compared fewest runs speaks for the sweep
    least = min(sweeps, key=lambda s: len(s.batch1), default=PromptSweep(""))
    compared, sent = len(least.batch1), len(least.runs.get(1, []))
    served = "%s batch 1 in %s" % (
        "the kept cache served, or may have served," if least.cache_kept else "the cache served",
        "every pass" if not compared else "%d of %d passes" % (sent - compared, sent))
    if repeatable:
        return "batch 1 repeatable over %d passes%s" % (
            compared, " (%s)" % served if sent > compared else "")
    if sent < 2:
        return "no run-to-run control (stopped before a second pass)"
    if compared < 2:
        return "no run-to-run control (%s)" % served
    return "no run-to-run control (batch 1's logprobs hold NaN, which compares to nothing)"


def size_notes(size: SizeResult, cache: CachePolicy) -> str:
    notes = []
    if size.overlapped is False:
        notes.append("requests never in flight together: not compared")
    elif size.in_flight is not None and size.in_flight < size.batch_size:
        notes.append("at most %d of %d requests in flight together" %
                     (size.in_flight, size.batch_size))
    if size.text_only:
        notes.append("text differs, tokens equal (%d)" % size.text_only)
    if "top-k changed" in size.ulp_notes:
        notes.append("top-k changed")
    notes.extend(cache.size_notes(size))
    return "; ".join(notes)


def fmt_share(share: Optional[float]) -> str:
    """A share as a percentage ("-" where there is none, "<1%" for a small one not nil)."""
    if share is None:
        return "-"
    if 0 < share < 0.01:
        return "<1%"
    return "%.0f%%" % (100 * share)


def size_row(s: SizeResult, cache: CachePolicy) -> str:
    """One batch size's row of the table."""
    ulp = str(s.max_ulp) + ("*" if s.ulp_notes else "")
    row = "  %5d  %6s  %8d  %8s  %12s  %11s  %10s  %7s  %8s  %9s  %14s  %7.2f  %s" % (
        s.batch_size, fmt_opt(s.bucket, "none"), s.distinct_in_batch,
        "%d/%d" % (s.same_as_baseline, s.completions), "%d/%d" % (s.runs_matched, len(s.runs)),
        fmt_opt(s.first_token_divergence), margin_text(s.divergence_margin), ulp,
        fmt_nats(s.max_nats), fmt_share(s.flip_risk), fmt_opt(s.first_ulp_step), s.seconds,
        size_notes(s, cache))
    return row.rstrip()


def sizes_text(sizes: Sequence[int]) -> str:
    return "size%s %s" % ("" if len(sizes) == 1 else "s", ",".join(map(str, sizes)))


def verdict_reasons(summary: SweepSummary) -> List[str]:
    """What the verdict holds only so far as: the sizes the cache served or a request was
    alone at compared nothing, and the verdict does not cover them."""
    m, reasons = summary.measured, []
    if m.served_sizes and summary.verdict not in (CACHE_CONFOUNDED, KEPT_CACHE_MOVED,
                                                   SERVED_ONLY):
        where = ("invariant where computed; " if summary.verdict == INVARIANT else
                 "" if summary.verdict in UNMEASURED_VERDICTS else "where computed; ")
        reasons.append("%s%s served from the cache, not compared"
                       % (where, sizes_text(m.served_sizes)))
    if m.unknown_sizes and summary.verdict not in UNMEASURED_VERDICTS:
        reasons.append("%s: %s, not compared" % (
            sizes_text(m.unknown_sizes), "the cache was kept and its state is not known"
            if m.cache_kept else "whether the cache served them is not known"))
    if m.alone_sizes and summary.verdict not in UNMEASURED_VERDICTS:
        reasons.append("some requests at %s were alone at the server, not compared"
                       % sizes_text(m.alone_sizes))
    return reasons


class SweepTable:
    """The sweep's table, printed as it is measured: the header before the first request,
    each size's row once its last pass is in, each prompt's closing line once its sizes are,
    and the rest (anything a stop left unprinted, the notes, the summary, the checks') at
    the end."""

    def __init__(self, cfg: Config, out: Out):
        self.cfg, self.options, self.out = cfg, cfg.sweep, out
        self.rows: Dict[int, Set[int]] = {}  # prompt number -> batch sizes whose rows are out
        self.closed: Set[int] = set()  # prompt numbers whose closing line is out

    def header(self, run: SweepRun, sizes: List[int], header: List[str]) -> None:
        """header: the checks' own lines (SweepCheck.open)."""
        cfg, options, out, facts = self.cfg, self.options, self.out, run.facts
        for line in server_lines(as_record(facts), cfg.adapter, cfg.engine_detected):
            out.line(line)
        sampling = cfg.sampling
        if sampling.temperature == 0:
            how = "greedy"
        elif facts.seed_honoured is False:
            how = "temperature %g, seed %s (IGNORED by the server)" % (sampling.temperature,
                                                                      sampling.seed)
        else:  # what the engine is known to do, never checked but by batch 1's control
            taken = ("the engine takes a per-request seed" if facts.seed_honoured else
                     "whether the server honours it is not known")
            checked = ("batch 1's run-to-run control checks it" if options.repeat > 1 else
                       "not checked: --repeat 1 runs no run-to-run control")
            how = "temperature %g, seed %s (%s; %s)" % (sampling.temperature, sampling.seed,
                                                       taken, checked)
        out.line("params: %d tokens, %s, top-%d logprobs, sizes %s" %
                 (sampling.max_tokens, how, sampling.logprobs, ",".join(str(s) for s in sizes)))
        out.line("        traffic %s, %d pass%s through the ladder, prefix cache %s" %
                 (options.traffic, options.repeat, "" if options.repeat == 1 else "es",
                  options.cache.choice))
        for line in options.cache.header_lines() + options.baseline_source.header_lines():
            out.line(line)
        for line in header:
            out.line(line)
        long_prompt = options.long_prompt
        if long_prompt:
            budget, chunks = long_prompt.budget, long_prompt.chunks
            if budget and chunks > 1:
                crossing = ("crosses the chunked-prefill budget of %d tokens: prefilled in %d "
                            "chunks" % (budget, chunks))
            elif budget:
                crossing = "fits in one chunk of the chunked-prefill budget (%d tokens)" % budget
            else:
                crossing = "the server does not say its chunked-prefill budget"
            out.line("        prompt of %d tokens by the server's tokenizer (asked %d): %s" %
                     (long_prompt.tokens, long_prompt.asked, crossing))

    def size_done(self, number: int, total: int, sweep: PromptSweep, n: int) -> None:
        if number not in self.rows:
            self.rows[number] = set()
            self.out.line("")
            shown = json.dumps(sweep.prompt[:70] + ("..." if len(sweep.prompt) > 70 else ""))
            self.out.line("prompt %d/%d: %s  (baseline: %s)"
                          % (number, total, shown, sweep.baseline_source))
            self.out.line(SWEEP_COLUMNS)
        self.rows[number].add(n)
        self.out.line(size_row(sweep.size(n), self.options.cache))

    def prompt_done(self, number: int, sweep: PromptSweep) -> None:
        self.closed.add(number)
        measured = sweep.measured()
        self.out.line("  unique completions %d of %d, max ULP %d: %s" %
                      (measured.unique, measured.total, measured.max_ulp, verdict(measured)))

    def finish(self, summary: SweepSummary, sweeps: List[PromptSweep]) -> None:
        out, options, m = self.out, self.options, summary.measured
        for number, sweep in enumerate(sweeps, 1):
            for n in sweep.runs:
                if n not in self.rows.get(number, ()):
                    self.size_done(number, len(sweeps), sweep, n)
            if number not in self.closed:
                self.prompt_done(number, sweep)
        out.line("")
        if summary.ulp_notes:
            out.line("* %s" % "; ".join(ULP_NOTE_TEXT[n] for n in summary.ulp_notes))
        sizes = [size for sweep in sweeps for size in sweep.sizes()]
        control = control_text(m.batch1_repeatable, options.repeat, sweeps)
        reasons = [] if summary.state == "complete" else [summary.state]
        reasons += verdict_reasons(summary)
        reasons += options.cache.summary_reasons(summary)
        for line in options.cache.summary_notes(summary, sizes):
            out.line(line)
        out.bold("summary: unique completions %d, total %d, max ULP %d, %s: %s%s"
                 % (m.unique, m.total, m.max_ulp, control, summary.verdict,
                    " (%s)" % "; ".join(reasons) if reasons else ""))
        if summary.max_nats:
            out.line("  drift: at most %s nats between batch 1's logprobs and another's; flip "
                     "risk %s (the share of batch 1's steps whose top two lay that close)"
                     % (fmt_nats(summary.max_nats), fmt_share(summary.flip_risk)))
        for line in options.baseline_source.summary_lines():
            out.line(line)
        for check in options.checks:
            part = summary.checks.get(check.NAME)
            for line in part.lines(sizes) if part is not None else []:
                if isinstance(line, Bold):
                    out.bold(line)
                else:
                    out.line(line)


# What else explains what moved, by the verdict that says so, in any engine's terms; what an
# engine's own cache adds is its adapter's (CACHE_ADVICE)
VERDICT_ADVICE = {
    NOISE_NOT_RULED_OUT: "The server ignores the seed, so at this temperature every request "
    "samples on its own: the differences above may be sampling noise alone. Measure batching "
    "greedy (--temperature 0), or with the flag on, where the seed is honoured.",
    CACHE_CONFOUNDED: "Everything that moved, moved in requests the prefix cache served "
    "(cache hit in the table): the cache, not the batch, may explain it, and a request the "
    "cache served compares nothing about batching.",
    SERVED_ONLY: "Every request above batch 1 was served from the prefix cache (cache hit in "
    "the table), so no batched prefill was computed and nothing about batching was compared.",
    CACHE_UNKNOWN: "With --prefix-cache keep a request the cache served compares nothing, and "
    "the server did not say of any request above batch 1 that the cache left it cold: sweep "
    "with --prefix-cache bypass.",
    KEPT_CACHE_MOVED: "Everything that moved, moved in requests the prefix cache served "
    "(cache hit in the table, or its counters): the cache, not the batch, may explain it, and "
    "a request the cache served compares nothing about batching. Sweep with --prefix-cache "
    "bypass.",
    CACHE_UNCLEAR: "The cache served requests it was asked not to (cache hit in the table, or "
    "its counters), and of the requests compared the server did not say which it served "
    "(counters that lag or see other traffic say nothing of one batch). Sweep with --traffic "
    "concurrent, a request a prompt, on a server no one else uses.",
    BASELINE_SERVED: "Batch 1, the baseline every other size is compared with, was served from "
    "the prefix cache (an earlier request's prefill, or a cache the bypass did not keep apart): "
    "every comparison would be one with the cache, not with a computed batch 1. Sweep with "
    "--prefix-cache bypass on a server whose cache keys hold, or restart it.",
    NOT_REPEATABLE: "Batch 1 alone gave different answers on different passes: the server is not "
    "repeatable even without other requests beside it, so differences at other sizes cannot be "
    "put down to batching. Check for unseeded sampling, a server restarted between passes, or "
    "other traffic on it."}


# NOISE_NOT_RULED_OUT where the server takes the seed, but no run-to-run control checked it
UNCONTROLLED_ADVICE = (
    "At this temperature only the seed makes two samples of one prompt alike, and no run-to-run "
    "control checked that it does (batch 1 was not computed twice: one pass, a run stopped "
    "early, or a batch 1 the cache served): what moved may be sampling noise alone. Sweep with "
    "--repeat 2 or more, or greedy (--temperature 0).")


def sweep_advice(adapter: EngineAdapter, flag: Optional[bool], hazards: Optional[List[Json]],
                 expect: Optional[str], sizes: List[int], summary: SweepSummary,
                 text: Callable[[str], None]) -> None:
    """What to make of the verdict, once the table is out: why nothing was compared, what
    else explains what moved (with what the engine's own cache adds), or where to look
    next."""
    sweep_verdict = summary.verdict
    unmeasured = sweep_verdict in UNMEASURED_VERDICTS
    moved = sweep_verdict != INVARIANT and not unmeasured
    if sweep_verdict in VERDICT_ADVICE:
        text("")
        uncontrolled = sweep_verdict == NOISE_NOT_RULED_OUT and not summary.measured.unseeded
        advice = UNCONTROLLED_ADVICE if uncontrolled else VERDICT_ADVICE[sweep_verdict]
        engine = adapter.CACHE_ADVICE.get(sweep_verdict)
        text(advice + (" " + engine if engine else ""))
    elif unmeasured and sizes == [1] and any(k != CachePolicy.NAME for k in summary.checks):
        text("")
        text("Batch 1 only: this sweep ran for its checks, whose verdicts are above; it compared "
             "no batch with batch 1 (give --sizes with larger batches to compare batching).")
    elif unmeasured:
        text("")
        if sweep_verdict == NO_DATA:
            why = "no completion came back"
        elif summary.measured.unoverlapped or summary.measured.alone_sizes:
            why = ("at every size above batch 1 the scheduled requests were never in flight "
                   "together (each was answered before the next went out), so no batch was "
                   "formed; raise --request-rate, or leave it out for a burst")
        elif sizes == [1]:
            why = ("batch 1 was the only size, and it is the baseline; give --sizes with larger "
                   "batches")
        else:
            why = "the run stopped (%s) before any size above batch 1 came back" % summary.state
        text("Nothing was compared: %s. No verdict on invariance can be given." % why)
    elif moved and flag:
        text("")
        text("The server reports the flag ON, yet results moved.")
        if hazards:
            text("Its settings meet known hazards; rule these out first:")
            for line in hazard_lines({"hazards": hazards}):
                text(line)
        text(COVERAGE_CHECKLIST)
        text("If none applies, this is worth a bug report: attach the --save file.")
    if not moved and not unmeasured and (flag is not True or expect == "variant"):
        text(
            "Nothing moved. With the flag off that usually means no near-tie was met: try more "
            "prompts (--prompt-file), longer generations (--max-tokens 256), --temperature 0.6 or "
            "--traffic concurrent; see --mode help.")


def expect_invariant(summary: SweepSummary) -> Tuple[bool, str]:
    """--expect invariant (flag on): nothing moved, and something was compared."""
    if summary.verdict != INVARIANT:
        return False, ("expectation failed: --expect invariant, but the result is: %s"
                       % summary.verdict)
    if summary.batch1_repeatable is not True:  # NaN in batch 1: the control compared nothing
        return False, ("expectation failed: --expect invariant needs a repeatable batch 1 (the "
                       "run-to-run control), and its passes compared nothing")
    where = ""
    if summary.measured.served_sizes:
        where = "; %s served from the cache, not compared" % sizes_text(
            summary.measured.served_sizes)
    return True, "expect invariant: held (%d unique of %d, max ULP %d%s)" % (
        summary.unique_completions, summary.total_completions, summary.max_ulp, where)


def expect_variant(summary: SweepSummary) -> Tuple[bool, str]:
    """--expect variant (flag off, the negative control): batching moved something."""
    found = summary.verdict
    if found in BATCH_EFFECTS:
        return True, "expect variant: held (%s: %d unique of %d, max ULP %d)" % (
            found, summary.unique_completions, summary.total_completions, summary.max_ulp)
    if found in UNMEASURED_VERDICTS:
        why = "nothing was compared"
    elif found == INVARIANT:
        why = "nothing moved"
    else:
        why = "what moved is not put down to batching (%s)" % found
    return False, "expectation failed: --expect variant, but %s" % why


# --expect NAME of the sweep's own verdict: the rule that answers it, (held, the line)
SWEEP_EXPECTATIONS: Dict[str, Callable[[SweepSummary], Tuple[bool, str]]] = {
    "invariant": expect_invariant,
    "variant": expect_variant}


def check_expectation(check: SweepCheck, expect: str, summary: SweepSummary) -> Tuple[bool, str]:
    """--expect of a check's: held where its summary record says (held), the line written
    here from the record's words (WHAT it is, its evidence)."""
    part = summary.checks.get(check.NAME)
    if part is None or not part.held:
        return False, ("expectation failed: --expect %s, but the %s found: %s"
                       % (expect, part.WHAT if part else check.NAME,
                          part.verdict if part else NO_DATA))
    return True, "expect %s: held (%s)" % (expect, part.evidence)


def expectation(options: SweepOptions, summary: SweepSummary) -> Tuple[bool, str]:
    """--expect: the sweep's own rule, or the rule of the check that answers it."""
    if options.expect in SWEEP_EXPECTATIONS:
        return SWEEP_EXPECTATIONS[options.expect](summary)
    check = next(c for c in options.checks if options.expect in c.EXPECT)
    return check_expectation(check, options.expect, summary)


def run_sweep(cfg: Config, out: Out) -> int:
    """--mode sweep: learn the server's facts, open the checks, then for every prompt and pass
    send batch 1, then each other batch size, in the traffic shape asked for (Sender.shape),
    compare it with the baseline request by request (compare_batch), keep the row, then add
    each check's part, printing each size's row and saving as it goes; then the summary
    (sweep_summary), the saved document (sweep_document), the advice (sweep_advice) and the
    --expect rule. Returns the exit code."""
    options = cfg.sweep
    servers = [(cfg.url, "the server")] + options.baseline_source.servers()
    wait_until_ready(cfg, servers, out)
    cfg = resolve_engine(cfg, servers[:1])
    client, adapter = cfg.client(cfg.url), cfg.adapter
    facts = server_facts(cfg, cfg.url)
    refuse_what_cannot_fit(facts, cfg.sampling.max_tokens, options.prompt_tokens,
                           "--prompt-tokens")
    allowed = logprobs_limit(facts.max_logprobs)
    if allowed is not None and cfg.sampling.logprobs > allowed:
        raise UsageError("--logprobs %d is more top logprobs than the server allows (its "
                         "max_logprobs is %d): give at most %d"
                         % (cfg.sampling.logprobs, allowed, allowed))
    if options.prompt_tokens:
        built = built_prompt(client, adapter, facts, options.prompt_tokens)
        refuse_what_cannot_fit(facts, cfg.sampling.max_tokens, built.tokens,
                               "the built prompt (--prompt-tokens)")
        options = dataclasses.replace(options, prompts=[built.text], long_prompt=built)
        cfg = dataclasses.replace(cfg, sweep=options)
    sizes = sweep_ladder(options, facts)
    sweep_warnings(facts, sizes, None if options.sizes else options.max_batch, cfg.sampling, out)
    isolate = options.cache.bypass
    options.cache.open(adapter, client, facts)
    sender = Sender(client, adapter, facts.model_id, cfg.sampling, isolate, options.arrivals,
                    options.cache.watch, options.cache.off)
    run = SweepRun(cfg, facts, sender, out)
    options.baseline_source.open(run)
    header = [line for check in options.checks for line in check.open(run)]
    sweeps: List[PromptSweep] = []

    if cfg.save and finished_sweep(cfg.prior_save):
        keep_finished_sweep(cfg.save, out)
    saves = ThrottledSave(cfg.save, exclusive=True)
    # each batch weighs the completions it brings back (Progress's work): n, or under mixed
    # traffic the measured prompt's one (its fillers are not kept)
    kept = [1 if options.traffic == "mixed" else n for n in sizes]
    progress = Progress(out,
                        len(options.prompts) * options.repeat * len(sizes), "batches", cfg.quiet,
                        work=len(options.prompts) * options.repeat * sum(kept))
    table = None if cfg.json_out else SweepTable(cfg, out)
    if table:
        table.header(run, sizes, header)

    def save(path: str, state: str, summary: Optional[SweepSummary] = None) -> None:
        summary = summary or sweep_summary(options, sweeps, state)
        doc = sweep_document(cfg, facts, [], sizes, summary)
        write_json_atomic(path, doc, "prompts", [s.record_text() for s in sweeps])

    def one_batch(sweep: PromptSweep, where: str, n: int, pass_no: int) -> List[Completion]:
        """Send batch size n once (a check may take the send over), compare it with the
        baseline, add each check's part, and add the row to the prompt's sweep."""
        prompt = sweep.prompt
        try:
            adapter.before_batch(client, isolate)
            batch = sender.send(options.traffic, prompt, n, options.seed)
        except ServerError as err:
            raise ServerError("batch size %d%s: %s" % (n, where, err)) from None
        if n == 1 and sweep.baseline is None:  # the baseline is batch 1's, never another's
            sweep.set_baseline(batch.completions[0], "batch 1")
        row = dataclasses.replace(compare_batch(batch, sweep.baseline, adapter.logprob_clamps),
                                  pass_no=pass_no)
        # The row is kept before the checks send their own requests: whatever stops them
        # (a signal, a failure), what the batch measured is saved
        sweep.add(n, facts.bucket(n), row, batch.completions)
        watch = options.cache.watch
        if watch is not None and watch.uncounted_seen and not any(s.doubted for s in sweeps):
            for each in sweeps:  # once: the batches after are doubted as they are sent
                each.doubt()
        parts = {}
        for check in options.checks:
            part = check.batch_part(run, prompt, n, batch)
            if part is not None:
                parts[check.NAME] = part
                sweep.runs[n][-1] = dataclasses.replace(row, checks=dict(parts))
        return batch.completions

    def measure(interrupt: DeferredInterrupt) -> None:
        prompts = len(options.prompts)
        for pi, prompt in enumerate(options.prompts, 1):
            sweep = PromptSweep(prompt, unseeded=samples_unseeded(cfg.sampling, facts),
                                sampled=cfg.sampling.temperature > 0,
                                cache_kept=not options.cache.bypass, checks=options.checks)
            sweeps.append(sweep)
            baseline = options.baseline_source.batch1(prompt)
            if baseline is not None:
                sweep.set_baseline(*baseline)
            for pass_no in range(1, options.repeat + 1):
                where = " (prompt %d)" % pi if prompts > 1 else ""
                where += ", pass %d" % pass_no if options.repeat > 1 else ""
                for n in sizes:
                    interrupt.check()
                    step = ("prompt %d/%d, pass %d/%d, batch %d"
                            % (pi, prompts, pass_no, options.repeat, n))
                    progress.running(step)
                    count = len(one_batch(sweep, where, n, pass_no))
                    progress.finished(step, count)
                    if table and pass_no == options.repeat:
                        table.size_done(pi, prompts, sweep, n)
                    saves.offer(lambda path: save(path, "running"))
            sweep.finish()
            if table:
                table.prompt_done(pi, sweep)

    # A stop signal once measuring is over (from the moment the last batch is in) waits for
    # the save and the output: measuring's own handler gives way to this one
    with SavesFirst(out) as late:
        state, code = measure_until_stopped(out, "sweep", measure)
        summary = sweep_summary(options, sweeps, state)
        if code == EXIT_OK and options.expect:
            summary = dataclasses.replace(
                summary, expect=ExpectResult(options.expect, *expectation(options, summary)))
        saves.write(lambda path: save(path, state, summary))
        if table:
            table.finish(summary, sweeps)
        else:
            prompts = [as_record(s.record()) for s in sweeps]
            out.line(json_text(sweep_document(cfg, facts, prompts, sizes, summary), indent=1))
        if code == EXIT_OK:
            text = out.line if not cfg.json_out else out.note
            sweep_advice(adapter, facts.flag, facts.hazards, options.expect, sizes, summary,
                         text)
            if summary.expect is not None:
                text(summary.expect.said)
                code = EXIT_OK if summary.expect.held else EXIT_EXPECTATION
        code = report_save(cfg, saves, code, out)
    return code or late.code()


# ----------------------------------------------------------------------------
# --mode cost: what the flag costs, for one cell of the 2x2 table


@dataclass
class CostOptions:
    """--mode cost's own options, checked before any request (each field named as its
    option's argparse dest), and what one trial is (trial: BatchTrials or LoadTrials)."""

    sampling: Sampling
    invariant: str  # the flag-on arm's URL
    trial: Union[BatchTrials, LoadTrials]
    trials: int  # timed trial pairs at most
    warmup: int
    workload: str  # one of WORKLOADS
    prefix_tokens: int
    precision: Optional[float]  # stop once the interval's half-width is at most this
    tp: Optional[int]  # the label's TP degree when the server does not report it
    allow_mismatch: bool

    @staticmethod
    def add_arguments(group: argparse._ArgumentGroup) -> None:
        group.add_argument("--invariant", metavar="URL", help="the flag-on arm (required)")
        BatchTrials.add_arguments(group)
        group.add_argument("--trials", type=whole_number(1, MAX_TRIALS), default=DEFAULT_TRIALS,
                           help="timed requests per arm (default %d)" % DEFAULT_TRIALS)
        group.add_argument("--warmup", type=whole_number(0, MAX_TRIALS), default=DEFAULT_WARMUP,
                           help="discarded requests per arm (under load: whole trials of "
                           "--requests requests) (default %d)" % DEFAULT_WARMUP)
        group.add_argument(
            "--workload", choices=WORKLOADS, default="cold",
            help="cold: no prefix can be cached; shared-prefix: one long prefix for all")
        group.add_argument(
            "--prefix-tokens", type=whole_number(1, MAX_PROMPT_TOKENS),
            default=DEFAULT_PREFIX_TOKENS,
            help="length of the shared prefix (default about %d tokens)" % DEFAULT_PREFIX_TOKENS)
        LoadTrials.add_arguments(group)
        BenchServeResult.add_arguments(group)
        group.add_argument(
            "--precision", type=real_number(0.0, above=True), metavar="P",
            help="keep timing trial pairs until the overhead's 95%% interval is at most +-P "
            "points wide, or --trials is reached")
        group.add_argument("--tp", type=whole_number(1),
                           help="the TP degree the arms run at: it labels the cell, and an arm "
                           "that reports another degree is refused")
        group.add_argument(
            "--allow-mismatch", action="store_true",
            help="time even when the two servers differ in more than the flag (the result "
            "records the differences)")

    @classmethod
    def from_args(cls, args: argparse.Namespace, url: str) -> "CostOptions":
        if not args.invariant:
            raise UsageError("cost mode needs --invariant URL, the flag-on server")
        invariant = check_url(args.invariant, "--invariant")
        if server_address(invariant) == server_address(url):
            raise UsageError("--url and --invariant are the same server; cost compares two")
        max_tokens = DEFAULT_COST_TOKENS if args.max_tokens is None else args.max_tokens
        return options_from(
            cls, args, sampling=Sampling.of(0.0, max_tokens, None, DEFAULT_SEED, ignore_eos=True),
            invariant=invariant,
            trial=LoadTrials.from_args(args) or BatchTrials(args.batch or DEFAULT_BATCH))


@dataclass(frozen=True)
class ArmStats:
    """The timed trials of one cost arm."""

    median_s: float
    mad_s: float
    min_s: float
    max_s: float
    samples_s: List[float]  # seconds of each trial
    output_tokens: List[int]  # of each trial
    tokens_per_s: List[float]  # of each trial that took any time, rounded to 3 places
    median_tokens_per_s: Optional[float]
    noisy: bool  # max/min above NOISE_SPREAD

    @classmethod
    def of(cls, samples_s: List[float], output_tokens: List[int]) -> "ArmStats":
        rates = [t / s for t, s in zip(output_tokens, samples_s) if s > 0]
        low, high = min(samples_s), max(samples_s)
        return cls(median_s=statistics.median(samples_s), mad_s=mad(samples_s), min_s=low,
                   max_s=high, samples_s=list(samples_s), output_tokens=list(output_tokens),
                   tokens_per_s=[round(x, 3) for x in rates],
                   median_tokens_per_s=statistics.median(rates) if rates else None,
                   noisy=high / low > NOISE_SPREAD if low > 0 else True)


def label_of(record: Any, name: str) -> Any:
    """One label of a saved record that may not be a record at all."""
    return record.get(name) if isinstance(record, dict) else None


# The settings a cell's identity names in words (CellIdentity.text) wherever they are known:
# the ones users change between arms to compare them
KEY_SETTINGS = ("attention backend", "dtype", "quantization", "KV-cache dtype", "max num seqs",
                "max running requests")
TP_SETTINGS = ("TP size",)  # what differs between the rows of one 2x2 table
# SGLang sizes its decode CUDA graphs by the TP degree where it is not told their size (on an
# H200 up to 256 below TP 4, 512 from TP 4: python/sglang/srt/arg_groups/memory_hook.py,
# 0.5.23 lines 147-159), so there they go with the table's rows as the degree does
TP_SETTINGS_OF = {"sglang": TP_SETTINGS + ("CUDA-graph sizes", "CUDA-graph max bs",
                                           "CUDA-graph max bs (old)")}


def setting_text(value: Any) -> str:
    """A reported setting as an identity holds it: a string as it is, anything else as JSON
    (keys sorted), so that equal values compare equal and any value can be a key."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, sort_keys=True)
    except (ValueError, TypeError):
        return repr(value)


@dataclass(frozen=True)
class CellIdentity:
    """Everything a cost cell was measured under, read from the cell's own record (this run's
    or any saved file's): two cells of one identity are one measurement, and the newer
    replaces the older; cells that differ in anything here are kept side by side. run.py's
    cost file and table, the experiment's REPORT, compare.py and plot_cost.py all tell cells
    apart by it (cell_key). Besides the cell's own labels it holds each arm's flag as the lab
    read it, the TP degree each arm reported (the label may be the one asked with --tp) and
    every setting the lab compares between arms (ServerFacts.settings: attention backend,
    dtype, quantization, KV-cache dtype, max num seqs and the rest), so that a cell measured
    on other settings never replaces one of these."""

    engine: Optional[str]
    releases: Tuple[Any, Any]  # each arm's release as it reported it (off, on)
    model: Optional[str]
    tp: Optional[int]  # the cell's label: the degree asked (--tp), else the one reported
    workload: Optional[str]
    prefix_tokens: Optional[int]  # shared-prefix only
    batch: Optional[int]  # batch trials
    concurrency: Optional[int]  # load trials
    requests: Optional[int]  # load trials: requests a trial
    arrivals: Optional[str]  # load trials, the rate exact (a file that does not say: a burst)
    max_tokens: Optional[int]
    mismatched: bool  # timed despite settings that differ between the arms (--allow-mismatch)
    flags: Tuple[Any, Any] = (False, True)  # each arm's flag as the lab read it (None: unknown)
    tp_reported: Tuple[Any, Any] = (None, None)  # each arm's TP as it reported it
    # (label, the flag-off arm's value, the flag-on arm's) of every setting either arm
    # reported, each value as JSON text (None: that arm did not report it)
    settings: Tuple[Tuple[str, Optional[str], Optional[str]], ...] = ()

    @classmethod
    def of(cls, record: Json) -> "CellIdentity":
        """A saved cell's identity: whatever the record holds, read without raising (a
        missing or malformed label is None)."""
        def label(name: str) -> Any:
            value = record.get(name)
            return value if value is None or isinstance(value, (str, int, float)) else repr(value)

        servers = record.get("servers") if isinstance(record.get("servers"), dict) else {}
        arms = [servers.get(arm) if isinstance(servers.get(arm), dict) else {}
                for arm in ("off", "on")]
        # a release as any label: text or a number kept, anything else in words (hashable)
        releases = tuple(v if v is None or isinstance(v, (str, int, float)) else repr(v)
                         for v in (label_of(arm, "version") for arm in arms))
        flags = tuple(arm.get("flag") if isinstance(arm.get("flag"), bool) else None
                      for arm in arms)
        tp_reported = tuple(arm.get("tp") if is_count(arm.get("tp")) else None for arm in arms)
        reported = [arm.get("settings") if isinstance(arm.get("settings"), dict) else {}
                    for arm in arms]
        settings = tuple(
            (str(name),) + tuple(setting_text(each[name]) if name in each else None
                                 for each in reported)
            for name in sorted(set(reported[0]) | set(reported[1]), key=str))
        load = label("concurrency")
        return cls(engine=label("engine"), releases=releases, model=label("model"),
                   tp=label("tp"), workload=label("workload"),
                   prefix_tokens=label("prefix_tokens") if record.get("workload") != "cold"
                   else None,
                   batch=None if load else label("batch"), concurrency=load,
                   requests=label("requests") if load else None,
                   arrivals=(label("arrivals") or "burst") if load else None,
                   max_tokens=label("max_tokens"), mismatched=bool(record.get("differences")),
                   flags=flags, tp_reported=tp_reported, settings=settings)

    def table_group(self) -> "CellIdentity":
        """What the 2x2 table's cells share: all but TP (asked and reported), the workload
        and the settings that go with the TP degree."""
        return dataclasses.replace(
            self, tp=None, workload=None, prefix_tokens=None, tp_reported=(None, None),
            settings=tuple(s for s in self.settings
                           if s[0] not in TP_SETTINGS_OF.get(self.engine, TP_SETTINGS)))

    def within(self, read: Optional[Set[str]]) -> "CellIdentity":
        """The identity holding only the settings in read (settings_read_by_all: those every
        cell of its file was saved with), all of them where read is None."""
        if read is None:
            return self
        return dataclasses.replace(self, settings=tuple(s for s in self.settings
                                                        if s[0] in read))

    def across_releases(self) -> "CellIdentity":
        """The identity less what an engine upgrade changes by itself (the release and the
        settings each arm reports): what compare.py matches a cell across two files by."""
        return dataclasses.replace(self, releases=(None, None), tp_reported=(None, None),
                                   settings=())

    def parts(self) -> Dict[str, str]:
        """Each part of the identity in words, by name; a setting's part is named after it
        ("setting attention backend") and holds its value alone (each arm's where they
        differ, "off / on")."""
        off, on = self.releases
        parts = {"engine": self.engine or "engine ?",
                 "release": fmt_opt(off, "release ?") if off == on else "%s / %s" % (off, on),
                 "model": "model %s" % self.model, "TP": "TP=%s" % fmt_opt(self.tp, "?")}
        if self.tp_reported != (None, None) and self.tp_reported != (self.tp, self.tp):
            parts["TP reported"] = "the arms report TP %s" % " / ".join(
                fmt_opt(tp, "?") for tp in self.tp_reported)
        if self.workload is not None:
            parts["workload"] = self.workload
        if self.prefix_tokens is not None:
            parts["prefix"] = "%s prefix tokens" % self.prefix_tokens
        if self.concurrency:  # the arrivals named, a burst too: two shapes of one concurrency
            parts["trials"] = ("concurrency %s, %s requests a trial, %s"
                               % (self.concurrency, self.requests, self.arrivals))
        else:
            parts["trials"] = "batch %s" % self.batch
        parts["tokens"] = "%s tokens" % self.max_tokens
        if self.flags != (False, True):
            parts["flags"] = "flags as read: %s" % " / ".join(
                {None: "unknown", True: "on", False: "off"}[f] for f in self.flags)
        if self.mismatched:
            parts["mismatch"] = "arms mismatched (--allow-mismatch)"
        for name, off_value, on_value in self.settings:
            shown = fmt_opt(off_value, "unknown")
            if on_value != off_value:
                shown += " / " + fmt_opt(on_value, "unknown")
            parts["setting " + name] = shown
        return parts

    def differing(self, other: "CellIdentity") -> List[str]:
        """The names of the parts in which two identities differ (parts())."""
        mine, theirs = self.parts(), other.parts()
        return [name for name in list(mine) + [n for n in theirs if n not in mine]
                if mine.get(name) != theirs.get(name)]

    def text(self, settings: Sequence[str] = KEY_SETTINGS, release: bool = True) -> str:
        """The identity in words, as a replaced cell or a table heading names it: its labels,
        and of the settings those named (by default the ones users compare most); without
        the release where cells are matched across releases (compare.py)."""
        parts = self.parts()
        for name in list(parts):
            if name.startswith("setting "):
                label = name[len("setting "):]
                if label in settings:
                    parts[name] = "%s %s" % (label, parts[name])
                else:
                    del parts[name]
        head = parts.pop("engine")
        shown_release = parts.pop("release")
        if release:
            head += " " + shown_release
        if self.workload is None:  # a table's group: TP and the workload are its rows, columns
            parts.pop("TP")
        return ", ".join([head] + list(parts.values()))


@dataclass(frozen=True)
class CellLabels:
    """What names a cost cell and what the 2x2 table shows of it, read alike from this run's
    cell and from any cell already in the cost file."""

    tp: Optional[int]
    workload: str
    trial: TrialLabels
    max_tokens: int
    model: str
    state: Optional[str]  # None in files of labs that did not save it
    overhead: Overhead  # the primary one

    @classmethod
    def from_record(cls, record: Json,
                    read: Optional[Dict[Any, Set[str]]] = None) -> "CellLabels":
        """read: the settings its file's cells were all saved with (cell_key)."""
        return cls(record.get("tp"), record["workload"], TrialLabels.from_record(record),
                   record["max_tokens"], record["model"], record.get("state"),
                   Overhead.from_record(record), cell_key(record, read))

    identity: "CellIdentity"  # everything it was measured under


@dataclass(frozen=True)
class CostCell:
    """One labelled cell of the 2x2 table: both arms' trials, what the flag costs, and where
    it was measured; saved as the cost file's cell."""

    tp: Optional[int]
    workload: str
    batch: Optional[int]  # None for load trials
    max_tokens: int
    trials: int  # complete trial pairs
    warmup: int
    model: str
    engine: str
    prefix_tokens: Optional[int]  # shared-prefix only
    off: ArmStats
    on: ArmStats
    servers: Json  # arm name -> its server facts' record, with its URL
    differences: List[SettingDifference]  # between the arms, other than the flag's own
    state: str
    created: str  # when the cell was made
    lab: Json  # provenance
    overhead: Overhead = field(metadata=saved(flat=""))  # the primary one
    ratios: List[float]  # the primary overhead's, on/off pair by pair
    compared_on: str  # what the primary overhead's ratio is of
    under_load: Optional[LoadCell] = field(default=None, metadata=saved(flat=""))  # load trials
    # --precision: "precision", "trials", or the stop
    stopped_by: Optional[str] = field(default=None, metadata=saved(omit_none=True))


@dataclass
class Arm:
    """One server of a cost comparison, and what was timed on it."""

    name: str  # "off" or "on": the flag it should report
    option: str  # the option that named it
    url: str
    client: HttpClient
    facts: ServerFacts
    samples: List[float] = field(default_factory=list)  # seconds of each timed trial
    tokens: List[int] = field(default_factory=list)  # output tokens of each timed trial
    timings: List[List[RequestTiming]] = field(default_factory=list)  # load trials, by trial

    @classmethod
    def open(cls, cfg: Config, name: str, option: str, url: str) -> "Arm":
        facts = server_facts(cfg, url, "the flag-%s arm (%s)" % (name, option))
        return cls(name, option, url, cfg.client(url), facts)

    def run(self, cfg: Config, prompts: List[str]) -> Tuple[float, int, Optional[List[Any]]]:
        """One trial of the kind cost mode times (BatchTrials or LoadTrials) on this arm."""
        return cfg.cost.trial.run(self, prompts, cfg.adapter, cfg.sampling)


def settings_read_by_all(records: Sequence[Any]) -> Dict[Any, Set[str]]:
    """Per engine and releases, the settings that every arm of records that showed its
    settings reported: a setting a cell's record does not hold (the lab read it only from a
    later version on) is unknown there, never a difference, so the identities of one file's
    cells hold only these (cell_key's read). Per release, so that a release that reports
    fewer settings never merges two cells of another; arms that hid their settings are left
    out: they hold a few labels only and are told apart by their unknown flag."""
    read: Dict[Any, Set[str]] = {}
    for record in records:
        if not isinstance(record, dict):
            continue
        identity = CellIdentity.of(record)
        engine_release = (identity.engine, identity.releases)
        servers = label_of(record, "servers")
        for arm in ("off", "on"):
            facts = label_of(servers, arm)
            reported = label_of(facts, "settings")
            hidden = isinstance(facts, dict) and "info_source" in facts and \
                facts["info_source"] is None  # a file older than info_source did not hide
            if hidden or not isinstance(reported, dict) or not reported:
                continue
            labels = {str(name) for name in reported}
            read[engine_release] = (read[engine_release] & labels if engine_release in read
                                    else labels)
    return read


def same_measurement(record: Json, other: Json, read: Dict[Any, Set[str]]) -> bool:
    """Whether a saved cell is the measurement another repeats, so that one replaces the
    other: one key (cell_key with read), and every setting both records hold alike (a
    setting only one holds is unknown on the other; two values are two measurements, even
    where a third cell of the file that lacks the setting leaves it out of the key)."""
    if cell_key(record, read) != cell_key(other, read):
        return False
    theirs = {s[0]: s[1:] for s in cell_key(other).settings}
    return all(theirs.get(s[0], s[1:]) == s[1:] for s in cell_key(record).settings)


def cell_key(record: Json, read: Optional[Dict[Any, Set[str]]] = None) -> "CellIdentity":
    """What makes two saved cells the same measurement (CellIdentity); read: the settings
    that every cell the record is told apart from (its file's, with it) holds
    (settings_read_by_all), the only ones the identity then holds."""
    identity = CellIdentity.of(record)
    if read is None:
        return identity
    return identity.within(read.get((identity.engine, identity.releases)))


def print_cost_servers(off: ServerFacts, on: ServerFacts, differences: List[SettingDifference],
                       adapter: EngineAdapter, out: Out) -> None:
    differing = {d.setting for d in differences}
    labels = sorted(off.settings.keys() | on.settings.keys())
    # the label column as wide as its longest label (the flag's own name included), never cut
    width = max([24, len(adapter.flag_name)] + [len(label) for label in labels])
    row = "%%-%ds %%-26s %%-26s%%s" % width
    show = {None: "unknown", True: "on", False: "off"}
    out.line(row % ("setting", "--url (flag off)", "--invariant (flag on)", ""))
    out.line(row % (adapter.flag_name, show.get(off.flag, str(off.flag)),
                    show.get(on.flag, str(on.flag)), ""))
    for label in labels:
        a, b = off.settings.get(label), on.settings.get(label)
        if a is None and b is None:
            continue
        if label not in off.settings or label not in on.settings:
            mark = "  (unknown on one arm)"
        elif label in differing:
            mark = "  <- differs"
        else:
            mark = "  (set by the flag)" if a != b else ""
        shown = [fmt_setting(v) if label in arm.settings else "unknown"
                 for v, arm in ((a, off), (b, on))]
        out.line(row % (label, shown[0], shown[1], mark))


def unverified_flags(arms: Sequence[Any]) -> str:
    """The arms (Arm, or a cell's arm name) whose flag the lab could not read, in words."""
    names = [arm if isinstance(arm, str) else arm.name for arm in arms]
    options = {"off": "--url", "on": "--invariant"}
    return "the flag%s of %s %s unknown (the server does not say)" % (
        "s" if len(names) > 1 else "",
        " and ".join("the flag-%s arm (%s)" % (name, options[name]) for name in names),
        "are" if len(names) > 1 else "is")


def check_arms(cfg: Config, off: Arm, on: Arm, out: Out) -> List[SettingDifference]:
    """Refuse arms the wrong way round or differing in more than the flag; print their settings."""
    adapter = cfg.adapter
    if off.facts.flag is True or on.facts.flag is False:
        raise UsageError(
            "the arms are the wrong way round: --url reports the %s and --invariant reports the %s"
            % (describe_flag(off.facts.flag, adapter), describe_flag(on.facts.flag, adapter)))
    asked = cfg.cost.tp
    for arm in (off, on):
        reported = arm.facts.tp
        if asked is not None and is_count(reported) and reported != asked:
            raise UsageError("--tp %d, but the flag-%s arm (%s) reports TP %d: the cell would be "
                             "labelled with a degree it was not measured at"
                             % (asked, arm.name, arm.option, reported))
    differences = SettingDifference.between(off.facts, on.facts, ("off", "on"), flag_own=True)
    unknown = [arm for arm in (off, on) if arm.facts.flag is None]
    if unknown:
        out.warn("%s: the figure will be of --invariant against --url, not a verified flag-on "
                 "arm against a flag-off one" % unverified_flags(unknown))
    for arm in (off, on):
        if arm.facts.info_source is None:
            out.warn("the %s arm does not expose its settings, so the lab cannot check that the "
                     "arms differ in the flag only (%s)" % (arm.name, arm.facts.settings_hint))
    if not cfg.json_out:
        print_cost_servers(off.facts, on.facts, differences, adapter, out)
        for arm in (off, on):
            for line in hazard_lines(as_record(arm.facts), "flag-%s arm: " % arm.name):
                out.line(line.strip())
    if differences and not cfg.cost.allow_mismatch:
        raise UsageError(
            "the two servers differ in more than the flag (%s); pin them equal, or pass "
            "--allow-mismatch to time them anyway" % ", ".join(d.setting for d in differences))
    return differences


def table_cells(cells: Sequence[CellLabels],
                current: CellLabels) -> Tuple[CellIdentity, Optional[int], List[CellLabels]]:
    """The 2x2 table current belongs to: its group (the identity but for TP and the workload,
    CellIdentity.table_group), the one prefix length of its shared-prefix column (current's,
    else the newest shared-prefix cell's of the group), and its cells."""
    group = current.identity.table_group()
    same = [c for c in cells if c.identity.table_group() == group]
    prefix = current.identity.prefix_tokens
    if prefix is None:
        shared = [c for c in same if c.workload == "shared-prefix"]
        prefix = shared[-1].identity.prefix_tokens if shared else None
    same = [c for c in same if c.workload != "shared-prefix" or c.identity.prefix_tokens == prefix]
    return group, prefix, same


def cost_tables(cells: Sequence[CellLabels]) -> List[Tuple[CellIdentity, Optional[int],
                                                            List[CellLabels]]]:
    """Every 2x2 table of a file's cells (table_cells), the newest cell's first."""
    tables: List[Tuple[CellIdentity, Optional[int], List[CellLabels]]] = []
    for cell in reversed(cells):
        group, prefix, same = table_cells(cells, cell)
        if not any(g == group and p == prefix for g, p, _ in tables):
            tables.append((group, prefix, same))
    return tables


def table_heading(cells: Sequence[CellLabels], group: CellIdentity,
                  prefix: Optional[int]) -> str:
    """What a table's cells share, naming every part that tells them from the file's other
    tables: engine, release, model, trials, tokens, every setting in which another table
    differs, and the shared-prefix column's prefix length."""
    named: Set[str] = set()
    for other in {c.identity.table_group() for c in cells} - {group}:
        named.update(part[len("setting "):] for part in group.differing(other)
                     if part.startswith("setting "))
    shared_prefix = "" if prefix is None else ", shared prefix of %s tokens" % prefix
    return group.text(sorted(named)) + shared_prefix


def table_slot(same: Sequence[CellLabels], tp: Any, workload: str,
               current: Optional[CellLabels] = None) -> Optional[CellLabels]:
    """The cell a table shows for a TP degree and workload: the current one where it fits,
    else the newest."""
    found = [c for c in same if c.tp == tp and c.workload == workload]
    return current if current in found else (found[-1] if found else None)


def table_degrees(same: Sequence[CellLabels]) -> List[Any]:
    """A table's rows: TP=1, then every other degree measured (TP=k until one is), then TP=?
    for cells measured without a known degree."""
    tps: List[Any] = sorted({c.tp for c in same if c.tp not in (1, None)}) or ["k"]
    if any(c.tp is None for c in same):
        tps.append(None)
    return [1] + tps


def release_notes_of(cells: Sequence[CellLabels], same: Sequence[CellLabels]) -> List[str]:
    """The release notes (tp_cost_release_notes) a table's TP cells call for: its own cells,
    each arm's release, and the file's cells of the same table measured on another release
    (one table holds one release; these are the cells a reader holds against it)."""
    if not same:
        return []
    group = same[0].identity.table_group().across_releases()
    shown = list(same) + [c for c in cells if c not in same
                          and c.identity.table_group().across_releases() == group]
    return tp_cost_release_notes(same[0].identity.engine,
                                 [(version, c.tp) for c in shown
                                  for version in c.identity.releases])


def cost_table_lines(cells: List[CellLabels], current: CellLabels) -> List[str]:
    """The 2x2 table TP=1 / TP=k x cold / shared-prefix of the current cell (table_cells),
    under a heading that names what tells it from the file's other tables."""
    group, prefix, same = table_cells(cells, current)
    lines = ["cost cells for %s (from the saved file):" % table_heading(cells, group, prefix),
             "  %-8s %-28s %-28s" % ("", *WORKLOADS)]
    filled = marked = 0
    for tp in table_degrees(same):
        row = []
        for workload in WORKLOADS:
            cell = table_slot(same, tp, workload, current)
            filled += cell is not None
            if cell is None:
                row.append("missing")
                continue
            overhead = cell.overhead.text("%+.1f%% [%+.1f, %+.1f]%s", "%+.1f%% (no interval)",
                                          " n.s.")
            ci = cell.overhead.ci95_pct
            faster = bool(ci) and ci[1] < 0  # flag_on_faster: the whole interval below 0
            marked += faster
            row.append(overhead + (" *" if faster else "")
                       + ("" if cell.state == "complete" else " partial"))
        lines.append("  %-8s %-28s %-28s" % ("TP=%s" % ("?" if tp is None else tp), *row))
    if marked:
        lines.append("* the flag-on arm measured faster: check the arms' flags as the lab read "
                     "them, the warm-up, and which URL is which")
    if filled < 4:
        lines.append("One cell alone is not a result: report all four (TP=1 and your real TP, "
                     "cold and shared-prefix), or none.")
    return lines + release_notes_of(cells, same)


def warm_up(cfg: Config, arms: Sequence[Arm], prompts: Callable[[int], List[str]],
            interrupt: DeferredInterrupt, progress: Progress) -> None:
    """Untimed requests on both arms; each may fail once (a server still settling)."""
    for w in range(cfg.cost.warmup):
        for arm in arms:
            for attempt in range(1, WARMUP_ATTEMPTS + 1):
                interrupt.check()
                progress.running("warm-up %d/%d, %s arm" % (w + 1, cfg.cost.warmup, arm.name))
                try:
                    arm.run(cfg, prompts(-1 - w))
                    break
                except ServerError as err:
                    if attempt == WARMUP_ATTEMPTS:
                        raise ServerError("warm-up %d, %s arm: %s" %
                                          (w + 1, arm.name, err)) from None
                    progress.out.warn("warm-up request failed on the %s arm (%s); retrying once, "
                                      "as only warm-up may" % (arm.name, err))


def per_token(arm: Arm, pairs: int) -> List[float]:
    return [seconds / tokens if tokens > 0 else math.inf
            for seconds, tokens in zip(arm.samples[:pairs], arm.tokens[:pairs])]


def primary_overhead(off: Arm, on: Arm) -> Tuple[Overhead, str]:
    """The overhead a cell reports first, over the complete trial pairs, and what its ratio is
    of: the time per trial, or, where the arms produced different token counts, the time per
    output token (what both did)."""
    pairs = min(len(off.samples), len(on.samples))
    if off.tokens[:pairs] == on.tokens[:pairs]:
        return Overhead.of(off.samples[:pairs], on.samples[:pairs]), "time per trial"
    return (Overhead.of(per_token(off, pairs), per_token(on, pairs)),
            "time per output token (the arms produced different token counts)")


def precise_enough(off: Arm, on: Arm, points: float) -> bool:
    """Is the reported overhead's 95% interval (primary_overhead: the figure the cell shows)
    at most +-points wide yet? Stopping on it biases the estimate little here: the rule looks
    at the interval's width, which does not depend on where the median lies, only on the
    spread of the ratios, so it does not stop when the estimate happens to look large or
    small."""
    if min(len(off.samples), len(on.samples)) < MIN_PAIRS_FOR_INTERVAL:
        return False
    ci = primary_overhead(off, on)[0].ci95_pct
    return ci is not None and (ci[1] - ci[0]) / 2.0 <= points


def cost_cell(cfg: Config, arms: Tuple[Arm, Arm], differences: List[SettingDifference],
              state: str) -> CostCell:
    """One labelled cell of the 2x2 table, from the trials measured so far."""
    options, (off, on) = cfg.cost, arms
    pairs = min(len(off.samples), len(on.samples))
    primary, compared_on = primary_overhead(off, on)
    batch, under_load = options.trial.cell_parts(arms, pairs, primary)
    return CostCell(
        tp=options.tp if options.tp is not None else off.facts.tp, workload=options.workload,
        batch=batch,
        max_tokens=cfg.sampling.max_tokens, trials=pairs, warmup=options.warmup,
        model=off.facts.model, engine=cfg.engine,
        prefix_tokens=options.prefix_tokens if options.workload == "shared-prefix" else None,
        off=ArmStats.of(off.samples, off.tokens), on=ArmStats.of(on.samples, on.tokens),
        servers={arm.name: dict(as_record(arm.facts), url=arm.url) for arm in arms},
        differences=differences, state=state, created=now_stamp(),
        lab=dict(cfg.provenance, ended=None if state == "running" else now_stamp()),
        overhead=primary, ratios=primary.ratios, compared_on=compared_on, under_load=under_load)


def add_cell(doc: Json, cell: Json) -> Json:
    """Put a cell's record in the cost file, replacing the one with the same key; an
    unfinished run never replaces a finished cell (it is kept under "incomplete_cells")."""
    doc.setdefault("cells", [])
    read = settings_read_by_all(doc["cells"] + (doc.get("incomplete_cells") or []) + [cell])
    finished = any(same_measurement(c, cell, read) and c.get("state") == "complete"
                   for c in doc["cells"])
    section = "incomplete_cells" if finished and cell["state"] != "complete" else "cells"
    doc[section] = [c for c in doc.get(section, [])
                    if not same_measurement(c, cell, read)] + [cell]
    return doc


def replaced_cell_line(old: Json, new: Json, path: str,
                       read: Optional[Dict[Any, Set[str]]] = None) -> str:
    """What a user reads when a cell replaces a saved one: what the two share (their
    identity, every compared setting of both arms) and what differs (when, by which code,
    on which servers, and what they measured); read: as cell_key's."""
    identity = cell_key(new, read)
    changed = []
    for what, value in (("overhead", lambda c: fmt_opt(label_of(c, "overhead_pct"), "none",
                                                      "%+.1f%%")),
                        ("trial pairs", lambda c: fmt_opt(label_of(c, "trials"), "?")),
                        ("code", lambda c: fmt_opt(label_of(label_of(c, "lab"), "code"), "?")),
                        ("flag-off URL", lambda c: fmt_opt(label_of(dig(c, "servers", "off"),
                                                                    "url"), "?")),
                        ("flag-on URL", lambda c: fmt_opt(label_of(dig(c, "servers", "on"),
                                                                   "url"), "?"))):
        before, after = value(old), value(new)
        if before != after:
            changed.append("%s %s, now %s" % (what, before, after))
    return ("--save: this cell replaces the one saved %s in %s: both measured under %s and "
            "the same %d settings on each arm; what differs: %s"
            % (fmt_opt(old.get("created"), "earlier"), path, identity.text(),
               len(identity.settings), "; ".join(changed) or "nothing but when"))


def save_cell(path: str, cell: Json) -> Json:
    """Add a cell's record to the cost file as it is now, under a lock: two runs saving to
    one file each keep their cells. Returns the document written."""
    with FolderLock(path):
        try:
            current = read_json_file(path, "--save") if os.path.exists(path) else None
        except UsageError as err:
            raise SaveError(str(err)) from None
        if current is not None and current.get("schema") != COST_SCHEMA:
            raise SaveError("--save: %s no longer holds cost results; not overwritten" % path)
        doc = add_cell(current or {"schema": COST_SCHEMA, "cells": []}, cell)
        write_json_atomic(path, doc)
        return doc


STOPPED_BY = {  # what ended a --precision run, as the report says it
    "precision": "stopped once the interval was within the asked precision (--precision)",
    "trials": "ran every trial (--trials) before the interval was within --precision"}


def flag_on_faster(cell: Json) -> List[str]:
    """What to check, line by line, when a cell's flag-on arm measured faster: its overhead's
    95% interval lies wholly below zero (none otherwise). The flag costs time on every engine
    the lab has measured; a faster flag-on arm on a GPU has meant swapped arms, a flag that is
    not on, or one arm warm and the other cold. run.py's report and plot_cost.py say it."""
    ci = label_of(cell, "ci95_pct")
    if not (isinstance(ci, list) and len(ci) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in ci) and ci[1] < 0):
        return []
    adapter = ADAPTERS.get(label_of(cell, "engine"))
    servers = label_of(cell, "servers")
    flags = []
    for name, option in (("off", "--url"), ("on", "--invariant")):
        arm = label_of(servers, name)
        flag = label_of(arm, "flag")
        flag = flag if isinstance(flag, bool) else None
        read = describe_flag(flag, adapter) if adapter else fmt_opt(flag, "flag unknown",
                                                                        "flag %s")
        flags.append("%s %s: %s" % (option, fmt_opt(label_of(arm, "url"), "?"), read))
    warmup = fmt_opt(label_of(cell, "warmup"), "?")
    # a batch trial is one request; under load a warm-up is a whole trial of --requests
    discarded = ("%s warm-up trial(s) of %s requests an arm were" % (warmup, fmt_opt(
        label_of(cell, "requests"), "?")) if label_of(cell, "concurrency") else
        "%s request(s) an arm were" % warmup)
    return ["the flag-on arm measured faster (the whole interval lies below 0): on a GPU that "
            "has meant swapped arms, a flag that is not on, or one arm warm and the other cold",
            "check the flags as the lab read them: " + "; ".join(flags),
            "check the warm-up: %s discarded (--warmup); a cold arm is slower" % discarded,
            "check which URL is which: --url is the flag-off server, --invariant the flag-on"]


def print_cost_report(cell: CostCell, labels: CellLabels, out: Out) -> None:
    out.line("")
    state = "" if labels.state == "complete" else " (%s)" % labels.state
    out.line("cell: TP=%s, workload %s, %s, %d tokens, model %s, %d trial pairs%s"
             % (fmt_opt(labels.tp, "?"), labels.workload, labels.trial.shape(), labels.max_tokens,
                labels.model, cell.trials, state))
    for name, arm in (("off", cell.off), ("on", cell.on)):
        out.line("  flag %-3s median %.4fs  MAD %.4fs  min-max %.4f-%.4fs  %s tokens/s%s" %
                 (name, arm.median_s, mad(arm.samples_s), min(arm.samples_s), max(arm.samples_s),
                  "%.1f" % arm.median_tokens_per_s if arm.median_tokens_per_s else "?",
                  "  NOISY (max/min > %.1f)" % NOISE_SPREAD if arm.noisy else ""))
    without = "%%+.1f%%%%, no interval: %d trial pairs, an interval needs at least %d" % (
        cell.trials, MIN_PAIRS_FOR_INTERVAL)
    out.bold("  overhead " + cell.overhead.text("%+.1f%%, 95%% interval [%+.1f%%, %+.1f%%]%s",
                                                without,
                                                ": not significant (the interval contains 0)"))
    for line in flag_on_faster(as_record(cell)):
        out.line("  " + line)
    unknown = [name for name in ("off", "on") if label_of(cell.servers.get(name), "flag") is None]
    if unknown:
        out.line("  %s: the overhead above is of the --invariant arm over the --url arm, not "
                 "verified flag-on over flag-off" % unverified_flags(unknown))
    if cell.under_load:
        cell.under_load.report(cell.compared_on, out)
    if cell.stopped_by:
        out.line("  " + STOPPED_BY.get(cell.stopped_by, "stopped: %s" % cell.stopped_by))
    if cell.differences:
        out.line("  timed despite differences (--allow-mismatch): "
                 + ", ".join("%s %s vs %s" % (d.setting, d.side("off"), d.side("on"))
                             for d in cell.differences))


# A piece of text a tokenizer makes at least one token of: a word, a digit (many tokenizers
# split numbers digit by digit), any other visible character
TOKEN_PIECE = re.compile(r"[A-Za-z]+|[0-9]|[^\sA-Za-z0-9]")


def longest_cost_prompt(cfg: Config) -> Tuple[int, str]:
    """The tokens, counted as TOKEN_PIECE counts them, of the longest prompt a cost run will
    send (warm-up and trials alike), and what built it: the prefix's filler words are about a
    token each, as --prefix-tokens promises; the preamble, the question and their numbers
    count at least a token a piece, so a prompt that only just fits is not let through."""
    options = cfg.cost
    trials = [-1 - w for w in range(options.warmup)][-1:] + [options.trials - 1]
    longest = max(len(TOKEN_PIECE.findall(prompt))
                  for trial in trials
                  for prompt in workload_prompts(options.workload, options.trial.prompts, trial,
                                                 "0" * 8, options.prefix_tokens)[-1:])
    if options.workload == "shared-prefix":
        return longest, ("the built prompt (--prefix-tokens %d with the lab's preamble and "
                         "question)" % options.prefix_tokens)
    return longest, "the built prompt (the %s workload's)" % options.workload


def run_cost(cfg: Config, out: Out) -> int:
    """--mode cost: open both arms and refuse them unless they differ in the flag alone,
    warm up, then time trial pairs in A B B A order (BatchTrials or LoadTrials, decided
    once) until --trials or --precision; the cell (cost_cell; CostCell is its
    schema) is added to the cost file and printed with the 2x2 table. Returns the exit
    code."""
    arms = [(cfg.url, "the flag-off arm (--url)"),
            (cfg.cost.invariant, "the flag-on arm (--invariant)")]
    wait_until_ready(cfg, arms, out)
    cfg = resolve_engine(cfg, arms)
    off = Arm.open(cfg, "off", "--url", cfg.url)
    on = Arm.open(cfg, "on", "--invariant", cfg.cost.invariant)
    longest, what = longest_cost_prompt(cfg)
    for arm in (off, on):
        refuse_what_cannot_fit(arm.facts, cfg.sampling.max_tokens, longest, what)
    differences = check_arms(cfg, off, on, out)
    run_id = "%08x" % random.SystemRandom().getrandbits(32)  # no cache hit across runs either
    doc = copy.deepcopy(cfg.prior_save) if cfg.prior_save else {"schema": COST_SCHEMA, "cells": []}
    short: List[Tuple[int, str, int]] = []  # (trial, arm, tokens) of trials that stopped early
    per_trial = cfg.cost.trial.prompts
    expected_tokens = per_trial * cfg.sampling.max_tokens
    stopped_by: List[str] = []  # "precision" once the interval is narrow enough

    def prompts(trial: int) -> List[str]:
        return workload_prompts(cfg.cost.workload, per_trial, trial, run_id,
                                cfg.cost.prefix_tokens)

    saves = ThrottledSave(cfg.save)
    progress = Progress(out, cfg.cost.trials, "trial pairs", cfg.quiet)

    def measure(interrupt: DeferredInterrupt) -> None:
        warm_up(cfg, (off, on), prompts, interrupt, progress)
        for trial in range(cfg.cost.trials):
            for arm in ((off, on) if trial % 2 == 0 else (on, off)):  # A B B A A B ...
                interrupt.check()
                progress.running("trial %d/%d, %s arm" % (trial + 1, cfg.cost.trials, arm.name))
                try:
                    seconds, count, timings = arm.run(cfg, prompts(trial))
                except ServerError as err:
                    raise ServerError("trial %d, %s arm: %s" %
                                      (trial + 1, arm.name, err)) from None
                if count > expected_tokens:
                    raise ServerError("trial %d, %s arm: the server reported %d output tokens, "
                                      "more than %d prompts x --max-tokens %d allow" %
                        (trial + 1, arm.name, count, per_trial, cfg.sampling.max_tokens))
                if count < expected_tokens:
                    short.append((trial + 1, arm.name, count))
                arm.samples.append(seconds)
                arm.tokens.append(count)
                if timings is not None:
                    arm.timings.append(timings)
            saves.offer(lambda path: save_cell(
                path, as_record(cost_cell(cfg, (off, on), differences, "running"))))
            progress.finished("trial %d/%d" % (trial + 1, cfg.cost.trials), 2 * per_trial)
            if cfg.cost.precision and precise_enough(off, on, cfg.cost.precision):
                stopped_by.append("precision")
                return

    # A stop signal once the last trial pair is in waits for the cell's save and its report,
    # as in the sweep: measuring's own handler gives way to this one
    with SavesFirst(out) as late:
        state, code = measure_until_stopped(out, "cost", measure)
        for trial, arm_name, got in short[:3]:
            out.warn("trial %d, %s arm: %d output tokens, not %d x %d (the server stopped early: "
                     "is ignore_eos honoured?)" %
                     (trial, arm_name, got, per_trial, cfg.sampling.max_tokens))
        if not off.samples or not on.samples:
            out.say("no complete trial pair; nothing to report", raising=False)
            return code or late.code() or EXIT_SERVER
        cell = cost_cell(cfg, (off, on), differences, state)
        if cfg.cost.precision:
            why = stopped_by[0] if stopped_by else ("trials" if state == "complete" else state)
            cell = dataclasses.replace(cell, stopped_by=why)
        record = as_record(cell)
        doc = saves.write(lambda path: save_cell(path, record)) or add_cell(doc, record)
        labels = CellLabels.from_record(record)  # read as any cell of the file is
        if cfg.save and state == "complete":
            prior = [c for c in (cfg.prior_save or {}).get("cells") or [] if isinstance(c, dict)]
            read = settings_read_by_all(prior + [record])
            for old in prior:
                if same_measurement(old, record, read):
                    out.warn(replaced_cell_line(old, record, cfg.save, read))
        if labels.tp is None and not cfg.json_out:
            out.warn("the arms do not report their TP degree, so the cell is labelled TP=?: give "
                     "--tp N to label it")
        if cfg.json_out:
            out.line(json_text(record, indent=1))
        else:
            print_cost_report(cell, labels, out)
            if cfg.save:
                out.line("")
                read = settings_read_by_all(doc["cells"])
                cells = [CellLabels.from_record(c, read) for c in doc["cells"]]
                for line in cost_table_lines(cells, CellLabels.from_record(record, read)):
                    out.line(line)
        return report_save(cfg, saves, code, out) or late.code()


# ----------------------------------------------------------------------------
# --mode harness: the upstream harnesses, quoted, with what each one does not tell you

VLLM_REV = "vLLM 0.34.0, its source release (read 2026-12-04; the same text in 0.33.0)"
SGLANG_REV = "SGLang 0.5.23, its wheel (read 2026-12-01; same text and lines in 0.5.18-0.5.23)"


@dataclass
class Excerpt:
    engine: str
    title: str
    source: str  # file, lines and version it was read at
    text: str  # verbatim upstream text
    note: str  # what a reader needs so as not to be misled, in the lab's words


HARNESS_EXCERPTS = [
    Excerpt(
        "vllm", "the autouse fixture",
        "tests/v1/determinism/conftest.py, lines 8-12, " + VLLM_REV,
        '''@pytest.fixture(autouse=True)
def enable_batch_invariant_mode(monkeypatch: pytest.MonkeyPatch):
    """Automatically enable batch invariant kernel overrides for all tests."""
    monkeypatch.setattr(envs, "VLLM_BATCH_INVARIANT", True)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")''',
        "Every test in tests/v1/determinism/ runs with the flag ON, whatever your shell says. A "
        "test that needs the flag off has to switch it off itself, as the next one does."),
    Excerpt(
        "vllm", "the negative control that must see differences",
        "tests/v1/determinism/test_batch_invariance.py, lines 507-520 (def 507-509, docstring "
        "from 510, comment 518; 509-522 in 0.33.0), " + VLLM_REV,
        '''def test_logprobs_without_batch_invariance_should_fail(
    backend, monkeypatch: pytest.MonkeyPatch
):
    """This test is the inverse of test_logprobs_bitwise_batch_invariance_bs1_vs_bsN.
    It DISABLES batch invariance mode and expects to see non-deterministic behavior
    between BS=1 and BS=N runs. This demonstrates that batch invariance is actually
    doing something useful.

    The test will PASS if we detect differences (proving batch invariance matters).
    The test will FAIL if everything matches (suggesting batch invariance isn't needed).
    """
    # CRITICAL: Disable batch invariance for this test
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    monkeypatch.setattr(envs, "VLLM_BATCH_INVARIANT", False)''',
        "Because of the autouse fixture above, this test must undo the flag itself (the two "
        "monkeypatch lines). A green result here means differences WERE seen with the flag off: "
        "the lab's `--mode sweep --expect variant` is the same negative control over HTTP."),
    Excerpt(
        "vllm", "the model is an environment variable",
        "tests/v1/determinism/utils.py, lines 43-44, " + VLLM_REV,
        """DEFAULT_MODEL = "Qwen/Qwen3-1.7B"
TEST_MODEL = os.getenv("VLLM_TEST_MODEL", DEFAULT_MODEL)""",
        "Set VLLM_TEST_MODEL to point the whole suite at your own weights; there is no flag."),
    Excerpt(
        "vllm", "the online test's sampling and server arguments",
        "tests/v1/determinism/test_online_batch_invariance.py, lines 144-162, " + VLLM_REV,
        """    sp_kwargs: dict[str, Any] = {
        "temperature": 0.6,
        "top_p": 1.0,
        "max_tokens": 8,
        "seed": 42,
        "logprobs": 5,
    }

    tp_size = os.getenv("VLLM_TP_SIZE", "1")
    server_args: list[str] = [
        "--max-model-len=8192",
        "--max-num-seqs=32",
        f"--attention-backend={backend}",
    ]
    if tp_size:
        server_args += ["-tp", tp_size]
    server_args += os.getenv("VLLM_TEST_SERVER_ARGS", "").split()

    with RemoteOpenAIServer(TEST_MODEL, server_args) as server:""",
        "Seeded sampling at temperature 0.6, not greedy, and only 8 tokens: a short window for a "
        "near-tie to show up. The lab defaults to greedy and 64 tokens; run it with "
        "--temperature 0.6 too. The TP size here is read from VLLM_TP_SIZE, not "
        "VLLM_TEST_TP_SIZE. New since the May 2026 tree: VLLM_TEST_SERVER_ARGS adds server "
        "flags (pin --attention-backend and friends there, as the lab's launch scripts do)."),
    Excerpt(
        "vllm", "the online test's bitwise comparison",
        "tests/v1/determinism/test_online_batch_invariance.py, lines 126-133, " + VLLM_REV,
        """        for t, (a, b) in enumerate(zip(logprobs_bs1, logprobs_bsN)):
            if a != b:
                diff = abs(a - b)
                raise AssertionError(
                    f"Prompt {i} Step {t}: Bitwise mismatch "
                    f"(abs diff={diff:.6e}). "
                    f"BS=1 tokens: {tokens_bs1} BS=N tokens: {tokens_bsN}"
                )""",
        "The upstream check is on logprobs, bit for bit, not on text. It stops at the first "
        "mismatch; the lab reports the largest float32 ULP distance over every comparable step."),
    Excerpt(
        "vllm", "the performance harness",
        "benchmarks/benchmark_batch_invariance.py, lines 147-150 and 189-190, " + VLLM_REV,
        """        print("Generating baseline (warmup)...")
        baseline_out = llm.generate([needle_prompt], sampling)
        assert len(baseline_out) == 1
        baseline_text = baseline_out[0].outputs[0].text
[...]
            needle_output = outputs[needle_pos]
            assert needle_output.prompt == needle_prompt""",
        "This is a timing harness, not a determinism test. baseline_text is printed but never "
        "compared with anything, and the assertion compares the prompt sent with the prompt "
        "echoed back, which holds by construction. Its green output and its `Overhead: +X%` line "
        "say nothing about invariance. It also needs an SM90+ GPU."),
    Excerpt(
        "sglang", "the driver's single mode",
        "python/sglang/test/test_deterministic.py, lines 460-471, " + SGLANG_REV,
        """def test_deterministic(args):
    if args.test_mode == "single":
        # In single mode, we test the deterministic behavior by sending the same prompt in batch\
 sizes ranging from 1 to n_trials.
        texts = []
        for i in range(1, args.n_trials + 1):
            batch_size = i
            text = send_single(args, args.profile, prompt=[PROMPT_1] * batch_size)
            text = text.replace("\\n", " ")
            print(f"Trial {i} with batch size {batch_size}: {text}")
            texts.append(text)
        print(f"Total samples: {len(texts)}, Unique samples: {len(set(texts))}")
        return [len(set(texts))]""",
        "In 0.5.18 to 0.5.23 (the releases read from their wheels), send_single keeps only the "
        "FIRST completion of each batch (pick_first_result defaults to True, lines 106 and "
        "181-182) and single mode compares text only: no logprobs, and it returns the count "
        "without failing. Completions 2..n of every batch are never looked at. Drivers newer "
        "than 0.5.23 may compare more; read your checkout's single mode. The lab compares every "
        "completion, and the logprobs too."),
    Excerpt(
        "sglang", "the in-tree test's model and server arguments",
        "python/sglang/test/test_deterministic_utils.py, lines 12-18, " + SGLANG_REV,
        """DEFAULT_MODEL = "Qwen/Qwen3-8B"
COMMON_SERVER_ARGS = [
    "--trust-remote-code",
    "--cuda-graph-max-bs-decode",
    "32",
    "--enable-deterministic-inference",
]""",
        "--cuda-graph-max-bs-decode 32 fixes the decode bucket ladder (1, 2, 4, 8, 12, 16, 24, "
        "32): a batch pads up to the next size, and above 32 there is no graph to pad into. That "
        "decides which batch sizes can differ at all. It is defined in 0.5.18 "
        "python/sglang/srt/server_args.py L1879-1883 and resolved at L4524-4525; in 0.5.23 in "
        "srt/arg_groups/fields/exec_.py L629-631 and srt/arg_groups/cuda_graph_hook.py L72-73. "
        "(Line numbers L1906-L1910 / L4561-L4562, quoted elsewhere, match none of the releases "
        "checked.) Older versions of this test class used --cuda-graph-max-bs 32; from 0.5.20 on "
        "that spelling is rejected as ambiguous."),
    Excerpt(
        "sglang", "the deterministic attention-backend fallback",
        "python/sglang/srt/arg_groups/overrides.py, lines 1112-1123, SGLang 0.5.23 (the function "
        "spans 1093-1123; in 0.5.18 it spans 2078-2108 of the same file)",
        """        logger.warning(
            f"Attention backend not specified. Falling back to '{backend}' for deterministic\
 inference. "
            f"You can explicitly set --attention-backend to one of\
 {DETERMINISTIC_ATTENTION_BACKEND_CHOICES}."
        )
        return {"attention_backend": backend}
    elif view.attention_backend not in DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
        # User explicitly specified an incompatible attention backend
        raise ValueError(
            f"Currently only {DETERMINISTIC_ATTENTION_BACKEND_CHOICES} attention backends are\
 supported for deterministic inference, "
            f"but you explicitly specified '{view.attention_backend}'."
        )
    return {}""",
        "A comparison hazard, not a convenience: with the flag on and no --attention-backend, "
        "SGLang picks one for you (fa3 before Blackwell, flashinfer or triton on it), and your "
        "flag-off arm may be running another. Then the difference you measure is not the one you "
        "meant. Pin --attention-backend in BOTH arms; the lab's cost mode refuses mismatched "
        "arms.")]
VLLM_COMMANDS = """\
From the root of a vLLM checkout (the autouse fixture turns the flag on; the
should-fail test turns it off itself):

  pytest -v -s tests/v1/determinism/test_batch_invariance.py -k "bs1_vs_bsN and 16-16-FLASH_ATTN"
  pytest -v -s tests/v1/determinism/test_batch_invariance.py -k "without_batch_invariance and\
 TRITON_ATTN"
  VLLM_TEST_MODEL=Qwen/Qwen3-1.7B VLLM_TP_SIZE=1 pytest -v -s\
 tests/v1/determinism/test_online_batch_invariance.py -k "FLASH_ATTN and not MLA"
  VLLM_BENCH_MODEL=Qwen/Qwen3-1.7B VLLM_BENCH_BACKEND=FLASH_ATTN python\
 benchmarks/benchmark_batch_invariance.py

Tensor parallelism is spelled two ways: the offline tests (test_batch_invariance.py)
read VLLM_TEST_TP_SIZE, the online and needle tests read VLLM_TP_SIZE. Set both
(VLLM_TEST_TP_SIZE=2 VLLM_TP_SIZE=2) or one of them silently runs at TP=1.
The last command is the performance harness: it prints an overhead, not a verdict.

Where upstream CI runs these in vLLM 0.34.0 (.buildkite/test_areas/misc.yaml of its
source release; in 0.33.0's the A100, H100 and B200 steps were commented out, lines
848-990, and only the optional distributed nightly ran, 991-1010): the step
":nvidia: (B200) Batch Invariance" (lines 994-1017) on every change to the flag's code
or tests, the online test included (line 1017); "(H100) [Nightly] Batch Invariance"
(944-963, optional) and "(H100) [Nightly] Batch Invariance (Distributed)" (1050-1070:
TP 4, and the online test with data parallelism 4 and expert parallelism); AMD mirrors
on MI250 (919-942), MI300 and MI355. None of them measures what the flag costs.

What vLLM 0.33.0 changed, read in its source release: the flag's kernels moved to
vllm/model_executor/determinism/ (batch_invariant.py, and a tile table in
batch_invariant_configs.py). For bf16 models whose shapes are in that table the flag
turns on breakable CUDA graphs itself and the model then runs without torch.compile
(vllm/config/vllm.py lines 842-870): the two arms no longer run the same compiled graph,
and the lab's cost mode shows both settings as the flag's own. NCCL is pinned to one
channel and tree all-reduce by pin_nccl_env (batch_invariant.py lines 1401-1424), while a
flag-on server reports custom all-reduce still on. tests/v1/determinism/ holds 12 files;
besides the ones above, worth running on your hardware:

  pytest -v -s tests/v1/determinism/test_batch_invariance_vlm.py
  pytest -v -s tests/v1/determinism/test_lora_shrink_batch_invariant.py
  pytest -v -s tests/v1/determinism/test_matmul_batch_invariant.py

What vLLM 0.34.0 changed, read in its release: the flag's breakable CUDA graphs are
kept in compilation_config.use_breakable_cudagraph, no longer in the environment
(vllm/config/vllm.py lines 810-834); the old model runner is gone (the V2 runner picks
FlashInfer's sampler only for steps with no greedy or seeded request: see the known
hazards); the flag no longer forces the one-stage custom all-reduce
(csrc/custom_all_reduce.cuh lines 44-50), so TP > 1 costs of 0.33 and 0.34 are not
comparable; with the flag FLASH_ATTN's max_seq_len is fixed at max_model_len
(v1/attention/backends/flash_attn.py lines 834-835), after sliding-window decodes moved
beside other requests' prefill chunks (test_sliding_window_logprobs_bitwise_alone_vs_
mixed_batch, test_batch_invariance.py line 1020). gpu_memory_utilization defaults to
all of the GPU: two servers on one GPU must each pass --gpu-memory-utilization.

The same experiment with the lab, against two servers you start yourself:

  VLLM_SERVER_DEV_MODE=1 VLLM_BATCH_INVARIANT=0 vllm serve Qwen/Qwen3-1.7B --port 8000 \\
      --attention-backend FLASH_ATTN --max-num-seqs 32 --max-model-len 8192 \\
      --enable-prompt-tokens-details
  VLLM_SERVER_DEV_MODE=1 VLLM_BATCH_INVARIANT=1 vllm serve Qwen/Qwen3-1.7B --port 8001 \\
      --attention-backend FLASH_ATTN --max-num-seqs 32 --max-model-len 8192 \\
      --enable-prompt-tokens-details

The sweeps send concurrent requests, a cache key each (the default --traffic): the shape
that measures batching. --enable-prompt-tokens-details lets the lab see that no request was
served from the prefix cache. Add --traffic copies for the upstream tests' shape: vLLM's
copies of one request share its prefix cache whatever the salt, so the lab reports what the
cache served instead of a batching verdict.

  python3 run.py --mode sweep --engine vllm --url http://localhost:8000 \\
      --model Qwen/Qwen3-1.7B --max-batch 32 --save off.json --expect variant
  python3 run.py --mode sweep --engine vllm --url http://localhost:8001 \\
      --model Qwen/Qwen3-1.7B --max-batch 32 --save on.json --expect invariant
  python3 run.py --mode sweep --engine vllm --url http://localhost:8001 \\
      --model Qwen/Qwen3-1.7B --temperature 0.6 --seed 42 --max-tokens 8
  python3 run.py --mode cost --url http://localhost:8000 \\
      --invariant http://localhost:8001 --batch 32 --trials 20 --save cost.json
"""
SGLANG_COMMANDS = """\
Arm 1, flag off (expect "Unique samples" > 1):

  python3 -m sglang.launch_server --model-path Qwen/Qwen3-8B --port 30000 \\
      --attention-backend triton --cuda-graph-max-bs-decode 32
  python3 -m sglang.test.test_deterministic --n-trials 50 --test-mode single --port 30000

Arm 2, flag on (expect exactly 1):

  python3 -m sglang.launch_server --model-path Qwen/Qwen3-8B --port 30001 \\
      --attention-backend triton --cuda-graph-max-bs-decode 32 \\
      --enable-deterministic-inference
  python3 -m sglang.test.test_deterministic --n-trials 50 --test-mode single --port 30001

The driver sends sampling_seed 42, but with the flag off SGLang ignores it (per-request
seeds exist only with --enable-deterministic-inference: sampling_batch_info.py, 0.5.23
lines 157-171): arm 1 at a temperature above 0 samples unseeded. Keep it greedy (the
default), as the lab's own SGLang commands below do.

--attention-backend is pinned in both arms on purpose (see the fallback above). The
driver needs a full sglang install; its other modes are prefix, radix_cache, p_vs_d.
These commands hold for 0.5.18-0.5.23. Run p_vs_d too: on 0.5.23 (one H200, 2026-12-01)
the lab found decode and prefill logprobs apart with the flag on, at Qwen3-8B's shape.

The same experiment with the lab (the sizes straddle the 16, 24 and 32 buckets):

  python3 run.py --mode sweep --engine sglang --url http://localhost:30000 \\
      --sizes 1,15,16,17,23,24,25 --temperature 0.0 --save off.json --expect variant
  python3 run.py --mode sweep --engine sglang --url http://localhost:30001 \\
      --sizes 1,15,16,17,23,24,25 --temperature 0.0 --save on.json --expect invariant
  python3 run.py --mode cost --engine sglang --url http://localhost:30000 \\
      --invariant http://localhost:30001 --batch 32 --trials 20 --save cost.json
"""


def run_harness(cfg: Config, out: Out) -> int:
    """--mode harness: the upstream harnesses quoted, with the commands (--engine: its own)."""
    lines = [
        "Upstream batch-invariance harnesses, quoted verbatim (Apache-2.0; see README), with "
        "what each one does not tell you. The lab itself was run against vLLM 0.26.0 and "
        "0.33.0 and SGLang 0.5.17 and 0.5.23 on one H200 on 2026-12-01, and against vLLM "
        "0.34.0 on 2026-12-04 (examples/real/).", ""]
    parts = (("vllm", "vLLM", VLLM_COMMANDS), ("sglang", "SGLang", SGLANG_COMMANDS))
    for name, label, commands in parts:
        if cfg.engine not in (None, name):
            continue
        lines += [out.style(text, "1") for text in ("=" * 78, label, "=" * 78)]
        for ex in (e for e in HARNESS_EXCERPTS if e.engine == name):
            lines += ["", out.style("--- %s: %s" % (label, ex.title), "1;36"),
                      "Quoted from %s %s" % (label, ex.source), ""]
            lines += ["    > " + row if row else "    >" for row in ex.text.splitlines()]
            lines += ["", "Note: " + ex.note]
        lines += ["", out.style("--- %s: commands" % label, "1;36"), "", commands]
    for line in lines:
        out.line(line)
    return EXIT_OK


# ----------------------------------------------------------------------------
# --mode help: the guide

COVERAGE_CHECKLIST = """\
Before filing a flag-on divergence as a bug, rule out the documented coverage gaps:
  - vLLM: fused-MoE kernels default to unsupported; only Triton experts opt in.
    A MoE model on another MoE backend is not covered.
  - SGLang: the MoE routing top-k stays unsorted unless the model has fused shared
    experts; ties in routing can then pick experts in a batch-dependent order.
  - Mamba and other state-space backends raise rather than degrade: if the server
    started, check it is really running the backend you think.
  - Both: the two arms must run the same attention backend (pin it), and vLLM supports
    only FLASH_ATTN, FLEX_ATTENTION, TRITON_ATTN, FLASH_ATTN_MLA and TRITON_MLA."""
GUIDE = """\
BATCH-INVARIANCE LAB: THE GUIDE

A batched GPU kernel may add up its numbers in a different order at batch 1 than at
batch 17. The last bits of a logit move; where two logits are near-tied, the argmax
flips and the completion takes another road from there on. vLLM (VLLM_BATCH_INVARIANT=1)
and SGLang (--enable-deterministic-inference) can switch on batch-invariant kernels.
The lab measures, against a server you started, over plain HTTP:

  1. Unique completions across batch sizes, flag OFF. More than one: the effect,
     reproduced on your model and hardware.
  2. The same count with the flag ON. Exactly one is expected.
  3. What the flag costs, for your model, backend, TP degree and workload.
  +  The largest float32 ULP distance between batch 1's per-step logprobs and every
     other batch's. Token equality is the weaker claim: two runs can emit the same
     tokens while every logprob differs in its last bits, because the argmax happened
     to survive the perturbation this time. The ULP column shows the arithmetic moved.

THE MODES
  --mode harness   Prints the upstream test harnesses verbatim, where each comes from,
                   what each does not tell you, and the commands to run them. Offline.
                     python3 run.py --mode harness --engine vllm
  --mode sweep     For each batch size n, sends traffic of one shape and compares the
                   prompt's completions with batch 1's (the prompt sent alone): tokens,
                   then logprobs in ULPs. The default ladder straddles every CUDA-graph
                   size b with b-1, b, b+1. --traffic concurrent (default): n one-prompt
                   requests in flight at once, each with a cache key of its own, as real
                   clients send them; it measures batching on both engines (each row's
                   send_spread_s: seconds from the first request written to the last).
                   copies: n copies in ONE request,
                   the upstream tests' shape. On SGLang (radix cache off, as its launch
                   script starts it) copies are batched cold and measure batching; on
                   vLLM the copies of one request share its prefix cache whatever the
                   salt, so above batch 1 they compare cached prefills: with cached-token
                   reporting the lab says so ("not put down to batching", "nothing
                   compared"), without it the bypass stays unverified. mixed: the prompt
                   once among n-1 other prompts of varied lengths (vLLM's needle
                   benchmark, and the mixed mode SGLang's driver had before 0.5.18, are
                   its upstream analogues). --repeat K (default 3) runs the whole ladder K
                   times; batch 1's passes are the run-to-run control. --prefix-cache
                   bypass (default) keeps every size from being served an earlier prefill:
                   a fresh vLLM cache_salt per request, a fresh SGLang cache key per prompt
                   and a flush before every size. The cached-token counts prove it: a
                   count above 0 marks the size "cache hit: bypass did not hold"; no counts
                   leave it unverified.
                   --baseline URL holds the sweep against batch 1 of another server (asked
                   first, with the same prompts and sampling): the restart-to-restart,
                   TP-to-TP and version-to-version check; the header names the settings
                   in which the two servers differ.
                     python3 run.py --mode sweep --url http://localhost:8000 --save off.json
                     python3 run.py --mode sweep --url http://localhost:8001 --expect invariant
  --mode cost      Times the same workload on a flag-off and a flag-on server, arms
                   interleaved, and reports the overhead with a 95%% interval.
                     python3 run.py --mode cost --url http://localhost:8000 \\
                         --invariant http://localhost:8001 --batch 32 --trials 20
  --mode help      This guide. `python3 run.py --help` lists every option.

  Options belong to their mode: `--help` lists them under "every mode", "--mode sweep
  and --mode cost", "--mode sweep" (its checks apart) and "--mode cost". One given to a
  mode that does not use it is refused (exit 2), never ignored: --mode cost --expect
  invariant would be a gate that checks nothing.

READING A SWEEP
  invariant                       one completion, max ULP 0: nothing moved.
  logprobs moved but tokens held  the arithmetic changed with the batch, no argmax flipped.
  tokens diverged                 an argmax flipped somewhere; "first token" says where.
  batch 1 not repeatable          the prompt alone gave different answers on different
                                  passes: something besides batching moves them.

A CLEAN FLAG-OFF RESULT IS NOT A FAILED EXPERIMENT. It usually means one of:
  - The model was confident at every generated position: no near-tie, nothing to flip.
    Use more prompts (--prompt-file), longer generations (--max-tokens 256), or seeded
    sampling (--temperature 0.6). Dummy or random weights (--load-format dummy) give
    flat logits with no near-ties at all; the lab warns when the server says so.
  - Every size ran the same kernel configuration or the same CUDA-graph bucket: sizes
    inside one bucket pad to the same shape. The ladder straddles bucket edges for this.
  - The requests were not batched together: the server's max-num-seqs was smaller than
    n (the lab warns), or the flag was already on in the server's environment (the lab
    prints what the server reports).

A FLAG-ON DIVERGENCE: rule out the documented coverage gaps before filing a bug
%(checklist)s

DECODE VERSUS PREFILL (--prefill-check)
  Reinforcement-learning trainers ("true on-policy") score the tokens a server generated
  by reading prompt + completion back: the logprob the engine reports while decoding must
  equal, bit for bit, the one it computes in that prefill, or the importance ratios drift.
  The check sends every distinct completion back as token ids (never re-tokenised text)
  and reports the largest ULP distance and the first step that differs, with a verdict of
  its own; --expect prefill-equal exits 1 unless they agree. A mismatch means the decode
  and prefill kernels reduce in different orders, even when batch invariance holds.
  Upstream: SGLang's p_vs_d mode (test_deterministic.py), vLLM's
  test_decode_logprobs_match_prefill_logprobs (tests/v1/determinism/).

THE CHECKS A SWEEP CAN RUN (each with its own verdict and --expect)
  --prefill-check    does a prefill read back equal the decode's logprobs?  prefill-equal
  --cache-check      does a prefix-cache hit equal its cold prefill?        cache-equal
  --neighbours L,..  does batch 1 hold while others prefill L tokens in its steps?
                                                                          neighbours-equal
  --observer-check   does asking for logprobs leave the text unchanged?     observer-equal

KNOWN HAZARDS
  Before measuring, the header lists the server settings that upstream reports say break
  or weaken batch invariance (sequence parallelism, speculative decoding, FP8 MoE experts,
  FlashInfer's sampler, sliding windows before 0.34.0 on vLLM; an FP8 KV cache, a
  radix-cache hit on SGLang), each with its report, for its release. It is
  read from the server's own settings, so it knows nothing when they are hidden (vLLM
  without VLLM_SERVER_DEV_MODE=1), and it knows only what has been reported and checked:
  "none known" is not "none". The README lists every row and its evidence.

WHAT THE COST MEANS
  Forcing one attention split and one GEMM tile is nearly free at small batch: those
  layers are bandwidth-bound. What costs is single-channel NCCL (one channel, tree
  all-reduce, no custom all-reduce), which only shows at TP > 1, and lost prefix-cache
  hits, which only show when prompts share a prefix. A quick benchmark at TP=1 on a
  cold workload sees neither. So measure four cells:
        TP=1 x cold    TP=1 x shared-prefix    TP=k x cold    TP=k x shared-prefix
  with --workload cold|shared-prefix at each TP degree, --save them to one file, and
  report all four or none. TP costs of vLLM 0.33 and 0.34 are not comparable: 0.34.0 no
  longer forces the one-stage all-reduce. The two arms must differ in the flag only: cost mode
  compares the servers' settings and refuses to time a mismatched pair.

EXIT CODES
%(exit_codes)s
""" % {"checklist": COVERAGE_CHECKLIST.split("\n", 1)[1], "exit_codes": exit_codes_text()}


def run_help(cfg: Config, out: Out) -> int:
    out.line(GUIDE.rstrip("\n"))
    return EXIT_OK


# ----------------------------------------------------------------------------
# main

RUNNERS: Dict[str, Callable[[Config, Out], int]] = {  # --mode NAME: the runner of that mode
    "harness": run_harness, "help": run_help, "sweep": run_sweep, "cost": run_cost}


def run_mode(argv: Optional[Sequence[str]], out: Out) -> int:
    """The mode argv asks for, every exception turned into its exit code and one line."""
    try:
        cfg = configure(argv)
        SECRETS.keep(cfg.api_key)
        if SECRETS.short:
            out.warn("the API key has fewer than %d characters: the lab never prints or saves "
                     "it, but cannot tell it from other text in what a server sends back, so it "
                     "hides it there only after \"Bearer \"" % SHORT_SECRET)
        out.use_colour(cfg.color)
        code = RUNNERS[cfg.mode](cfg, out)
    except (Exception, KeyboardInterrupt) as err:  # one line, never a traceback
        code, _, why = ending(err)
        if isinstance(err, OutputFailed):
            out.failure = err
        else:
            out.say(why, raising=False)
    return code


def finish(out: Out, code: int) -> int:
    """The exit code, once an output that could not be written is said (where it can be)."""
    failure = out.failure
    if failure is not None:
        if failure.code != EXIT_BROKEN_PIPE:  # `| head` closing the pipe needs no word
            out.say("%s; the run ended there" % failure, raising=False)
        # What is left unwritten goes to /dev/null, so that the interpreter's last flush
        # raises nothing again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):
            try:
                os.dup2(devnull, stream.fileno())
            except (OSError, ValueError, AttributeError):  # AttributeError: closed at start
                pass
        return code if code in (EXIT_USAGE, EXIT_SERVER, EXIT_INTERNAL) else failure.code
    return code


def main(argv: Optional[Sequence[str]] = None) -> int:
    out = Out()
    try:
        with StopsAtOnce():
            return finish(out, run_mode(argv, out))
    except (Exception, KeyboardInterrupt) as err:  # a stop at the very end: still one line
        code, _, why = ending(err)
        out.say(why, raising=False)
        return code


if __name__ == "__main__":
    sys.exit(main())
