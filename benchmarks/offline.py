"""Offline benchmark: tokenloom against transformers. Same as `tokenloom bench offline`; pass its flags.

It builds its parser from tokenloom.bench.offline directly, so it needs only the engine's packages (not the
server's): the GPU script runs it on a machine whose python has torch and transformers but no FastAPI."""

import argparse
import sys

from tokenloom.bench.offline import add_offline_args, run_offline_bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="benchmarks/offline.py", description=__doc__)
    add_offline_args(parser)
    sys.exit(run_offline_bench(parser.parse_args()))
