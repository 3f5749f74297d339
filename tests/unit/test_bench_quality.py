"""bench/quality.py's pure helpers: the digits records, the event-time slices, reading the CLI."""

from __future__ import annotations

import io
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import quality  # noqa: E402

START_MS = 1_700_000_000_000


@pytest.fixture(scope="module")
def digits():
    return quality.digit_records(16, seed=0, start_ms=START_MS)


def test_digit_records_are_the_real_set_as_png_records(digits):
    assert len(digits) == 1797
    assert Counter(r.label for r in digits).keys() == {str(d) for d in range(10)}
    image = Image.open(io.BytesIO(digits[0].value))
    assert (image.format, image.mode, image.size) == ("PNG", "RGB", (16, 16))
    pixels = np.asarray(image)
    assert (pixels[..., 0] == pixels[..., 1]).all() and (pixels[..., 1] == pixels[..., 2]).all()
    assert all(r.user_id.removeprefix("user-") == r.device_id.split("-")[1] for r in digits)


def test_event_times_are_a_permutation_published_in_order(digits):
    times = [r.event_time_ms for r in digits]
    assert times == sorted(times)
    assert times == [START_MS + i * quality.STEP_MS for i in range(len(digits))]
    # A random permutation: the labels in time order are not the dataset's cyclic 0, 1, 2, ... order.
    assert [r.label for r in digits[:10]] != [str(d) for d in range(10)]


def test_test_slice_is_the_newest_tenth_and_holds_every_class(digits):
    split, train, val, test = quality.event_time_slices(digits, 0.2)
    assert (len(train), len(val), len(test)) == (split.train, split.val, split.test)
    assert len(train) + len(val) + len(test) == len(digits)
    assert all(r.event_time_ms >= split.test_from for r in test)
    assert max(r.event_time_ms for r in train) < split.val_from <= min(r.event_time_ms for r in val)
    assert {r.label for r in test} == {str(d) for d in range(10)}


def test_registered_version_and_run_come_from_trains_last_line():
    line = "registered argus-behavior v3 (run 0123abcd): val_accuracy 0.981 after 10 epochs\n"
    assert quality.registered(line) == ("3", "0123abcd")
    with pytest.raises(RuntimeError):
        quality.registered("argus: train failed")


def test_before_and_after_follow_the_cli_that_is_there():
    choices = quality.augment_choices("  --augment {none,light,strong}\n                        how")
    assert choices == ["none", "light", "strong"]
    (_, before), (_, after) = quality.before_after_flags(choices)
    assert (before, after) == (["--augment", "strong"], [])
    assert quality.augment_choices("  --no-augment\n") is None
    (_, before), (_, after) = quality.before_after_flags(None)
    assert (before, after) == ([], ["--no-augment"])
