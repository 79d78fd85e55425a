"""`python -m benchmarks.serving ARGS` is `vllm-rlt bench serve ARGS`
(vllm_rlt/entrypoints/bench/)."""

import sys

from vllm_rlt.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "serve", *sys.argv[1:]]))
