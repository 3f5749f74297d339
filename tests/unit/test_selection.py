"""The event-time split that separates the records picking a model from those judging it."""

import numpy as np
import pytest

from app.selection import TEST, TRAIN, VALIDATION, EventTimeSplit


def test_the_newest_share_is_cut_in_two_validation_then_test():
    times = np.random.default_rng(0).permutation(1000) * 1000
    split = EventTimeSplit.of(times, 0.2)
    slices = split.slice_of(times)
    assert (split.train, split.val, split.test) == (800, 100, 100)
    assert [int((slices == s).sum()) for s in (TRAIN, VALIDATION, TEST)] == [800, 100, 100]
    # Every test record is newer than every validation record, which is newer than all training.
    assert times[slices == TRAIN].max() < times[slices == VALIDATION].min()
    assert times[slices == VALIDATION].max() < times[slices == TEST].min()
    assert split.val_from <= split.test_from
    assert EventTimeSplit(**split.to_dict()) == split  # what the model card records rebuilds it


@pytest.mark.parametrize("times", [[], [5] * 50])
def test_a_split_with_an_empty_slice_is_refused(times):
    with pytest.raises(ValueError):
        EventTimeSplit.of(np.array(times), 0.2)


def test_the_fraction_must_leave_records_on_both_sides():
    with pytest.raises(ValueError, match="val-fraction"):
        EventTimeSplit.of(np.arange(100), 1.0)
