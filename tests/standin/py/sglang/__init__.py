"""A stand-in for the sglang package: only `python3 -m sglang.launch_server` (tests/standin/engine.py)."""
