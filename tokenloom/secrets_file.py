"""Secrets (the API key, the KV secret) kept off command lines, which any local user can read in /proc.

`--api-key-file` / `--kv-secret-file` name a file holding the secret (surrounding whitespace dropped);
`tokenloom cluster` writes the secrets it hands its workers to such files, readable by its user only, in a
private folder it removes when it stops.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from tokenloom.errors import ConfigError


def read_secret(value: str | None, path: str | None, flag: str) -> str | None:
    """The secret given as `--FLAG value` or in `--FLAG-file path` (not both); None when neither."""
    if value is not None and path is not None:
        raise ConfigError(f"give --{flag} or --{flag}-file, not both")
    if path is None:
        return value
    try:
        secret = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"--{flag}-file {path}: {e.strerror or e}") from None
    if not secret:
        raise ConfigError(f"--{flag}-file {path} is empty")
    return secret


class SecretFiles:
    """A private folder (mode 0700) of secret files (mode 0600) for child processes; `close` removes it."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="tokenloom-secrets-"))

    def write(self, name: str, secret: str) -> str:
        path = self.folder / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret)
        return str(path)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
