"""Stopping the ``ray start --block`` processes a test started, by process id (never ``ray stop``, which would
stop every Ray of the user on this machine)."""

from __future__ import annotations

import signal
import subprocess

import psutil


def stop_started(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM every process in ``procs`` at once; after ``grace_s`` seconds SIGKILL whatever of them, and of
    the descendants they had when called, is still alive. The test is over, so a graceful drain (which takes
    15-30 s per ``ray start``) buys nothing; the descendants are only those of these processes."""
    tree = []
    for proc in procs:
        if proc.poll() is None:
            try:
                tree += psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
            proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs([psutil.Process(p.pid) for p in procs if p.poll() is None] + tree,
                                 timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
