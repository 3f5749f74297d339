"""Free ports: drawn where outgoing connections never land, and never handed out twice."""

from __future__ import annotations

import pytest

from app.net import free_port


def test_free_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
        ephemeral_start = int(ranges.read().split()[0])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(20000 <= port < ephemeral_start for port in ports), sorted(ports)[-3:]


def test_a_named_port_range_is_the_only_one_drawn_from_and_a_malformed_one_is_refused(monkeypatch):
    from app import net

    monkeypatch.setenv(net.PORT_RANGE_ENV, "24000-24049")
    net._below_ephemeral.cache_clear()
    try:
        ports = [free_port() for _ in range(20)]
        assert all(24000 <= port <= 24049 for port in ports), ports
        monkeypatch.setenv(net.PORT_RANGE_ENV, "24050")
        net._below_ephemeral.cache_clear()
        with pytest.raises(ValueError, match="ARGUS_PORT_RANGE must be LOW-HIGH"):
            free_port()
    finally:
        monkeypatch.undo()
        net._below_ephemeral.cache_clear()
