"""Loopback plumbing shared by the broker, Serve and the tests: free ports, reachability."""

from __future__ import annotations

import random
import socket
from functools import cache
from pathlib import Path

# Ray's workers take ports 10,002-19,999 by default: free ports are drawn above them.
LOWEST_PORT = 20000
_handed_out: set[int] = set()
_random = random.SystemRandom()  # whatever a caller seeds `random` with, processes draw apart


@cache
def _below_ephemeral() -> range:
    """Ports from LOWEST_PORT up to where the kernel's ephemeral range begins (Linux: 32768)."""
    try:
        start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        start = 32768
    return range(LOWEST_PORT, max(start, LOWEST_PORT))


def free_port() -> int:
    """A port free on 127.0.0.1 for a server to bind soon, never one this process handed out before.
    Drawn from below the kernel's ephemeral range: the kernel gives those to outgoing connections,
    which took ports between the draw and the bind (a Serve proxy's, taken by its own replicas'
    calls to an MLflow server). Tansu advertises its listener port verbatim, so it is a real port."""
    candidates = _below_ephemeral()
    for _ in range(200):
        port = _random.choice(candidates) if candidates else 0
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # taken, or still in TIME_WAIT
                continue
            port = sock.getsockname()[1]
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port on 127.0.0.1 in {candidates}")


def accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False
