"""Synthetic device traffic, deterministic from a seed: screenshots drawn by `app.data.scenes`, encoded
as PNG, JPEG or WebP, from non-IID users with 1-3 devices each, with event-time jitter, late
arrivals and undecodable values. `python -m app produce --synthetic N` publishes its records.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

from app.data.scenes import DEFAULT_CLASSES, MIN_SIZE, render

FORMATS = ("PNG", "JPEG", "WEBP")
_STEP_MS = 1_000  # nominal gap between consecutive records' event times
_USER_SKEW = 0.5  # Zipf exponent of user activity: mild, a few users produce more than others
_MIX_FLOOR = 0.05  # share of every user's mix spread evenly, so no class vanishes from the stream


@dataclass(frozen=True)
class SyntheticRecord:
    user_id: str  # "user-0007"; the Kafka key
    device_id: str  # "dev-0007-1": each user has 1-3 devices
    label: str  # one of the requested classes, also on corrupt records
    event_time_ms: int  # ms since the epoch when the behaviour happened
    value: bytes  # the encoded image, or undecodable bytes when `corrupt`
    corrupt: bool
    late: bool  # event time pushed about `late_by_ms` into the past


def _encode(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    # Fixed encoder options: the same pixels always give the same bytes.
    if fmt == "PNG":
        img.save(buf, "PNG", compress_level=1)
    elif fmt == "JPEG":
        img.save(buf, "JPEG", quality=90, subsampling=0, optimize=False)
    else:
        img.save(buf, "WEBP", quality=90, method=4)
    return buf.getvalue()


def _decodes(value: bytes) -> bool:
    try:
        with Image.open(io.BytesIO(value)) as im:
            im.load()
        return True
    except Exception:
        return False


def _corrupt(value: bytes, rng: np.random.Generator) -> bytes:
    """A truncated upload or plain garbage; checked, since headerless formats (TGA) can match noise
    and ImageFile.LOAD_TRUNCATED_IMAGES makes Pillow accept truncated files."""
    if rng.random() < 0.5:
        bad = value[: max(8, int(len(value) * rng.uniform(0.1, 0.7)))]
    else:
        bad = rng.bytes(int(rng.integers(16, 1024)))
    while _decodes(bad):
        bad = rng.bytes(int(rng.integers(16, 1024)))
    return bad


def generate(
    n: int,
    *,
    seed: int = 0,
    classes: Sequence[str] = DEFAULT_CLASSES,
    users: int = 50,
    size: int = 64,
    image_format: str = "PNG",
    dirichlet_alpha: float = 0.5,
    late_fraction: float = 0.05,
    late_by_ms: int = 3_600_000,
    corrupt_fraction: float = 0.0,
    now_ms: int | None = None,
    jitter_ms: int = 60_000,
) -> Iterator[SyntheticRecord]:
    """`n` records from `users` users, each with a Dirichlet(`dirichlet_alpha`) class mix.

    Event times end at `now_ms` and step about a second per record, ± `jitter_ms`; a `late_fraction`
    share is pushed back about `late_by_ms`. A `corrupt_fraction` share carries undecodable bytes.
    Same arguments, same records, byte for byte. Arguments are checked here, not at first `next()`.
    """
    classes = tuple(classes)
    fmt = {"JPG": "JPEG"}.get(image_format.upper(), image_format.upper())
    checks = [
        (n >= 0, f"n must be >= 0, got {n}"),
        (seed >= 0, f"seed must be >= 0, got {seed}"),
        (
            len(classes) > 0 and len(set(classes)) == len(classes),
            f"classes must be distinct and non-empty, got {classes}",
        ),
        (users >= 1, f"users must be >= 1, got {users}"),
        (size >= MIN_SIZE, f"size must be at least {MIN_SIZE}, got {size}"),
        (fmt in FORMATS, f"image_format must be one of {FORMATS}, got {image_format!r}"),
        (dirichlet_alpha > 0, f"dirichlet_alpha must be > 0, got {dirichlet_alpha}"),
        (0 <= late_fraction <= 1, f"late_fraction must be in [0, 1], got {late_fraction}"),
        (0 <= corrupt_fraction <= 1, f"corrupt_fraction must be in [0, 1], got {corrupt_fraction}"),
        (late_by_ms >= 0, f"late_by_ms must be >= 0, got {late_by_ms}"),
        (jitter_ms >= 0, f"jitter_ms must be >= 0, got {jitter_ms}"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)
    if now_ms is None:
        now_ms = time.time_ns() // 1_000_000
    return _records(
        n,
        seed,
        classes,
        users,
        size,
        fmt,
        dirichlet_alpha,
        late_fraction,
        late_by_ms,
        corrupt_fraction,
        now_ms,
        jitter_ms,
    )


def _records(
    n, seed, classes, users, size, fmt, alpha, late_fraction, late_by_ms, corrupt_fraction, now_ms, jitter_ms
) -> Iterator[SyntheticRecord]:
    k = len(classes)
    pop = np.random.default_rng([seed, 0])
    mixes = (1 - _MIX_FLOOR) * pop.dirichlet(np.full(k, alpha), size=users) + _MIX_FLOOR / k
    class_cdf = np.cumsum(mixes, axis=1)
    weights = 1.0 / (pop.permutation(users) + 1.0) ** _USER_SKEW
    user_cdf = np.cumsum(weights / weights.sum())
    devices = pop.integers(1, 4, size=users)
    start = now_ms - jitter_ms - (n - 1) * _STEP_MS
    for i in range(n):
        # One stream per record, every scalar drawn whatever the fractions: changing late or
        # corrupt shares leaves users, labels and pixels of every record as they were.
        rng = np.random.default_rng([seed, 1, i])
        u_user, u_class, u_dev, u_late, u_corrupt, late_scale = rng.random(6)
        jitter = int(rng.integers(-jitter_ms, jitter_ms + 1))
        u = min(int(np.searchsorted(user_cdf, u_user, side="right")), users - 1)
        label = classes[min(int(np.searchsorted(class_cdf[u], u_class, side="right")), k - 1)]
        late = bool(u_late < late_fraction)
        t = start + i * _STEP_MS + jitter
        if late:
            t -= int(late_by_ms * (0.9 + 0.2 * late_scale))
        value = _encode(render(label, rng, size), fmt)
        corrupt = bool(u_corrupt < corrupt_fraction)
        if corrupt:
            value = _corrupt(value, rng)
        yield SyntheticRecord(
            user_id=f"user-{u:04d}",
            device_id=f"dev-{u:04d}-{1 + int(u_dev * devices[u])}",
            label=label,
            event_time_ms=int(t),
            value=value,
            corrupt=corrupt,
            late=late,
        )
