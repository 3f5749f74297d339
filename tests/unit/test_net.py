"""Free ports: drawn where outgoing connections never land, and never handed out twice."""

from __future__ import annotations

from app.net import free_port


def test_free_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
        ephemeral_start = int(ranges.read().split()[0])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(20000 <= port < ephemeral_start for port in ports), sorted(ports)[-3:]
