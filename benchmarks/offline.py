"""Offline benchmark: tokenloom against transformers. Same as `tokenloom bench offline`; pass its flags."""

import sys

from tokenloom.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "offline", *sys.argv[1:]]))
