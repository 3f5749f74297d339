"""Network plumbing shared by the CLI, the broker, Serve and the tests: free loopback ports,
reachability."""

from __future__ import annotations

import os
import random
import socket
from functools import cache
from pathlib import Path

from app.errors import ConfigError

# Ray's workers take ports 10,002-19,999 by default: free ports are drawn above them.
LOWEST_PORT = 20000
_handed_out: set[int] = set()
_random = random.SystemRandom()  # whatever a caller seeds `random` with, processes draw apart


PORT_RANGE_ENV = "ARGUS_PORT_RANGE"
"""`LOW-HIGH` (inclusive): the ports `free_port` draws from instead. Processes that share a host and
draw at once, such as the test suite's parallel workers, each get a range of their own, so none can
draw a port another drew and has not bound yet."""


@cache
def _below_ephemeral() -> range:
    """Ports from LOWEST_PORT up to where the kernel's ephemeral range begins (Linux: 32768), or
    the range PORT_RANGE_ENV names."""
    if named := os.environ.get(PORT_RANGE_ENV):
        low, _, high = named.partition("-")
        if not (low.isdigit() and high.isdigit() and 0 < int(low) <= int(high) < 65536):
            raise ValueError(f"{PORT_RANGE_ENV} must be LOW-HIGH, ports from 1 to 65535; it is {named!r}")
        return range(int(low), int(high) + 1)
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


def check_reachable(bootstrap_servers: str, timeout_s: float = 3.0) -> None:
    """Fail at the edge (exit 2) when no bootstrap server accepts a TCP connection."""
    errors = []
    for server in bootstrap_servers.split(","):
        host, port = host_port(server)
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                return
        except OSError as exc:
            errors.append(f"{server}: {exc.strerror or exc}")
    raise ConfigError(f"Kafka bootstrap servers unreachable ({'; '.join(errors)})")


def host_port(server: str) -> tuple[str, int]:
    """`host:port` as (host, port); ConfigError (exit 2) when it is not one."""
    host, sep, port = server.strip().rpartition(":")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"bad bootstrap server {server!r}: expected host:port")
    return host, int(port)
