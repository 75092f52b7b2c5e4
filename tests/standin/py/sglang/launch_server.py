"""`python3 -m sglang.launch_server ...`, as a stand-in: see tests/standin/engine.py."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import engine  # noqa: E402

if __name__ == "__main__":
    sys.exit(engine.sglang_main(sys.argv[1:]))
