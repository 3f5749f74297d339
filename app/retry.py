"""The wait between tries of a loop that retries what failed: exponential, capped, with jitter, so
that a failure that persists (a window that cannot compact, a lease lost again and again) is tried
less and less often, many processes failing at once do not retry in step, and the loop knows how
many tries in a row have failed (to report a stuck one rather than retry it silently forever)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    base_s: float
    """The wait after the first failure, before jitter."""
    cap_s: float
    """The longest wait, before jitter."""
    failures: int = 0
    """Failures in a row: 0 after a success."""
    rng: random.Random = field(default_factory=random.Random, repr=False)

    def failed(self) -> float:
        """Count a failure; return how long to wait before the next try: between half and all of
        base x 2^(failures - 1), capped (never near zero, unlike full jitter: no tight loop)."""
        self.failures += 1
        ceiling = min(self.cap_s, self.base_s * 2 ** min(self.failures - 1, 60))
        return ceiling / 2 + self.rng.uniform(0, ceiling / 2)

    def succeeded(self) -> None:
        self.failures = 0
