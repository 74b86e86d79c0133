"""A real Prometheus for the monitoring tests: found on PATH, else installed from Debian's `prometheus`
package when the tests run as root with apt-get (CI does); a reason to skip otherwise."""

from __future__ import annotations

import os
import shutil
import subprocess


def ensure_prometheus() -> tuple[str | None, str]:
    """(path of the prometheus binary, "") or (None, why it is not available)."""
    found = shutil.which("prometheus")
    if found:
        return found, ""
    if shutil.which("apt-get") is None:
        return None, "prometheus is not installed and there is no apt-get to install it with"
    if os.geteuid() != 0:
        return None, "prometheus is not installed and installing it needs root (apt-get install prometheus)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"]
    log = ""
    # The package lists may be missing or stale on a fresh machine: update them and try once more.
    for step in (install, ["apt-get", "update"], install):
        try:
            done = subprocess.run(step, env=env, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            return None, f"`{' '.join(step)}` took over 10 minutes"
        log = (done.stdout + done.stderr)[-1500:]
        if step is install and done.returncode == 0:
            break
    found = shutil.which("prometheus")
    return (found, "") if found else (None, f"apt-get install prometheus failed: {log}")
