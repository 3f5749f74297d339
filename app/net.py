"""Loopback plumbing shared by the broker, Serve and the tests: free ports, reachability."""

from __future__ import annotations

import socket


def free_port() -> int:
    # Tansu advertises its listener port verbatim, so it must be bound to a real port, never 0.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False
