"""Stand-ins for the engines' own launch commands, `vllm serve` and
`python3 -m sglang.launch_server`, for the tests of examples/experiment.sh and the launch
scripts. They serve the practice engine (tests/stub_server.py), and they fail the ways the
real engines failed on a real GPU (an H200, vLLM 0.26.0 and SGLang 0.5.17):

- they take their flags as the engine does and refuse any other (so a launch script that
  passes a flag the engine does not know fails here as it would there);
- they take the port first, then load for a while before answering anything (a real vLLM
  took 60-130 s); a busy port ends them at once, as uvicorn's bind does;
- a stand-in that starts loading on a device where another one is still loading exits with
  the engine's out-of-memory message: the real flag-on arm's memory profiling counted the
  loading flag-off arm's memory as its own (`Available KV cache memory: -1.07 GiB`);
- fewer devices in CUDA_VISIBLE_DEVICES than the TP degree is refused;
- told so, one exits in the middle of the run, like an engine whose worker died.

The SGLang stand-in logs its arguments as SGLang 0.5.23 does (server_args=..., its --api-key
among them).

Environment (all optional):
  STANDIN_LOAD_S       seconds spent loading before the port answers (default 1.0)
  STANDIN_DEVICE_DIR   where loading stand-ins mark their devices (default: the temp folder)
  STANDIN_EXIT_AFTER   ARM:N, ARM off or on: that arm exits when generation request N+1 arrives
  STANDIN_STEP_DELAY   seconds per decode step (default 0)
"""

import argparse
import errno
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import stub_server  # noqa: E402

VLLM_BACKENDS = {  # --attention-backend -> the class path vLLM reports in /server_info
    "FLASH_ATTN": "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend",
    "TRITON_ATTN": "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend",
    "FLEX_ATTENTION": "vllm.v1.attention.backends.flex_attention.FlexAttentionBackend",
}

# What the engines print when their memory profiling finds no room (vLLM 0.26.0's lines are
# from the real failure; SGLang's is its KV-pool check's wording).
OUT_OF_MEMORY = {
    "vllm": [
        "INFO [gpu_worker.py:560] Available KV cache memory: -1.07 GiB",
        "ValueError: No available memory for the cache blocks. Try increasing "
        "`gpu_memory_utilization` when initializing the engine.",
    ],
    "sglang": ["RuntimeError: Not enough memory. Please try to increase --mem-fraction-static."],
}


def say(line: str) -> None:
    print(line, flush=True)


def devices() -> list:
    return [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",") if d]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def mark_loading(engine: str) -> list:
    """Mark every device this stand-in loads on; exit as the engine does if another stand-in
    is loading on one of them. Returns the marks, to be removed once loaded."""
    folder = os.environ.get("STANDIN_DEVICE_DIR") or tempfile.gettempdir()
    marks = []
    for device in devices():
        mark = os.path.join(folder, "standin-gpu%s.loading" % device)
        while True:
            try:
                fd = os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                try:
                    with open(mark) as f:
                        owner = int(f.read() or 0)
                except (OSError, ValueError):
                    owner = 0
                if owner and alive(owner):
                    for path in marks:
                        os.unlink(path)
                    for line in OUT_OF_MEMORY[engine]:
                        say(line)
                    sys.exit(1)
                try:
                    os.unlink(mark)  # left by a stand-in that is gone
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            marks.append(mark)
            break
    return marks


def exit_after(arm: str):
    """The number of generation requests this arm serves before it dies, or None."""
    spec = os.environ.get("STANDIN_EXIT_AFTER", "")
    name, _, count = spec.partition(":")
    return int(count) if spec and name == arm else None


def serve(engine: str, arm: str, config: "stub_server.StubConfig", tp: int) -> int:
    if len(devices()) < tp:
        say(
            "ValueError: tensor parallel size %d needs %d GPUs, but CUDA_VISIBLE_DEVICES=%s "
            "holds %d"
            % (tp, tp, ",".join(devices()), len(devices()))
        )
        return 1
    try:
        server = stub_server.StubHTTPServer(config)  # the port is taken before loading
    except OSError as err:
        if err.errno != errno.EADDRINUSE:
            raise
        say(
            "ERROR: [Errno 98] error while attempting to bind on address ('%s', %d): "
            "address already in use" % (config.host, config.port)
        )
        return 1
    say("INFO: loading (at %.3f)" % time.time())
    marks = mark_loading(engine)
    time.sleep(float(os.environ.get("STANDIN_LOAD_S", "1.0")))
    for mark in marks:
        os.unlink(mark)
    limit = exit_after(arm)
    if limit is not None:
        count_request = server.next_fault

        def next_fault():
            if server.generation_requests >= limit:
                say("RuntimeError: CUDA error: an illegal memory access was encountered")
                os._exit(1)
            return count_request()

        server.next_fault = next_fault
    say(
        "INFO: %s stand-in (flag %s) ready on http://%s:%d (at %.3f)"
        % (engine, arm, config.host, config.port, time.time())
    )
    try:
        server.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def step_delay() -> float:
    return float(os.environ.get("STANDIN_STEP_DELAY", "0"))


def vllm_main(argv) -> int:
    """`vllm serve MODEL ...` with the flags the launch script passes; the flag from
    VLLM_BATCH_INVARIANT, /server_info only with VLLM_SERVER_DEV_MODE=1, as vLLM does."""
    p = argparse.ArgumentParser(prog="vllm")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("model")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--attention-backend", choices=sorted(VLLM_BACKENDS), default="FLASH_ATTN")
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--max-model-len", type=int)
    s.add_argument("--tensor-parallel-size", type=int, default=1)
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    s.add_argument("--enable-prompt-tokens-details", action="store_true")
    s.add_argument(
        "--enable-prefix-caching", dest="prefix_caching", action="store_true", default=True
    )
    s.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false")
    s.add_argument("--api-key")  # vLLM also reads VLLM_API_KEY
    # the prefix cache's block, said in /metrics as vLLM says it (vllm:cache_config_info);
    # the stand-in's own default, 16: shorter than the lab's default prompt (20 tokens by the
    # practice engine's count), so that copies of it share the cache, as vLLM 0.33.0's did
    s.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    flag = os.environ.get("VLLM_BATCH_INVARIANT", "0") == "1"
    config = stub_server.StubConfig(
        engine="vllm",
        invariant=flag,
        model=args.model,
        host="0.0.0.0",
        port=args.port,
        max_num_seqs=args.max_num_seqs,
        attention_backend=VLLM_BACKENDS[args.attention_backend],
        dev_mode=os.environ.get("VLLM_SERVER_DEV_MODE") == "1",
        tp_size=args.tensor_parallel_size,
        prompt_tokens_details=args.enable_prompt_tokens_details,
        prefix_caching=args.prefix_caching,
        block_size=args.block_size,
        step_delay=step_delay(),
        scheduler_window=0.05,
        prefill_agrees=flag,
    )  # real vLLM 0.26.0: flag on, decode equals prefill bit for bit
    return serve("vllm", "on" if flag else "off", config, args.tensor_parallel_size)


def sglang_main(argv) -> int:
    """`python3 -m sglang.launch_server ...` with the flags the launch script passes."""
    p = argparse.ArgumentParser(prog="sglang.launch_server")
    p.add_argument("--model-path", required=True)
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--attention-backend", choices=("fa3", "flashinfer", "triton"))
    p.add_argument("--cuda-graph-max-bs-decode", type=int)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--sampling-backend", choices=("flashinfer", "pytorch"))
    p.add_argument("--enable-deterministic-inference", action="store_true")
    p.add_argument("--api-key")
    args = p.parse_args(argv)
    # SGLang 0.5.23 logs every argument at start-up, the key among them (a real log's line:
    # "[2026-12-01 19:17:46] server_args={'model_path': '/tmp/model8b', ..., 'api_key': None,
    # ...}"; examples/real/experiment-1xH200-sglang-0.5.23-8b/tp1/server_off.log, line 7)
    say("[%s] server_args=%r" % (time.strftime("%Y-%m-%d %H:%M:%S"), {
        "model_path": args.model_path, "tokenizer_path": args.model_path, "port": args.port,
        "api_key": args.api_key, "tp_size": args.tp_size,
        "enable_deterministic_inference": args.enable_deterministic_inference}))
    sizes = [
        s
        for s in stub_server.SGLANG_GRAPH_SIZES
        if s <= (args.cuda_graph_max_bs_decode or 1 << 30)
    ]
    config = stub_server.StubConfig(
        engine="sglang",
        invariant=args.enable_deterministic_inference,
        model=args.model_path,
        host="0.0.0.0",
        port=args.port,
        graph_sizes=sizes,
        attention_backend=args.attention_backend,
        tp_size=args.tp_size,
        prefix_caching=not args.disable_radix_cache,
        step_delay=step_delay(),
        scheduler_window=0.05,
        prefill_agrees=args.enable_deterministic_inference,
    )
    return serve(
        "sglang", "on" if args.enable_deterministic_inference else "off", config, args.tp_size
    )
