# SPDX-License-Identifier: Apache-2.0
"""A practice engine for the batch-invariance lab: vLLM's or SGLang's wire format, no GPU.

It serves a tiny "model" whose logits are sums of float32 terms. With the flag off,
the order of that sum depends on the CUDA-graph bucket the batch pads into (like a
split-K GEMM whose tiling follows the batch shape), so the last bits of every logit
move with the batch size, and where two logits are near-tied the argmax flips. With
--invariant the order is fixed and nothing moves.

Standalone, so that a reader without a GPU can point run.py at it:

    python3 tests/stub_server.py --port 8000                      # vLLM, flag off
    python3 tests/stub_server.py --port 8001 --invariant          # vLLM, flag on
    python3 tests/stub_server.py --engine sglang --port 30000     # SGLang, flag off

From tests:

    with StubServer(StubConfig(engine="sglang", invariant=True)) as stub:
        urllib.request.urlopen(stub.url + "/server_info")

Requests that arrive within --scheduler-window seconds of each other are computed as one
step batch, as a continuous-batching server schedules them; GET /stub/stats reports the
largest step batch formed, the generation requests served and the distinct texts served.

Fault switches (for the lab's own fault tests) apply to the k-th generation request,
counting from 1: --fault 3=http500, drop, badjson, nochoices, fewer, nulllogprobs,
ragged, clamp, redirect, huge, stall, cachehit (its prompts served from the prefix cache, as
if an earlier request had cached them), and the hostile ones (slowstatus, trickle, endlessline,
longline, hugeusage, echokey, keyinbody: see StubHandler). --step-delay S makes each decode step take S
seconds, --slowdown F multiplies all of its time when --invariant is on (the decode steps and
the batching window alike, so that a cost run's overhead is the stated F - 1), and --jitter J
adds seeded noise of +-J of it. --load-seconds S: the port is not opened for S seconds, as a
real engine refuses connections while it loads its model (the experiment's dry run, with
arms that take seconds to be ready).
"""

import argparse
import collections
import copy
import json
import math
import os
import random
import re
import socket
import struct
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional, Tuple
from urllib.parse import urlsplit

HERE = os.path.dirname(os.path.abspath(__file__))
VLLM_INFO_TEMPLATE = os.path.join(HERE, "fixtures", "vllm-0.26.0", "server_info_flag_off.json")
MAX_MODEL_LEN = 2048  # the context length the practice engine reports
VLLM_033_INFO_TEMPLATE = os.path.join(HERE, "fixtures", "vllm-0.33.0", "server_info_flag_off.json")

# ----------------------------------------------------------------------------
# The model: float32 arithmetic whose reduction order follows the batch shape

VOCAB = ["</s>"] + [" " + w for w in (
    "the lab a batch kernel sum order bit logit token tie flips graph bucket pad "
    "split tile warp float half rounds again and then so it was not quite"
).split()]                      # 32 tokens; id 0 is end-of-sequence
EOS_ID = 0                      # emitted only when ignore_eos is false
EOS_BIAS = -3.0                 # keeps end-of-sequence rare but possible
TERMS = 8                       # float32 terms summed into each logit
TIE_RATE = 0.03                 # share of steps whose top two logits are near-tied
TERM_SCALES = [2.0 ** -k for k in range(TERMS)]  # mixed magnitudes, so order matters
_F32 = struct.Struct("<f")


def f32(x: float) -> float:
    """Round a double to the nearest float32 (as a GPU register would hold it)."""
    try:
        return _F32.unpack(_F32.pack(x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def reduction_plan(batch_size: int, graph_sizes: List[int], invariant: bool) -> Tuple[int, int]:
    """(splits, rotation) of every reduction for a batch: the stub's 'kernel configuration'.

    Flag off, it follows the CUDA-graph bucket the batch pads into (eager batches above
    the largest bucket use their own size); flag on, it is one fixed plan for every batch.
    """
    if invariant:
        return (1, 0)
    bucket = next((b for b in sorted(graph_sizes) if b >= batch_size), batch_size)
    splits = min(TERMS, 2 ** (bucket.bit_length() // 2))
    rotation = (bucket // 8) % TERMS
    return (splits, rotation)


def f32_sum(values: List[float], plan: Tuple[int, int]) -> float:
    """Sum in float32 the way a split reduction would: rotate, sum each chunk, sum the partials."""
    splits, rotation = plan
    n = len(values)
    ordered = values[rotation % n:] + values[:rotation % n]
    chunk = -(-n // splits)
    total = 0.0
    for start in range(0, n, chunk):
        partial = 0.0
        for v in ordered[start:start + chunk]:
            partial = f32(partial + v)
        total = f32(total + partial)
    return total


def step_terms(context_key: int) -> List[List[float]]:
    """The float32 terms of every logit at one step; the same context always gives the same terms."""
    rng = random.Random(context_key)
    terms = [[f32(rng.gauss(0.0, 1.0) * s) for s in TERM_SCALES] for _ in VOCAB]
    terms[EOS_ID][0] = f32(terms[EOS_ID][0] + EOS_BIAS)
    if rng.random() < TIE_RATE:
        # A near-tie: the runner-up's terms are the leader's, reversed. Equal in exact
        # arithmetic, a few ULP apart in float32, and which one wins depends on the order.
        exact = sorted(range(len(VOCAB)), key=lambda v: -math.fsum(terms[v]))
        leader, runner_up = exact[0], exact[1]
        terms[runner_up] = list(reversed(terms[leader]))
    return terms


def log_softmax(logits: List[float], plan: Tuple[int, int]) -> List[float]:
    """float32 log-softmax whose sum of exponentials follows the same plan."""
    top = max(logits)
    exps = [f32(math.exp(f32(x - top))) for x in logits]
    lse = f32(top + f32(math.log(f32_sum(exps, plan))))
    return [f32(x - lse) for x in logits]


def next_context(context_key: int, token_id: int) -> int:
    return zlib.crc32(token_id.to_bytes(4, "little"), context_key)


PROMPT_ID_OFFSET = 1000         # prompt text is "tokenized" as one id per UTF-8 byte, from here
PREFILL_PLAN = (3, 5)           # the reduction order of a prefill, unlike any decode step's


def tokenize(text: str) -> List[int]:
    return [PROMPT_ID_OFFSET + b for b in text.encode("utf-8")]


def split_ids(ids: List[int]) -> Tuple[str, List[int]]:
    """A token-id prompt as (its text, the generated tokens that follow it)."""
    n = next((i for i, t in enumerate(ids) if t < PROMPT_ID_OFFSET), len(ids))
    return bytes(t - PROMPT_ID_OFFSET for t in ids[:n]).decode("utf-8", "replace"), list(ids[n:])


def context_of(prompt: str, prefix_ids: List[int] = ()) -> int:
    context = zlib.crc32(prompt.encode("utf-8"))
    for token in prefix_ids:
        context = next_context(context, token)
    return context


def prefill_logprobs(prompt: str, generated: List[int], plan: Tuple[int, int]) -> List[float]:
    """Each generated token's logprob as a prefill of prompt + tokens computes it with plan."""
    context, out = context_of(prompt), []
    for token in generated:
        logits = [f32_sum(t, plan) for t in step_terms(context)]
        out.append(log_softmax(logits, plan)[token])
        context = next_context(context, token)
    return out


def generate(prompt: str, max_tokens: int, plan: Tuple[int, int], temperature: float = 0.0,
             top_p: float = 1.0, rng: Optional[random.Random] = None,
             ignore_eos: bool = False, prefix_ids: List[int] = ()) -> Dict:
    """One completion: token ids, each step's log-softmax over the vocabulary, finish reason.
    prefix_ids: tokens already generated after the prompt (a token-id prompt's tail)."""
    context = context_of(prompt, prefix_ids)
    ids, steps = [], []
    finish = "length"
    for _ in range(max_tokens):
        logits = [f32_sum(t, plan) for t in step_terms(context)]
        logprobs = log_softmax(logits, plan)
        # Ranked as a sorting sampler ranks them: a flipped near-tie swaps two neighbours.
        ranked = sorted(range(len(VOCAB)), key=lambda v: (-logits[v], v))
        if temperature <= 0.0:
            chosen = ranked[0]
        else:
            chosen = sample_ranked(ranked, logits, temperature, top_p, rng or random)
        ids.append(chosen)
        steps.append(logprobs)
        if chosen == EOS_ID and not ignore_eos:
            finish = "stop"
            break
        context = next_context(context, chosen)
    return {"ids": ids, "logprobs": steps, "finish": finish}


def sample_ranked(ranked: List[int], logits: List[float], temperature: float, top_p: float,
                  rng: random.Random) -> int:
    top = logits[ranked[0]]
    weights = [math.exp((logits[v] - top) / temperature) for v in ranked]
    total = sum(weights)
    probs = [w / total for w in weights]
    kept, mass = [], 0.0
    for v, p in zip(ranked, probs):
        kept.append((v, p))
        mass += p
        if mass >= top_p:
            break
    u = rng.random() * mass
    acc = 0.0
    for v, p in kept:
        acc += p
        if u < acc:
            return v
    return kept[-1][0]


def token_text(token_id: int) -> str:
    return "" if token_id == EOS_ID else VOCAB[token_id]


def ranked_ids(logprobs: List[float]) -> List[int]:
    return sorted(range(len(logprobs)), key=lambda v: (-logprobs[v], v))


def top_ranked(logprobs: List[float], k: int, edge_swap: bool = False) -> List[int]:
    """The k most likely tokens; with edge_swap the k-th gives way to the (k+1)-th, as when
    their last bits move across each other in another batch."""
    ranked = ranked_ids(logprobs)
    return ranked[:k - 1] + ranked[k:k + 1] if edge_swap and 0 < k < len(ranked) else ranked[:k]


def top_entries(logprobs: List[float], chosen: int, k: int,
                edge_swap: bool = False) -> List[Tuple[int, float]]:
    """The chosen token, then the k most likely (vLLM's order; at most k+1 entries)."""
    return [(chosen, logprobs[chosen])] + [(v, logprobs[v]) for v in top_ranked(logprobs, k, edge_swap)
                                           if v != chosen]


# ----------------------------------------------------------------------------
# Server configuration and batch execution

VLLM_GRAPH_SIZES = [1, 2, 4] + list(range(8, 129, 8))   # vLLM with --max-num-seqs 64
SGLANG_GRAPH_SIZES = [1, 2, 4, 8, 12, 16, 24, 32]       # SGLang with --cuda-graph-max-bs-decode 32
FAULTS = ("http500", "drop", "badjson", "nochoices", "fewer", "nulllogprobs", "ragged",
          "clamp", "redirect", "huge", "stall", "trickle", "truncate", "echokey", "nostream", "cutstream",
          "textonly", "usageatend", "overshoot", "slowstatus", "endlessline", "longline",
          "hugeusage", "keyinbody", "nanlogprobs", "unicodeids")
COMPUTED_LIMIT = 4096           # reproducible completions kept for serving again
STALL_SECONDS = 3.0             # how long the "stall" fault keeps a request waiting


@dataclass
class StubConfig:
    engine: str = "vllm"                     # which wire format: vllm or sglang
    invariant: bool = False                  # the batch-invariance flag
    model: str = "stub/tiny-f32"             # served model name
    host: str = "127.0.0.1"
    port: int = 0                            # 0: any free port
    graph_sizes: Optional[List[int]] = None  # captured decode sizes; engine default if None
    max_num_seqs: int = 64                   # what the server batches together at most
    attention_backend: Optional[str] = None  # reported backend; engine default if None
    dev_mode: bool = True                    # vLLM: serve /server_info (VLLM_SERVER_DEV_MODE=1)
    step_delay: float = 0.0                  # seconds per decode step, for cost runs
    slowdown: float = 1.0                    # time multiplier when invariant: steps and window
    jitter: float = 0.0                      # +- this share of the delay, seeded: GPU timing noise
    faults: Dict[int, str] = field(default_factory=dict)  # k-th generation request -> fault
    seed: int = 0                            # the shared generator used when no seed is sent
    float64: bool = False                    # send logprobs as float64 (a server that rounds)
    coverage_gap: bool = False               # flag on, but one kernel ignores it (an uncovered MoE)
    honour_ignore_eos: bool = True           # False: every completion stops at half length
    max_logprobs: int = 20                   # vLLM's --max-logprobs
    tp_size: int = 1                         # the TP degree reported (nothing is sharded)
    redirect_get_to: Optional[str] = None    # answer every GET with a redirect to this base URL
    clock: Optional["VirtualClock"] = None   # in-process tests: emulated time advances this, no sleep
    scheduler_window: float = 0.0            # seconds a step waits for more requests (0: each alone)
    max_model_len: int = MAX_MODEL_LEN          # the context length it reports
    # flag off, a neighbour prefilling more tokens than this in a decode's step changes the
    # decode's arithmetic (another tile: vLLM #51902's mechanism; on one H200 with vLLM 0.33.0
    # a 64-token neighbour moved a decode, a 16-token one did not); flag on, nothing does
    prefill_tile: int = 32
    logprobs_path_differs: bool = False  # a request with no logprobs asked is computed otherwise
    prompt_tokens_details: bool = False      # vLLM's --enable-prompt-tokens-details: cached-token counts
    prefix_caching: bool = True              # False: vLLM --no-enable-prefix-caching, SGLang --disable-radix-cache
    uncounted_cache_hits: bool = False       # serve from the prefix cache, but report 0 cached tokens in
                                             # the answer (its /metrics counters still count them)
    enable_metrics: bool = False             # SGLang: serve /metrics (--enable-metrics); vLLM always does
    no_metrics: bool = False                 # vLLM: /metrics not found (behind a proxy that passes the API only)
    counters_lag: float = 0.0                # seconds before /metrics counts a prefill (engines count a
                                             # step's lookups after it runs)
    metrics_faults: Tuple[int, ...] = ()     # the k-th reads of /metrics (from 1) answer 503, once each
    hits_beyond: int = 0                     # /metrics counts this many more hits for each prefill
                                             # counted than the cache served (impossible counters)
    flush_refused: bool = False              # SGLang: answer /flush_cache as with requests in flight
    decode_graphs: bool = True               # SGLang: False reports decode graphs switched off
    prefill_agrees: bool = False             # prefill computes as a batch-1 decode step does
    prompt_logprobs: bool = True             # False: a server that returns no prompt logprobs
    info_overrides: Dict[Tuple[str, ...], object] = field(default_factory=dict)  # /server_info path -> value
    no_tokenize: bool = False                # a gateway that passes no /tokenize (404)
    tokenizer_probe_differs: Optional[str] = None  # another tokenizer: /tokenize gives this text
                                             # other ids (only there: what is generated stays the stub's)
    rotation_offset: int = 0                 # another kernel build (a TP degree, a version): every
                                             # reduction starts this many terms further on
    cache_path_differs: bool = False         # a prompt served from the prefix cache is computed
                                             # another way (as a cached prefill's kernel may be)
    topk_edge_swap: bool = False             # above batch 1 the k-th top entry swaps with the (k+1)-th
    block_size: Optional[int] = None         # vLLM: the prefix cache serves whole blocks of this
                                             # many tokens, said in /metrics (cache_config_info)
                                             # (None: 64 from 0.34.0 on, said; before, a token at a
                                             # time, not said)
    version: str = "0.26.0"                  # vLLM: the release it answers as; "0.33.0" reports the
                                             # flag-on arm's compile settings as 0.33.0 does, "0.34.0"
                                             # as 0.34.0 does (breakable graphs in the config)
    server_info_500: bool = False            # vLLM: /server_info answers HTTP 500, as real 0.26.0 and
                                             # 0.33.0 servers did when their environment report failed
    copies_split: int = 0                    # flag off: a request's prompts from this one on are
                                             # computed another way, so its copies come back in two
                                             # runs of alike values, as real vLLM 0.26.0 and SGLang
                                             # 0.5.17 answered (vLLM: 256 copies split at the 4th)
    # Faults for the rules every sweep check keeps (see forced_hits and seed_of)
    cache_serves: Optional[str] = None       # "all", "some" or "one": prompts the cache serves
    ignore_seed: bool = False                # vLLM: a per-request seed is accepted and not used

    def sizes(self) -> List[int]:
        if self.graph_sizes is not None:
            return sorted(self.graph_sizes)
        return VLLM_GRAPH_SIZES if self.engine == "vllm" else SGLANG_GRAPH_SIZES

    def backend(self) -> str:
        if self.attention_backend:
            return self.attention_backend
        if self.engine == "vllm":
            return "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"
        return "triton"


class VirtualClock:
    """Emulated GPU time for in-process tests. A request's step delay advances this clock
    instead of sleeping; a test hands it to run.py as its clock (run.CLOCK), so timed results
    are exact whatever else the machine is doing. Requests must not overlap in time (cost
    trials are sequential)."""

    def __init__(self):
        self.now = 0.0
        self.lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self.lock:
            self.now += seconds


class BadRequest(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param=None, body=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.body = body  # the whole error body, where the engine answers in a shape of its own


class StepScheduler:
    """Continuous batching, in small: the prompts of every request that arrives within
    `window` seconds of the first one form one step batch, and every one of them is
    computed with the arithmetic of that batch's total size. A window of 0 runs each
    request alone."""

    def __init__(self, window: float):
        self.window = window
        self.cond = threading.Condition()
        self.open_step: Optional[Dict] = None
        self.largest = 0

    def join(self, prompts: int, longest: int = 0, prefill_only: bool = False) -> Tuple[int, int]:
        """Wait for the step this request falls in to close; return the step's decode batch
        size and the longest prompt any other request of the step prefilled. A request that
        only prefills (one token to write) shares the step's prefill, not the decode batch:
        it does not count in the size the decodes compute with."""
        if self.window <= 0:
            with self.cond:
                self.largest = max(self.largest, prompts)
            return prompts, 0
        with self.cond:
            step = self.open_step
            leader = step is None
            if leader:
                step = self.open_step = {"size": 0, "closed": False, "prompts": []}
            if not prefill_only:
                step["size"] += prompts
            me = len(step["prompts"])
            step["prompts"].append(longest)
        if leader:
            time.sleep(self.window)
            with self.cond:
                step["closed"] = True
                self.open_step = None
                self.largest = max(self.largest, step["size"])
                self.cond.notify_all()
        else:
            with self.cond:
                while not step["closed"]:
                    self.cond.wait()
        others = [n for i, n in enumerate(step["prompts"]) if i != me]
        return max(step["size"], prompts if prefill_only else 1), max(others, default=0)


class EngineState:
    """What a running engine keeps between requests: its shared generators, its scheduler,
    its prefix cache, and what GET /stub/stats reports."""

    def __init__(self, config: "StubConfig"):
        self.shared_rng = random.Random(config.seed)
        self.timing_rng = random.Random(config.seed + 1)
        self.scheduler = StepScheduler(config.scheduler_window)
        self.lock = threading.Lock()
        self.prefix_caching = config.prefix_caching
        self.prefix_cache = set()   # (salt, prompt) of every prompt prefilled since the last flush
        self.computed = {}          # reproducible completions by all they depend on (bounded)
        self.served_requests = 0    # generation requests answered
        self.served_texts = set()   # every distinct completion text answered
        # what it computed, completion by completion (the last SERVED_LOG): its prompt, the
        # longest neighbour prefill in its step, its token ids and each step's chosen logprob.
        # The ground truth a test holds a check's account against (GET /stub/served)
        self.served_log = collections.deque(maxlen=SERVED_LOG)
        self.local = threading.local()  # per request thread: is it streamed
        self.cache_queried = 0      # prompt tokens looked up in the prefix cache (/metrics)
        self.cache_served = 0       # of them, tokens the cache served (/metrics)
        self.counted = []           # (when, queried, served) of lookups not yet in the counters
        self.counters_lag = config.counters_lag
        self.metrics_reads = 0      # reads of /metrics so far (--metrics-fault)
        self.config_hits_beyond = config.hits_beyond
        # the cache serves whole blocks of a prompt, never its last token: vLLM 0.34.0 in
        # blocks of 64 tokens (vllm/config/cache.py line 185, 0.34.0), so that a prompt of
        # fewer than 65 tokens is never served; a token at a time otherwise
        self.cache_block = cache_block_size(config) or 1

    def cached_tokens(self, salt: Optional[str], prompt: str, forced: bool = False) -> int:
        """The prompt's tokens served from the prefix cache; the prompt is cached from now on.
        forced: --cache-serves serves it whatever its key (counted in /metrics all the same)."""
        if not (self.prefix_caching or forced):
            return 0
        with self.lock:
            # the cachehit fault: this request's prompts were cached by an earlier one (one a
            # salt did not keep apart: a cache shared across salts, as copies of one vLLM
            # request share it)
            hit = ((salt, prompt) in self.prefix_cache or forced
                   or getattr(self.local, "forced_hit", False))
            self.prefix_cache.add((salt, prompt))
            served = (prompt_token_count(prompt) - 1) // self.cache_block * self.cache_block if hit else 0
            self.counted.append((time.monotonic(), prompt_token_count(prompt), served))
        return served

    def counters(self) -> Tuple[int, int]:
        """(prompt tokens looked up in the prefix cache, tokens it served) since the start, as
        counted --counters-lag seconds ago."""
        with self.lock:
            now = time.monotonic()
            while self.counted and self.counted[0][0] + self.counters_lag <= now:
                _, queried, served = self.counted.pop(0)
                self.cache_queried += queried
                self.cache_served += served + self.config_hits_beyond
            return self.cache_queried, self.cache_served

    def flush(self) -> None:
        with self.lock:
            self.prefix_cache.clear()

    def remember(self, key, out) -> None:
        with self.lock:
            if len(self.computed) >= COMPUTED_LIMIT:
                self.computed.clear()
            self.computed[key] = out

    def streaming(self) -> bool:
        """Is the request this thread serves streamed? (Its tokens are then paced one by one.)"""
        return getattr(self.local, "stream", False)

    def served(self, texts: List[str]) -> None:
        with self.lock:
            self.served_requests += 1
            self.served_texts.update(texts)

    def stats(self) -> Dict:
        with self.lock:
            return {"largest_step_batch": self.scheduler.largest, "generation_requests": self.served_requests,
                    "distinct_texts": len(self.served_texts)}


def prefill_plan(config: StubConfig) -> Tuple[int, int]:
    """The order a prefill reduces in: its own, or (prefill_agrees) a batch-1 decode step's."""
    if config.prefill_agrees:
        return reduction_plan(1, config.sizes(), config.invariant and not config.coverage_gap)
    return PREFILL_PLAN


def prompt_logprob_list(config: StubConfig, ids: List[int]) -> List[Optional[float]]:
    """The logprob of every position of a token-id prompt (None at 0; the prompt's own bytes,
    which no test compares, a constant)."""
    text, generated = split_ids(ids)
    values = prefill_logprobs(text, generated, prefill_plan(config))
    return [None] + [-1.0] * (len(ids) - len(generated) - 1) + values if ids else []


def paced_only(prompt: str, max_tokens: int) -> Dict:
    """A streamed answer when GPU time is emulated (--step-delay): tokens drawn from the prompt
    alone, without the model's arithmetic. On a GPU that arithmetic runs beside the server's
    CPU; here it would take the CPU from the other streams and show up in the very times the
    lab measures under load."""
    rng = random.Random(zlib.crc32(prompt.encode("utf-8")))
    ids = [rng.randrange(1, len(VOCAB)) for _ in range(max_tokens)]
    return {"ids": ids, "logprobs": [[-3.5] * len(VOCAB) for _ in ids], "finish": "length"}


def run_batch(config: StubConfig, state: EngineState, prompts: List[str], max_tokens: int,
              temperature: float, top_p: float, seed: Optional[int], ignore_eos: bool,
              prefixes: Optional[List[List[int]]] = None, hits: Optional[List[bool]] = None,
              longest: int = 0, no_logprobs: bool = False) -> List[Dict]:
    """Every prompt of one request, computed with the arithmetic of the step batch it joined.
    longest: its longest prompt, in tokens (a neighbour's prefill in the step can change a
    decode's arithmetic, flag off: see prefill_tile)."""
    step_size, neighbour = state.scheduler.join(len(prompts), longest, prefill_only=max_tokens == 1)
    if state.streaming() and config.step_delay > 0:
        return [paced_only(prompt, max_tokens) for prompt in prompts]
    started = time.perf_counter()
    if not config.honour_ignore_eos:
        max_tokens = max(1, max_tokens // 2)  # as if each completion met its end early
    plan = reduction_plan(step_size, config.sizes(), config.invariant and not config.coverage_gap)
    plan = (plan[0], plan[1] + config.rotation_offset)
    if neighbour > config.prefill_tile and not config.invariant:
        plan = (plan[0], plan[1] + 2)  # a longer prefill beside it: another tile, another order
    if no_logprobs and config.logprobs_path_differs:
        plan = (plan[0], plan[1] + 5)  # no logprobs asked: another sampling path
    results = []
    for i, prompt in enumerate(prompts):
        prefix = prefixes[i] if prefixes else []
        cached_path = bool(config.cache_path_differs and hits and hits[i])
        own_plan = (plan[0], plan[1] + 3) if cached_path else plan
        second_run = bool(config.copies_split and not config.invariant and i >= config.copies_split)
        if second_run:
            own_plan = (own_plan[0], own_plan[1] + 1)
        # A reproducible completion depends on nothing else: computed once, it is served again
        # (what a request sees is the same; only the practice engine's own CPU is spared).
        key = (prompt, tuple(prefix), step_size, cached_path, second_run, max_tokens, temperature,
               top_p, seed, ignore_eos, own_plan)
        reproducible = temperature <= 0.0 or seed is not None
        if reproducible and key in state.computed:
            results.append(state.computed[key])
            continue
        rng = random.Random(seed) if seed is not None else state.shared_rng
        out = generate(prompt, max_tokens, own_plan, temperature, top_p, rng, ignore_eos, prefix)
        out["step_size"] = step_size
        if reproducible:
            state.remember(key, out)
        results.append(out)
    if max_tokens > 1:
        with state.lock:
            state.served_log.extend(
                {"prompt": prompt, "neighbour": neighbour, "cached": bool(hits and hits[i]),
                 "ids": out["ids"],
                 "logprobs": [step[v] for v, step in zip(out["ids"], out["logprobs"])],
                 # each step's top-5 as a request for 5 top logprobs is answered
                 "top": [top_entries(step, v, 5) for v, step in zip(out["ids"], out["logprobs"])]}
                for i, (prompt, out) in enumerate(zip(prompts, results)))
    if config.step_delay > 0 and not state.streaming():
        # Emulated GPU time: the batch takes steps x delay, however long the arithmetic above
        # took. On the virtual clock the flag's slowdown multiplies it here; on the real
        # clock the handler stretches all of the request's time (stretched), the batching
        # window and the arithmetic included, so the two arms differ by the stated factor.
        steps = max(len(r["ids"]) for r in results)
        virtual = config.clock is not None
        factor = config.slowdown if config.invariant and virtual else 1.0
        noise = 1.0 + config.jitter * (2.0 * state.timing_rng.random() - 1.0)
        busy = config.step_delay * factor * steps * noise
        if virtual:
            config.clock.advance(busy)
        else:
            time.sleep(max(0.0, started + busy - time.perf_counter()))
    return results


def prompt_token_count(prompt: str) -> int:
    return len(prompt.split()) + 1


# ----------------------------------------------------------------------------
# vLLM wire format


def edge_swapper(config: StubConfig):
    """Whether a completion's top-k lists have their k-th and (k+1)-th entries swapped."""
    return lambda out: config.topk_edge_swap and out.get("step_size", 1) > 1


def vllm_completions(config: StubConfig, body: Dict, state: EngineState) -> Dict:
    if body.get("model") not in (None, config.model):
        raise BadRequest(404, "The model `%s` does not exist." % body.get("model"),
                         "NotFoundError", "model")
    prompt = body.get("prompt")
    token_prompt = isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
    prefixes = None
    if token_prompt:  # one prompt given as token ids
        text, generated = split_ids(prompt)
        prompts, prefixes = [text], [generated]
    else:
        prompts = prompt if isinstance(prompt, list) else [prompt]
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise BadRequest(400, "prompt must be a string or a list of strings", param="prompt")
    k = body.get("logprobs")
    if k is not None and (not isinstance(k, int) or k > config.max_logprobs or k < 0):
        raise BadRequest(400, "Requested sample logprobs of %s, which is greater than max "
                         "allowed: %d (parameter=logprobs, value=%s)" % (k, config.max_logprobs, k),
                         param="logprobs")
    max_tokens = int(body.get("max_tokens") or 16)
    temperature = float(body.get("temperature", 1.0))
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BadRequest(400, "1 validation error:\n  {'type': 'value_error', 'loc': ('body',), 'msg': \"Value "
                         "error, Parameter 'cache_salt' must be a non-empty string if provided. "
                         "(parameter=cache_salt)\"}", "Bad Request", "cache_salt")
    # a request that asks for prompt_logprobs skips the prefix cache, and is neither served
    # nor counted in /metrics (vLLM 0.34.0: vllm/v1/core/kv_cache_manager.py lines 277-286
    # and 311-316)
    skips_cache = body.get("prompt_logprobs") is not None
    cached = [0 if skips_cache else state.cached_tokens(salt, p, hit)
              for p, hit in zip(prompts, forced_hits(config, len(prompts)))]
    lengths = [len(prompt)] if token_prompt else [prompt_token_count(p) for p in prompts]
    outs = run_batch(config, state, prompts, max_tokens, temperature, float(body.get("top_p", 1.0)),
                     seed_of(config, body.get("seed")), bool(body.get("ignore_eos")), prefixes, [c > 0 for c in cached],
                     max(lengths), k is None)
    prompt_k = body.get("prompt_logprobs")
    swap = edge_swapper(config)
    as_ids = bool(body.get("return_tokens_as_token_ids"))
    name = (lambda v: "token_id:%d" % v) if as_ids else token_text
    choices = []
    for index, out in enumerate(outs):
        logprobs = None
        if k is not None:
            tokens = [name(v) for v in out["ids"]]
            offsets, pos = [], 0
            for t in tokens:
                offsets.append(pos)
                pos += len(t)
            logprobs = {
                "text_offset": offsets,
                "token_logprobs": [step[v] for v, step in zip(out["ids"], out["logprobs"])],
                "tokens": tokens,
                "top_logprobs": [{name(v): lp for v, lp in top_entries(step, chosen, k, swap(out))}
                                 for chosen, step in zip(out["ids"], out["logprobs"])],
            }
        choices.append({
            "index": index,
            "text": "".join(token_text(v) for v in out["ids"]),
            "logprobs": logprobs,
            "finish_reason": out["finish"],
            "stop_reason": None,
            "token_ids": None,
            "prompt_logprobs": None if prompt_k is None or not token_prompt or not config.prompt_logprobs else [
                None if lp is None else {str(t): {"logprob": lp, "rank": 1, "decoded_token": token_text(t) if t < 32 else "?"}}
                for t, lp in zip(prompt, prompt_logprob_list(config, prompt))],
            "prompt_token_ids": None,
            "routed_experts": None,
        })
    state.served([c["text"] for c in choices])
    if prompt_k is not None and token_prompt and config.prompt_logprobs:
        # a prefill read back (the prefill check): its generated part's logprobs, logged as
        # what the engine computed (GET /stub/served)
        text, generated = split_ids(prompt)
        values = prompt_logprob_list(config, prompt)[len(prompt) - len(generated):]
        with state.lock:
            state.served_log.append({"prefill_of": text, "generated": generated,
                                     "logprobs": values})
    prompt_tokens = sum(prompt_token_count(p) for p in prompts)
    completion_tokens = sum(len(o["ids"]) for o in outs)
    return {
        "id": "cmpl-%016x" % random.getrandbits(64),
        "object": "text_completion",
        "created": int(time.time()),
        "model": config.model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": "vllm-0.26.0-stub",
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                  "completion_tokens": completion_tokens,
                  # as with --enable-prompt-tokens-details: the last prompt's count only
                  "prompt_tokens_details": {"cached_tokens": reported_cached(config, cached[-1]),
                                            "created_cache_tokens": None,
                                            "multimodal_tokens": None} if config.prompt_tokens_details else None},
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def reported_cached(config: StubConfig, served: int) -> int:
    """The cached-token count an answer reports: what the cache served, or 0 for a server that
    serves from its cache without counting it (--uncounted-cache-hits)."""
    return 0 if config.uncounted_cache_hits else served


def cache_block_size(config: StubConfig) -> Optional[int]:
    """The tokens of one prefix-cache block as the engine says it (vllm:cache_config_info's
    block_size): --block-size, else vLLM 0.34.0's 64 (vllm/config/cache.py line 185, 0.34.0);
    None before 0.34.0 without --block-size (the practice engine's cache then serves a token at
    a time, and /metrics says no block size)."""
    if config.engine != "vllm":
        return None
    if config.block_size is not None:
        return config.block_size
    return 64 if release(config.version) >= (0, 34) else None


def vllm_metrics(config: StubConfig, state: "EngineState") -> bytes:
    """/metrics as vLLM writes its prefix-cache counters (the real 0.26.0 answer in
    fixtures/vllm-0.26.0/metrics_excerpt.txt; the names in vllm/v1/metrics/loggers.py, 0.34.0
    lines 661-679)."""
    queried, served = state.counters()
    labels = 'engine="0",model_name="%s"' % config.model
    lines = []
    for name, value, doc in (
            ("vllm:prefix_cache_queries_total", queried,
             "Prefix cache queries, in terms of number of queried tokens."),
            ("vllm:prefix_cache_hits_total", served,
             "Prefix cache hits, in terms of number of cached tokens.")):
        lines += ["# HELP %s %s" % (name, doc), "# TYPE %s counter" % name,
                  "%s{%s} %.1f" % (name, labels, value)]
    block = cache_block_size(config)
    if block is not None:  # as 0.34.0 writes its cache settings (a real H100 arm's line, of
        # some 20 labels more, shortened to those the lab or a reader looks at)
        lines += ["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
                  "# TYPE vllm:cache_config_info gauge",
                  'vllm:cache_config_info{block_size="%d",cache_dtype="auto",'
                  'enable_prefix_caching="%s",engine="0",hash_block_size="None"} 1.0'
                  % (block, config.prefix_caching)]
    return ("\n".join(lines) + "\n").encode()


def sglang_metrics(config: StubConfig, state: "EngineState") -> bytes:
    """/metrics as SGLang 0.5.23 writes the scheduler's prefill-token counter (observability/
    metrics_collector.py lines 1040-1046 and 1580-1596: a mode's line appears once it counts)."""
    queried, served = state.counters()
    name = "sglang:prefill_effective_tokens"
    lines = ["# HELP %s Effective prefill tokens with retracted-request re-counts excluded, "
             "updated on each log interval." % name, "# TYPE %s counter" % name]
    for mode, value in (("input", queried - served), ("device_hit", served)):
        if value > 0:
            lines.append('%s_total{model_name="%s",mode="%s",tp_rank="0"} %.1f'
                         % (name, config.model, mode, value))
    lines += ["# HELP sglang:cache_hit_rate The prefix cache hit rate.",
              "# TYPE sglang:cache_hit_rate gauge",
              'sglang:cache_hit_rate{model_name="%s",tp_rank="0"} 0.0' % config.model]
    return ("\n".join(lines) + "\n").encode()


def vllm_server_info(config: StubConfig) -> Dict:
    """A real vLLM dev-mode answer (0.26.0's, or 0.33.0's from that release on), with the
    stub's own settings written in."""
    template = VLLM_033_INFO_TEMPLATE if release(config.version) >= (0, 33) else VLLM_INFO_TEMPLATE
    with open(template, encoding="utf-8") as f:
        info = json.load(f)
    vc = info["vllm_config"]
    vc["model_config"]["model"] = config.model
    vc["model_config"]["served_model_name"] = config.model
    vc["model_config"]["tokenizer"] = config.model
    vc["model_config"]["max_model_len"] = config.max_model_len  # as /v1/models says
    vc["scheduler_config"]["max_num_seqs"] = config.max_num_seqs
    vc["model_config"]["max_logprobs"] = config.max_logprobs  # --max-logprobs
    vc["attention_config"]["backend"] = config.backend()
    vc["compilation_config"]["cudagraph_capture_sizes"] = config.sizes()
    vc["compilation_config"]["max_cudagraph_capture_size"] = max(config.sizes())
    # 0.26.0's flag turned custom all-reduce off; 0.33.0's keeps it on (one-stage)
    vc["parallel_config"]["disable_custom_all_reduce"] = (
        config.invariant and release(config.version) < (0, 33)
    )
    vc["parallel_config"]["tensor_parallel_size"] = config.tp_size
    vc["instance_id"] = str(random.getrandbits(60))
    info["vllm_env"]["VLLM_BATCH_INVARIANT"] = config.invariant
    vc["cache_config"]["enable_prefix_caching"] = config.prefix_caching
    info["vllm_env"]["VLLM_TEST_FORCE_LOAD_FORMAT"] = None
    vc["load_config"]["load_format"] = "stub"
    if release(config.version) >= (0, 33):
        # 0.33.0's flag turns on breakable CUDA graphs, which run without torch.compile
        # (compilation mode NONE): vllm/config/vllm.py lines 842-869 of vLLM 0.33.0, and as
        # the real pair in fixtures/vllm-0.33.0/ reports (3 and false off, 0 and true on)
        info["vllm_env"]["VLLM_USE_BREAKABLE_CUDAGRAPH"] = config.invariant
        vc["compilation_config"]["mode"] = 0 if config.invariant else 3
    if release(config.version) >= (0, 34):
        # 0.34.0 keeps it in the config and leaves the environment variable false (vllm/config/
        # vllm.py lines 810-834 of 0.34.0; the real arms' logs in fixtures/vllm-0.34.0/)
        info["vllm_env"]["VLLM_USE_BREAKABLE_CUDAGRAPH"] = False
        vc["compilation_config"]["use_breakable_cudagraph"] = config.invariant
    return overridden(info, config)


def release(version: str) -> Tuple[int, ...]:
    """"0.33.0" -> (0, 33, 0)."""
    return tuple(int(part) for part in version.split("+")[0].split(".") if part.isdigit())


# What real vLLM 0.26.0 and 0.33.0 servers answered at /server_info when vLLM's environment
# report failed (its `pip list` returned nothing): examples/real/8b-1xH200-2026-12-01
SERVER_INFO_500 = (b'{"error":{"message":"\'NoneType\' object has no attribute \'splitlines\'",'
                   b'"type":"InternalServerError","param":null,"code":500}}')


def overridden(info: Dict, config: StubConfig) -> Dict:
    """/server_info with the test's chosen settings written in (a hazard switched on, say)."""
    for path, value in config.info_overrides.items():
        node = info
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return info


def models_list(config: StubConfig) -> Dict:
    """/v1/models, as both engines answer it; max_model_len is the context length in force."""
    return {"object": "list", "data": [{
        "id": config.model, "object": "model", "created": int(time.time()), "owned_by": config.engine,
        "root": config.model, "parent": None, "max_model_len": config.max_model_len, "permission": []}]}


# ----------------------------------------------------------------------------
# SGLang wire format

SGLANG_SAMPLING_KEYS = {
    "max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature",
    "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "regex", "ebnf", "json_schema", "structural_tag", "n", "custom_params", "logit_bias",
    "sampling_seed",
}


def sglang_generate(config: StubConfig, body: Dict, state: EngineState):
    """SGLang 0.5.23's /generate: its error bodies, and sampling_seed honoured only with the flag."""
    text, input_ids = body.get("text"), body.get("input_ids")
    prefixes, id_lists = None, None
    if text is None and input_ids is not None:  # token ids in place of text
        batch = isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list)
        id_lists = input_ids if batch else [input_ids or []]
        split = [split_ids(ids) for ids in id_lists]
        prefixes = [generated for _, generated in split]
        text = [t for t, _ in split] if batch else split[0][0]
    prompts = text if isinstance(text, list) else [text]
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise BadRequest(400, "text must be a string or a list of strings",
                         body={"object": "error", "message": "1 validation error for GenerateReqInput: text "
                                                              "must be a string or a list of strings"})
    sp = body.get("sampling_params") or {}
    unknown = sorted(set(sp) - SGLANG_SAMPLING_KEYS)
    if unknown:  # 0.5.22-0.5.23: the request contract check answers with a bare string
        raise BadRequest(400, "unknown field", body={"error": "unknown field `%s`, expected one of %s" % (
            unknown[0], ", ".join("`%s`" % k for k in sorted(SGLANG_SAMPLING_KEYS)))})
    seed = sp.get("sampling_seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise BadRequest(400, "sampling_seed must be an integer, got %s." % type(seed).__name__)
    # Per-request seeds exist only with deterministic inference (sampling_batch_info.py,
    # 0.5.23 lines 157-171): the seed, else 42. Flag off, every request samples unseeded.
    seed = (42 if seed is None else seed) if config.invariant else None
    keys = body.get("extra_key")  # the radix cache is namespaced by it, per prompt
    if isinstance(keys, str) or keys is None:
        keys = [keys] * len(prompts)
    elif not isinstance(keys, list) or len(keys) != len(prompts):
        raise BadRequest(400, "The length of extra_key should be equal to the batch size.")
    cached = [state.cached_tokens(key, p, hit)
              for key, p, hit in zip(keys, prompts, forced_hits(config, len(prompts)))]
    lengths = [len(ids) for ids in id_lists] if id_lists else [prompt_token_count(p) for p in prompts]
    outs = run_batch(config, state, prompts, int(sp.get("max_new_tokens", 128)),
                     float(sp.get("temperature", 1.0)), float(sp.get("top_p", 1.0)), seed,
                     bool(sp.get("ignore_eos")), prefixes, [c > 0 for c in cached], max(lengths),
                     not body.get("return_logprob"))
    start = body.get("logprob_start_len", -1)
    with_logprobs = bool(body.get("return_logprob"))
    k = int(body.get("top_logprobs_num") or 0)
    show = (lambda v: token_text(v)) if body.get("return_text_in_logprobs") else (lambda v: None)
    swap = edge_swapper(config)
    answers = []
    for n, (out, prompt, hit) in enumerate(zip(outs, prompts, cached)):
        meta = {
            "id": "%032x" % random.getrandbits(128),
            "finish_reason": ({"type": "length", "length": len(out["ids"])} if out["finish"] == "length"
                              else {"type": "stop", "matched": EOS_ID}),
            "prompt_tokens": prompt_token_count(prompt),
            "completion_tokens": len(out["ids"]),
            "cached_tokens": reported_cached(config, hit),
        }
        if with_logprobs:
            # logprob_start_len defaults to -1: no prompt positions, but the key is there. From a
            # start s: positions s.. as [logprob, id, text], the first one's logprob None
            # (logprob_result_processor.py, 0.5.23 lines 26-50).
            ids = tokenize(prompt) + (prefixes[n] if prefixes else [])
            values = prompt_logprob_list(config, ids)
            meta["input_token_logprobs"] = [] if start < 0 else (
                [[None, ids[start], None]] + [[values[p], ids[p], None] for p in range(start + 1, len(ids))])
            meta["output_token_logprobs"] = [[step[v], v, show(v)]
                                             for v, step in zip(out["ids"], out["logprobs"])]
            if k:  # only asked-for top-k lists appear at all
                meta["output_top_logprobs"] = [[[step[v], v, show(v)] for v in top_ranked(step, k, swap(out))]
                                               for step in out["logprobs"]]
        answers.append({"text": "".join(token_text(v) for v in out["ids"]),
                        "output_ids": out["ids"], "meta_info": meta})
    state.served([a["text"] for a in answers])
    return answers if isinstance(text, list) else answers[0]


def sglang_server_info(config: StubConfig, port: int) -> Dict:
    sizes = config.sizes()
    return overridden({
        "model_path": config.model, "tokenizer_path": config.model, "served_model_name": config.model,
        "host": config.host, "port": port, "dtype": "bfloat16", "kv_cache_dtype": "auto",
        "quantization": None, "load_format": "stub",
        "tp_size": config.tp_size, "pp_size": 1, "dp_size": 1, "attention_backend": config.backend(),
        "sampling_backend": "pytorch" if config.invariant else "flashinfer",
        "enable_deterministic_inference": config.invariant, "disable_radix_cache": not config.prefix_caching,
        "chunked_prefill_size": 8192, "max_prefill_tokens": 16384,
        # the raw flags, null unless passed; the limit in force is in internal_states
        "max_running_requests": None, "context_length": None, "disable_cuda_graph": False,
        "cuda_graph_max_bs_decode": max(sizes),
        "cuda_graph_config": {"decode": {"bs": sizes, "backend": "full" if config.decode_graphs else "disabled"},
                              "prefill": {"backend": "breakable"}},  # as the real 0.5.23 pair
        "random_seed": random.getrandbits(30), "max_total_num_tokens": 400000 + random.getrandbits(10),
        "internal_states": [{"effective_max_running_requests_per_dp": config.max_num_seqs,
                             "last_gen_throughput": 0.0, "startup_time": time.time()}],
        "version": "0.5.23+stub",
    }, config)


# ----------------------------------------------------------------------------
# HTTP plumbing


class StubHandler(BaseHTTPRequestHandler):
    server_version = "stub/1"

    def log_message(self, fmt, *args):  # keep test output clean
        pass

    @property
    def config(self) -> StubConfig:
        return self.server.config

    def send_json(self, status: int, payload, raw: Optional[bytes] = None) -> None:
        # compact, as both engines write their answers (the lab saves a baseline's lists as sent)
        data = raw if raw is not None else json.dumps(payload, separators=(",", ":")).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_text(self, status: int, data: bytes) -> None:
        """Prometheus' text format, as both engines serve /metrics."""
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_error_body(self, err: BadRequest) -> None:
        if err.body is not None:
            payload = err.body
        elif self.config.engine == "vllm":
            payload = {"error": {"message": err.message, "type": err.kind, "param": err.param,
                                 "code": err.status}}
        else:
            payload = {"error": {"message": err.message}}
        self.send_json(err.status, payload)

    def do_GET(self):
        self.server.record(self)
        path = urlsplit(self.path).path
        if self.config.redirect_get_to:
            self.send_response(302)
            self.send_header("Location", self.config.redirect_get_to + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        port = self.server.server_address[1]
        if path == "/health":
            return self.send_json(200, None, raw=b"")
        if path == "/stub/stats":
            return self.send_json(200, self.server.state.stats())
        if path == "/stub/served":
            with self.server.state.lock:
                return self.send_json(200, list(self.server.state.served_log))
        if path == "/metrics" and (self.config.engine == "vllm" or self.config.enable_metrics) \
                and not self.config.no_metrics:
            with self.server.state.lock:
                self.server.state.metrics_reads += 1
                read = self.server.state.metrics_reads
            if read in self.config.metrics_faults:
                return self.send_text(503, b"Service Unavailable\n")
            write = vllm_metrics if self.config.engine == "vllm" else sglang_metrics
            return self.send_text(200, write(self.config, self.server.state))
        if self.config.engine == "vllm":
            routes = {"/version": lambda: {"version": self.config.version},
                      "/v1/models": lambda: models_list(self.config)}
            if self.config.dev_mode and self.config.server_info_500 and path == "/server_info":
                return self.send_json(500, None, raw=SERVER_INFO_500)
            if self.config.dev_mode:
                routes["/server_info"] = lambda: vllm_server_info(self.config)
        else:
            routes = {"/server_info": lambda: sglang_server_info(self.config, port),
                      "/v1/models": lambda: models_list(self.config)}
        if path in routes:
            return self.send_json(200, routes[path]())
        self.send_json(404, {"detail": "Not Found"})

    def do_POST(self):
        received = time.perf_counter()  # the request line and headers are in: its time starts
        path = urlsplit(self.path).path
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        self.server.record(self, raw)
        if self.config.engine == "sglang" and path == "/flush_cache":
            if self.config.flush_refused:
                return self.send_json(400, None, raw=b"Cache not flushed. Please check backend logs for more "
                                      b"details. (When there are running or waiting requests, the operation "
                                      b"will not be performed.)")
            self.server.state.flush()
            return self.send_json(200, None, raw=b"Cache flushed.\nPlease check backend logs for more details.")
        if path == "/tokenize" and not self.config.no_tokenize:  # both engines (SGLang's:
            # python/sglang/srt/entrypoints/http_server.py, 0.5.23 lines 1906-1921)
            body = json.loads(raw or b"{}")
            ids = tokenize(body.get("prompt") or "")
            if body.get("prompt") == self.config.tokenizer_probe_differs:
                ids = [i + 1 for i in ids]  # another tokenizer: the lab's probe text tokenized otherwise
            return self.send_json(200, {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids,
                                        "token_strs": None})
        handlers = {"vllm": {"/v1/completions": vllm_completions},
                    "sglang": {"/generate": sglang_generate}}[self.config.engine]
        if path not in handlers:
            return self.send_json(404, {"detail": "Not Found"})
        fault = self.server.next_fault()
        if fault == "drop":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if fault == "stall":
            time.sleep(STALL_SECONDS)
        if fault == "http500":
            return self.send_error_body(BadRequest(500, "EngineCore encountered an issue.",
                                                   "InternalServerError"))
        if fault == "badjson":
            return self.send_json(200, None, raw=b'{"choices": [ this is not json')
        if fault == "redirect":
            self.send_response(307)
            self.send_header("Location", "http://example.invalid" + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if fault == "huge":
            return self.send_json(200, None, raw=b'{"pad": "' + b"x" * (3 * 1024 * 1024) + b'"}')
        if fault == "slowstatus":  # the status line a byte every 0.2 s: no read ever times out
            for byte in b"HTTP/1.1 200 OK\r\n" * 20:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.2)
            return
        if fault == "trickle":  # headers at once, then a byte every 0.1 s: no read ever times out
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(200):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.1)
            return
        if fault == "truncate":  # promises more than it sends, then hangs up
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "5000")
            self.end_headers()
            self.wfile.write(b'{"choices": [')
            self.close_connection = True
            return
        if fault == "endlessline":  # a stream whose first line never ends: a byte every 0.1 s
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.end_headers()
            self.wfile.write(b"data: {")
            for _ in range(600):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.1)
            return
        if fault == "longline":  # an event line of 2 MiB: longer than any engine's event
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.end_headers()
            self.wfile.write(b'data: {"pad": "' + b"x" * (2 << 20) + b'"}\n\n')
            return
        if fault == "keyinbody":  # a plain-text error that repeats the key after 190 characters
            key = (self.headers.get("Authorization") or "").split(" ")[-1]
            body = ("x" * 190 + " key " + key.upper() + " refused").encode()
            self.send_response(401)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if fault == "echokey":  # an error body that repeats the request's credentials
            return self.send_error_body(BadRequest(401, "invalid key %s" % self.headers.get("Authorization"),
                                                   "AuthenticationError"))
        try:
            body = json.loads(raw or b"{}")
            self.server.state.local.stream = bool(isinstance(body, dict) and body.get("stream")) and fault != "nostream"
            self.server.state.local.forced_hit = fault == "cachehit"
            arrived = time.perf_counter()
            answer = handlers[path](self.config, body, self.server.state)
        except BadRequest as err:
            return self.send_error_body(err)
        except (ValueError, TypeError) as err:
            return self.send_error_body(BadRequest(400, str(err)))
        if self.server.state.streaming():
            prompt = body.get("prompt") if self.config.engine == "vllm" else body.get("text")
            return self.stream(answer, arrived, json.dumps(prompt), fault)
        self.stretched(received)
        self.send_json(200, corrupt(answer, fault, self.config.engine) if fault not in (None, "cachehit") else
                       floats_as_sent(answer, self.config))

    def stretched(self, received: float) -> None:
        """With the flag on, --slowdown F and --step-delay: wait until F times the time the
        request has taken since its headers were in (reading its body, its batching window,
        arithmetic and emulated GPU steps), so that all of the flag-on arm's own time is
        slowed by F, as the README says."""
        config = self.config
        if config.invariant and config.step_delay > 0 and config.clock is None:
            elapsed = time.perf_counter() - received
            time.sleep(max(0.0, (config.slowdown - 1.0) * elapsed))

    def stream(self, answer, arrived: float, prompt: str, fault: Optional[str] = None) -> None:
        """The answer as server-sent events, one per token, token k due k+1 step delays (x
        slowdown with the flag on, x seeded noise) after the request arrived: deadlines, not
        sleeps, so neither the stub's own arithmetic nor a late wake-up adds up; then [DONE]
        (or, with the cutstream fault, a hang-up half way). Faults of a stream's counts:
        usageatend (the count only in the last event), overshoot (more tokens than asked)."""
        events = stream_events(self.config.engine, answer, fault)
        cut = fault == "cutstream"
        config, state = self.config, self.server.state
        factor = config.slowdown if config.invariant else 1.0
        # The noise follows the engine's seed and the prompt, not the order requests come in:
        # with many in flight that order is the threads', and a test's figures must not be.
        # (A cost run's own tag, "[run id.trial.slot]", is left out, so runs repeat their noise.)
        key = re.sub(r"\[[0-9a-f]{8}\.", "[", prompt)
        noise = 1.0 + config.jitter * (2.0 * random.Random(zlib.crc32(key.encode()) ^ config.seed).random() - 1.0)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.end_headers()
        start = arrived
        for k, event in enumerate(events):
            if cut and k == len(events) // 2:
                self.close_connection = True
                return
            if k < len(events) - 1 or config.engine == "sglang":  # vLLM's last event carries usage only
                time.sleep(max(0.0, start + config.step_delay * factor * noise * (k + 1) - time.perf_counter()))
            self.wfile.write(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")


def stream_events(engine: str, answer, fault: Optional[str] = None) -> List[Dict]:
    """One prompt's answer as its stream: an event per token, as each engine sends them;
    with fault usageatend, overshoot or hugeusage, its token counts are damaged as the name says."""
    events = engine_stream_events(engine, answer)
    count_of = (lambda e: e.get("usage")) if engine == "vllm" else (lambda e: e["meta_info"])
    key = "completion_tokens"
    if fault == "usageatend":
        for event in events[:-1]:
            if count_of(event):
                count_of(event).pop(key, None)
    elif fault == "overshoot":
        count_of(events[-1])[key] += 5
    elif fault == "hugeusage":
        count_of(events[-1])[key] = 10 ** 400
    return events


def engine_stream_events(engine: str, answer) -> List[Dict]:
    """One prompt's answer as its stream: an event per token, as each engine sends them."""
    if engine == "vllm":
        choice, usage = answer["choices"][0], answer["usage"]
        ids = [int(t[9:]) if str(t).startswith("token_id:") else 0
               for t in ((choice.get("logprobs") or {}).get("tokens") or [])] or None
        count = usage["completion_tokens"]
        events = [{"id": answer["id"], "object": "text_completion", "created": answer["created"],
                   "model": answer["model"], "choices": [{"index": 0, "text": token_text(ids[k]) if ids else "",
                   "logprobs": None, "finish_reason": choice["finish_reason"] if k == count - 1 else None,
                   "stop_reason": None}],
                   "usage": {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": k + 1,
                             "total_tokens": usage["prompt_tokens"] + k + 1}} for k in range(count)]
        return events + [{"id": answer["id"], "object": "text_completion", "created": answer["created"],
                          "model": answer["model"], "choices": [], "usage": usage}]
    item = answer[0] if isinstance(answer, list) else answer
    ids, meta = item["output_ids"], item["meta_info"]
    return [{"text": "".join(token_text(v) for v in ids[:k + 1]), "output_ids": ids[:k + 1],
             "meta_info": dict({key: meta[key] for key in ("id", "prompt_tokens", "cached_tokens")},
                               completion_tokens=k + 1,
                               finish_reason=meta["finish_reason"] if k == len(ids) - 1 else None)}
            for k in range(len(ids))]


def floats_as_sent(answer, config: StubConfig):
    """A server that rounds its logprobs (not float32-exact) is emulated by a tiny nudge."""
    if not config.float64:
        return answer
    text = json.dumps(answer)
    return json.loads(text, parse_float=lambda s: float(s) * (1.0 + 2.0 ** -40))


def corrupt(answer, fault: str, engine: str):
    """Answers of the wrong shape, for the lab's fault tests."""
    answer = copy.deepcopy(answer)
    items = answer["choices"] if engine == "vllm" else answer
    if fault == "nochoices":
        return {"object": "text_completion"} if engine == "vllm" else {"detail": "nothing"}
    if fault == "fewer":
        del items[-1]
    elif fault == "nulllogprobs":
        if engine == "vllm":
            items[-1]["logprobs"] = None
        else:
            items[-1]["meta_info"]["output_token_logprobs"] = None
    elif fault == "ragged":
        if engine == "vllm":
            items[-1]["logprobs"]["token_logprobs"].pop()
        else:
            items[-1]["output_ids"].pop()
    elif fault == "overshoot":  # more output tokens counted than were asked for
        if engine == "vllm":
            answer["usage"]["completion_tokens"] += 5
        else:
            items[-1]["meta_info"]["completion_tokens"] += 5
    elif fault == "textonly":  # a detokenizer that writes one completion's text otherwise
        items[-1]["text"] += " "
    elif fault == "nanlogprobs":  # NaN where a logprob goes: the prompt's last, or step 0's
        if engine == "vllm":
            prompt_lps = items[0].get("prompt_logprobs")
            if prompt_lps:
                for entry in prompt_lps[-1].values():
                    entry["logprob"] = math.nan
            else:
                items[0]["logprobs"]["token_logprobs"][0] = math.nan
        else:
            items[0]["meta_info"]["output_token_logprobs"][0][0] = math.nan
    elif fault == "unicodeids":  # a token id in digits that are not ASCII (superscript two)
        for item in items:
            if engine == "vllm":
                item["logprobs"]["tokens"][0] = "token_id:\u00b2"
    elif fault == "hugeusage":  # a token count no float can hold
        if engine == "vllm":
            answer["usage"]["completion_tokens"] = 10 ** 400
        else:
            items[-1]["meta_info"]["completion_tokens"] = 10 ** 400
    elif fault == "clamp":
        # Each engine's stand-in for -inf (vLLM -9999.0, SGLang float32's lowest value) in
        # the last completion's first step.
        if engine == "vllm":
            items[-1]["logprobs"]["token_logprobs"][0] = -9999.0
        else:
            items[-1]["meta_info"]["output_token_logprobs"][0][0] = -3.4028234663852886e38
    return answer


class StubHTTPServer(ThreadingHTTPServer):
    daemon_threads = False
    block_on_close = True
    allow_reuse_address = True
    request_queue_size = 2048  # the listen backlog uvicorn gives vLLM and SGLang (socketserver's is 5)

    def __init__(self, config: StubConfig):
        self.config = config
        self.state = EngineState(config)
        self.lock = threading.Lock()
        self.generation_requests = 0
        self.requests = []  # (method, path, headers) of every request, for tests
        self.bodies = []    # and the raw body of each
        self.arrived = []   # and when it arrived (monotonic seconds)
        super().__init__((config.host, config.port), StubHandler)

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return  # the client hung up first (a timeout test does that on purpose)
        super().handle_error(request, client_address)

    def record(self, handler: BaseHTTPRequestHandler, body: bytes = b"") -> None:
        with self.lock:
            self.requests.append((handler.command, handler.path, dict(handler.headers)))
            self.bodies.append(body)
            self.arrived.append(time.monotonic())  # when its body was in

    def next_fault(self) -> Optional[str]:
        with self.lock:
            self.generation_requests += 1
            return self.config.faults.get(self.generation_requests)


class StubServer:
    """Start in a background thread on a free port; stop cleanly (context manager)."""

    def __init__(self, config: Optional[StubConfig] = None):
        self.config = config or StubConfig()
        self.httpd = StubHTTPServer(self.config)
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="stub-server",
                                       kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return "http://%s:%d" % (host, port)

    @property
    def requests(self):
        return self.httpd.requests

    def generation_bodies(self) -> List[bytes]:
        """Raw bodies of the POSTs to the engine's generation endpoint, in order."""
        path = "/v1/completions" if self.config.engine == "vllm" else "/generate"
        return [b for (m, p, _), b in zip(self.httpd.requests, self.httpd.bodies) if m == "POST" and p == path]

    def start(self) -> "StubServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)

    def __enter__(self) -> "StubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ----------------------------------------------------------------------------
# Faults for the rules every sweep check keeps: a cache that serves what it was asked not to,
# a seed taken and not used


SERVED_LOG = 4096  # completions GET /stub/served keeps
CACHE_SERVES = ("all", "some", "one")


def forced_hits(config: StubConfig, count: int) -> List[bool]:
    """Which of a request's count prompts --cache-serves makes the prefix cache serve, whatever
    their cache keys: all of them (batch 1 too), those from the middle on, or only the last
    of a request of several (so vLLM's count, the last prompt's, shows it)."""
    kind = config.cache_serves
    if kind == "all":
        return [True] * count
    if kind == "some":
        return [i >= count // 2 for i in range(count)]
    if kind == "one" and count > 1:
        return [i == count - 1 for i in range(count)]
    return [False] * count


def seed_of(config: StubConfig, seed: Optional[int]) -> Optional[int]:
    """The seed a request samples with: none at all with --ignore-seed (the shared generator)."""
    return None if config.ignore_seed else seed


def parse_faults(items: List[str]) -> Dict[int, str]:
    faults = {}
    for item in items:
        k, _, kind = item.partition("=")
        if not k.isdigit() or kind not in FAULTS:
            raise SystemExit("stub_server: --fault takes K=KIND with KIND one of " + ", ".join(FAULTS))
        faults[int(k)] = kind
    return faults


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Practice engine for the batch-invariance lab.")
    p.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default 8000 (vllm) or 30000 (sglang)")
    p.add_argument("--invariant", action="store_true", help="batch-invariant arithmetic (flag on)")
    p.add_argument("--model", default="stub/tiny-f32")
    p.add_argument("--graph-sizes", default=None, help="comma-separated captured decode sizes")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--no-dev-mode", action="store_true", help="vLLM: no /server_info")
    p.add_argument("--version", default="0.26.0", dest="vllm_version", help="vLLM: the release it "
                   "answers as (0.33.0, 0.34.0: the flag-on arm's compile settings as that release "
                   "reports them)")
    p.add_argument("--block-size", type=int, default=None, help="vLLM: the prefix cache serves "
                   "whole blocks of this many tokens, said in /metrics (vllm:cache_config_info); "
                   "default 64 from --version 0.34.0 on, else a token at a time, not said")
    p.add_argument("--server-info-500", action="store_true", help="vLLM: /server_info answers "
                   "HTTP 500, as real servers did when vLLM's environment report failed")
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds per decode step")
    p.add_argument("--slowdown", type=float, default=1.0, help="delay factor with --invariant")
    p.add_argument("--jitter", type=float, default=0.0, help="+- share of the delay, seeded")
    p.add_argument("--tp-size", type=int, default=1, help="TP degree to report")
    p.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling and of the jitter")
    p.add_argument("--cache-path-differs", action="store_true", help="a prompt served from the "
                   "prefix cache is computed another way (try --cache-check against it)")
    p.add_argument("--rotation-offset", type=int, default=0, help="another kernel build: every "
                   "reduction starts this many terms further on (try --baseline URL against it)")
    p.add_argument("--copies-split", type=int, default=0, help="flag off: a request's prompts from this "
                   "one on (counting from 0) computed another way, as real engines answered copies")
    p.add_argument("--logprobs-path-differs", action="store_true", help="a request that asks for "
                   "no logprobs is computed another way (try --observer-check against it)")
    p.add_argument("--prefill-tile", type=int, default=32, help="flag off: a neighbour prefilling more "
                   "tokens than this in a decode's step moves the decode (default 32)")
    p.add_argument("--scheduler-window", type=float, default=0.05, help="seconds a step batch waits for "
                   "more requests to join it (default 0.05; 0 runs every request alone)")
    p.add_argument("--prompt-tokens-details", action="store_true", help="vLLM: report cached prompt tokens")
    p.add_argument("--no-prefix-caching", action="store_true", help="no prefix (radix) cache")
    p.add_argument("--uncounted-cache-hits", action="store_true", help="serve from the prefix cache "
                   "but report 0 cached tokens in the answer (/metrics still counts the hits)")
    p.add_argument("--enable-metrics", action="store_true", help="SGLang: serve /metrics (vLLM always does)")
    p.add_argument("--no-metrics", action="store_true", help="vLLM: /metrics not found")
    p.add_argument("--metrics-fault", type=int, action="append", default=[], metavar="K",
                   help="the K-th read of /metrics answers 503 (repeatable)")
    p.add_argument("--hits-beyond", type=int, default=0, help="/metrics counts this many more "
                   "hits for each prefill than the cache served (impossible counters)")
    p.add_argument("--counters-lag", type=float, default=0.0, help="seconds before /metrics "
                   "counts a prefill's prefix-cache lookups")
    p.add_argument("--no-decode-graphs", action="store_true", help="SGLang: report decode CUDA graphs as off")
    p.add_argument("--prefill-agrees", action="store_true", help="prefill computes as a batch-1 decode step")
    p.add_argument("--fault", action="append", default=[], metavar="K=KIND")
    p.add_argument("--load-seconds", type=float, default=0.0, help="seconds before the port "
                   "opens, as an engine loading its model (default 0)")
    p.add_argument("--cache-serves", choices=CACHE_SERVES, default=None, help="the prefix cache "
                   "serves every prompt (all), a request's prompts from the middle on (some) or "
                   "its last of several (one), whatever their cache keys")
    p.add_argument("--ignore-seed", action="store_true", help="vLLM: take a request's seed and "
                   "sample without it")
    p.add_argument("--max-logprobs", type=int, default=20, help="vLLM's --max-logprobs: a "
                   "request asking more top logprobs is answered 400 (default 20)")
    args = p.parse_args(argv)
    if args.load_seconds > 0:
        print("stub: loading for %gs (the port opens after)" % args.load_seconds, flush=True)
        time.sleep(args.load_seconds)
    config = StubConfig(
        engine=args.engine, invariant=args.invariant, model=args.model, host=args.host,
        port=args.port if args.port is not None else (8000 if args.engine == "vllm" else 30000),
        graph_sizes=[int(s) for s in args.graph_sizes.split(",")] if args.graph_sizes else None,
        max_num_seqs=args.max_num_seqs, attention_backend=args.attention_backend,
        dev_mode=not args.no_dev_mode, step_delay=args.step_delay, slowdown=args.slowdown,
        jitter=args.jitter, seed=args.seed, tp_size=args.tp_size, scheduler_window=args.scheduler_window,
        prompt_tokens_details=args.prompt_tokens_details, rotation_offset=args.rotation_offset,
        cache_path_differs=args.cache_path_differs, prefix_caching=not args.no_prefix_caching,
        copies_split=args.copies_split, version=args.vllm_version, prefill_tile=args.prefill_tile,
        block_size=args.block_size,
        logprobs_path_differs=args.logprobs_path_differs,
        server_info_500=args.server_info_500,
        decode_graphs=not args.no_decode_graphs,
        prefill_agrees=args.prefill_agrees,
        cache_serves=args.cache_serves, ignore_seed=args.ignore_seed,
        max_logprobs=args.max_logprobs,
        uncounted_cache_hits=args.uncounted_cache_hits, enable_metrics=args.enable_metrics,
        no_metrics=args.no_metrics, counters_lag=args.counters_lag,
        metrics_faults=tuple(args.metrics_fault), hits_beyond=args.hits_beyond,
        faults=parse_faults(args.fault))
    server = StubHTTPServer(config)
    print("stub %s server (flag %s) on http://%s:%d" % (
        config.engine, "on" if config.invariant else "off", *server.server_address[:2]), flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
