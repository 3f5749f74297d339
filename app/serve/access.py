"""Who may call the HTTP API, and how often (CONTRACT.md §4): bearer tokens and per-token rate limits.

    python -m app serve --api-tokens tokens.txt --http-host 0.0.0.0   # tokens required off loopback

A token file holds one token, or `sha256:<hex>` of one, per line (blank lines and `#` comments are
skipped). Only SHA-256 digests leave the file: they are what replicas keep and compare, in constant
time, so neither the file nor a replica's memory needs to hold a usable token. Rate limits are a
token bucket per token for the deployment as a whole: each of N replicas keeps 1/N of it, N from
the rollout coordinator's answers.
No Ray, no torch here: `app/serve/replica.py` wires it into the replicas;
tests/unit/test_http_auth.py tests it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import threading
import time
from dataclasses import dataclass, field

from app.errors import ConfigError

TOKENS_ENV = "ARGUS_API_TOKENS"
"""The server side: path of the token file `serve` reads when `--api-tokens` is not given."""
CLIENT_TOKEN_ENV = "ARGUS_API_TOKEN"
"""The client side: the token `promote` sends when it waits on /rollout."""


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def read_token_file(path: str) -> tuple[str, ...]:
    """The SHA-256 digests (hex) of a token file's tokens; ConfigError when unreadable or empty."""
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--api-tokens: cannot read {path}: {exc}") from exc
    digests = []
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("sha256:"):
            hexdigest = line.removeprefix("sha256:").strip().lower()
            if len(hexdigest) != 64 or any(c not in "0123456789abcdef" for c in hexdigest):
                raise ConfigError(f"--api-tokens: {path} line {number}: sha256: needs 64 hex digits")
            digests.append(hexdigest)
        else:
            digests.append(digest(line))
    if not digests:
        raise ConfigError(f"--api-tokens: {path} holds no token")
    return tuple(dict.fromkeys(digests))


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the endpoint on this machine. A name other than localhost is
    not trusted to stay loopback (it can resolve elsewhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (scheme case-insensitive, RFC 6750)."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


class TokenCheck:
    """Digests of the accepted tokens; `match` names which one a header carries."""

    def __init__(self, digests: tuple[str, ...] | list[str]):
        self._digests = [bytes.fromhex(d) for d in digests]

    def match(self, authorization: str | None) -> str | None:
        """The digest (hex) of the accepted token in the header, or None. Compares every digest with
        hmac.compare_digest: equal-length digests and no early exit, so timing says nothing about
        how much of a token was right or which one matched."""
        token = bearer_token(authorization)
        if token is None:
            return None
        presented = hashlib.sha256(token.encode()).digest()
        found = None
        for accepted in self._digests:
            if hmac.compare_digest(presented, accepted):
                found = accepted
        return found.hex() if found is not None else None


class RateLimiter:
    """A token bucket per key: `rate` requests a second on average, bursts of up to `burst`, for the
    deployment as a whole: each of N replicas keeps 1/N of both (`share_among`)."""

    def __init__(self, rate: float, burst: int, clock=time.monotonic):
        self.total_rate, self.total_burst, self._clock = rate, burst, clock
        self.rate, self.burst = rate, burst
        self._buckets: dict[str, tuple[float, float]] = {}  # key → (tokens left, when counted)
        self._lock = threading.Lock()

    def share_among(self, replicas: int) -> None:
        """Keep this replica's share when `replicas` serve: together they admit no more than the
        rate, and bursts of at most max(burst, replicas). Serve's router spreads requests, so a
        token near its limit may see a 429 a little early, never N times the rate."""
        replicas = max(1, int(replicas))
        with self._lock:
            self.rate = self.total_rate / replicas
            self.burst = max(1, self.total_burst // replicas)

    def take(self, key: str) -> float:
        """Take one request from `key`'s bucket: 0.0 if allowed, else the seconds until one is."""
        now = self._clock()
        with self._lock:
            tokens, then = self._buckets.get(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - then) * self.rate)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate


def retry_after(seconds: float) -> str:
    """A Retry-After value: whole seconds, at least 1 (RFC 9110 allows no fractions)."""
    return str(max(1, math.ceil(seconds)))


@dataclass(frozen=True, kw_only=True)
class AccessConfig:
    """`serve`'s access options: who may call (tokens), how often, and whether Swagger UI is up."""

    api_tokens: str | None = None
    """Token file (env ARGUS_API_TOKENS). Without one the API is open, which only loopback allows."""
    rate_limit: float = 50.0
    """Requests a second per token across the deployment, on average; 0 turns the limit off."""
    rate_burst: int | None = None
    """Requests a token may send at once before the rate applies (default: twice the rate, >= 1)."""
    docs: bool = False
    """Serve Swagger UI at /docs (the document itself, /openapi.json, is always there)."""
    token_digests: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if self.rate_limit < 0:
            raise ConfigError(f"--rate-limit must be >= 0, got {self.rate_limit}")
        if self.rate_burst is not None and self.rate_burst < 1:
            raise ConfigError(f"--rate-burst must be >= 1, got {self.rate_burst}")
        if self.api_tokens and not self.token_digests:
            object.__setattr__(self, "token_digests", read_token_file(self.api_tokens))

    @property
    def burst(self) -> int:
        return self.rate_burst or max(1, math.ceil(2 * self.rate_limit))

    def check_host(self, host: str) -> None:
        """Refuse to expose an open API: a non-loopback host needs tokens."""
        if not self.token_digests and not is_loopback(host):
            raise ConfigError(
                f"--http-host {host} is not a loopback address: pass --api-tokens FILE "
                f"(or set {TOKENS_ENV}) so that /predict and /model need a bearer token"
            )
