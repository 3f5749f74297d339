"""Synthetic behaviour images: determinism, traffic shape (users, times, faults) and learnability."""

import io
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from app.data.scenes import DEFAULT_CLASSES, render
from app.data.synth import SyntheticRecord, generate

NOW = 1_700_000_000_000


def _load(value: bytes) -> Image.Image:
    im = Image.open(io.BytesIO(value))
    im.load()
    return im


def _top_shares(records: list[SyntheticRecord], min_records: int = 30) -> list[float]:
    by_user: dict[str, Counter] = {}
    for r in records:
        by_user.setdefault(r.user_id, Counter())[r.label] += 1
    return [max(c.values()) / sum(c.values()) for c in by_user.values() if sum(c.values()) >= min_records]


def test_same_arguments_give_identical_records():
    kw = dict(seed=3, size=32, corrupt_fraction=0.2, late_fraction=0.2, now_ms=NOW)
    a = list(generate(40, **kw))
    assert a == list(generate(40, **kw))
    assert [r.value for r in a] != [r.value for r in generate(40, **{**kw, "seed": 4})]
    # Fault shares are drawn per record: changing them leaves who sent what, and the pixels, alone.
    clean = list(generate(40, **{**kw, "corrupt_fraction": 0.0, "late_fraction": 0.0}))
    who = [(r.user_id, r.device_id, r.label) for r in a]
    assert [(r.user_id, r.device_id, r.label) for r in clean] == who
    assert all(c.value == r.value for c, r in zip(clean, a) if not r.corrupt)


def test_render_is_deterministic_rgb_of_requested_size():
    for label in DEFAULT_CLASSES + ("cryptominer",):
        for size in (16, 32, 64):
            im = render(label, np.random.default_rng(1), size)
            assert im.mode == "RGB" and im.size == (size, size)
            assert im.tobytes() == render(label, np.random.default_rng(1), size).tobytes()


def test_every_class_appears_and_ids_are_well_formed():
    records = list(generate(300, seed=0, size=16, now_ms=NOW))
    assert set(r.label for r in records) == set(DEFAULT_CLASSES)
    for r in records:
        assert r.user_id.startswith("user-") and r.device_id.startswith("dev-" + r.user_id[5:] + "-")
        assert int(r.device_id.rsplit("-", 1)[1]) in (1, 2, 3)
    assert len(set(r.user_id for r in records)) > 30  # 50 users, mildly skewed activity


def test_users_have_skewed_class_mixes():
    k = len(DEFAULT_CLASSES)
    kw = dict(seed=0, users=20, size=16, late_fraction=0, now_ms=NOW)
    skewed = _top_shares(list(generate(2000, **kw)))
    iid = _top_shares(list(generate(2000, **kw, dirichlet_alpha=1000.0)))
    assert len(skewed) >= 15 and len(iid) >= 15
    # Dirichlet(0.5) over 6 classes: a user's top class takes about half; drawn IID, about a quarter.
    assert np.median(skewed) > 2.4 / k, sorted(skewed)
    assert np.median(iid) < 1.8 / k, sorted(iid)  # a large alpha makes users alike: the knob is wired


def test_fault_fractions_and_decoding():
    n, size = 400, 16
    records = list(generate(n, seed=1, size=size, late_fraction=0.15, corrupt_fraction=0.2, now_ms=NOW))
    corrupt = [r for r in records if r.corrupt]
    assert 0.12 * n < len(corrupt) < 0.28 * n
    assert 0.08 * n < sum(r.late for r in records) < 0.22 * n
    assert set(r.label for r in corrupt) <= set(DEFAULT_CLASSES)
    truncated = [r for r in corrupt if r.value.startswith(b"\x89PNG")]
    assert 0 < len(truncated) < len(corrupt)  # both truncated images and garbage
    for r in corrupt:
        with pytest.raises(Exception):  # noqa: B017 (Pillow raises several types for corrupt bytes)
            _load(r.value)
    for r in records:
        if not r.corrupt:
            im = _load(r.value)
            assert (im.format, im.mode, im.size) == ("PNG", "RGB", (size, size))


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP"])
def test_other_formats(fmt):
    records = list(generate(30, seed=2, size=32, image_format=fmt.lower(), corrupt_fraction=0.3, now_ms=NOW))
    assert any(r.corrupt for r in records) and not all(r.corrupt for r in records)
    for r in records:
        if r.corrupt:
            with pytest.raises(Exception):  # noqa: B017 (Pillow raises several types for corrupt bytes)
                _load(r.value)
        else:
            im = _load(r.value)
            assert (im.format, im.mode, im.size) == (fmt, "RGB", (32, 32))


def test_event_times_follow_the_index_with_jitter_and_late_arrivals():
    late_by, jitter = 3_600_000, 60_000
    kw = dict(seed=5, size=16, late_fraction=0.2, late_by_ms=late_by, now_ms=NOW)
    exact = list(generate(200, **kw, jitter_ms=0))
    idx = np.array([i for i, r in enumerate(exact) if not r.late])
    t = np.array([exact[i].event_time_ms for i in idx])
    assert np.all(np.diff(t) > 0) and t.max() <= NOW
    slope, intercept = np.polyfit(idx, t, 1)
    assert np.abs(t - (slope * idx + intercept)).max() < 1.0  # on time: exactly on the line
    late = [(i, r) for i, r in enumerate(exact) if r.late]
    assert late
    for i, r in late:
        assert 0.9 * late_by - 1 <= slope * i + intercept - r.event_time_ms <= 1.1 * late_by + 1

    jittered = list(generate(200, **kw, jitter_ms=jitter))
    assert [r.late for r in jittered] == [r.late for r in exact]
    for e, j in zip(exact, jittered):
        assert abs(j.event_time_ms - (e.event_time_ms - jitter)) <= jitter  # the span ends at now_ms
    assert max(r.event_time_ms for r in jittered) <= NOW


def test_custom_classes():
    classes = ("normal", "cryptominer", "tech_support_scam")
    records = list(generate(90, seed=0, size=32, classes=classes, now_ms=NOW))
    assert set(r.label for r in records) == set(classes)
    for r in records:
        assert _load(r.value).size == (32, 32)
    a = np.asarray(render("cryptominer", np.random.default_rng(0), 32))
    b = np.asarray(render("tech_support_scam", np.random.default_rng(0), 32))
    assert not np.array_equal(a, b)


def test_bad_arguments_fail_at_the_call():
    for kw in (
        dict(image_format="gif"),
        dict(size=8),
        dict(users=0),
        dict(classes=()),
        dict(classes=("a", "a")),
        dict(late_fraction=1.5),
        dict(dirichlet_alpha=0),
    ):
        with pytest.raises(ValueError):
            generate(10, **kw)


def test_classes_are_distinguishable_at_32px():
    """Nearest centroid on 8×8 thumbnails: weak, so a wide margin over chance means real structure."""
    records = list(generate(800, seed=0, size=32, late_fraction=0, now_ms=NOW))
    x = np.stack(
        [np.asarray(_load(r.value).resize((8, 8), Image.BILINEAR), np.float32).ravel() / 255 for r in records]
    )
    y = np.array([DEFAULT_CLASSES.index(r.label) for r in records])
    x_train, y_train, x_test, y_test = x[:600], y[:600], x[600:], y[600:]
    centroids = np.stack([x_train[y_train == k].mean(0) for k in range(len(DEFAULT_CLASSES))])
    predicted = ((x_test[:, None] - centroids[None]) ** 2).sum(-1).argmin(1)
    accuracy = (predicted == y_test).mean()
    chance = max(np.bincount(y_test).max() / len(y_test), 1 / len(DEFAULT_CLASSES))
    assert accuracy > chance + 0.2, (accuracy, chance)
