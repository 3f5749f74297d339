"""The arithmetic of a secure round's release (`app.fl.secure`): what the server does with the sum
SecAgg+ unmasks. The protocol itself runs against real devices in
tests/integration/test_fl_deployment.py."""

from __future__ import annotations

import numpy as np
import pytest

from app.errors import ConfigError
from app.fl.config import FederateConfig
from app.fl.secure import release_sum, threshold


def test_without_dp_the_step_is_the_mean_of_those_that_answered():
    step = release_sum(
        {"w": np.array([3.0, 6.0])}, answered=3, clip=None, noise_multiplier=0, denominator=None
    )
    np.testing.assert_allclose(step["w"], [1.0, 2.0])


def test_under_dp_the_denominator_stays_fixed_when_a_device_drops_and_the_noise_is_on_the_sum():
    summed = {"w": np.zeros(200_000)}
    step = release_sum(
        summed,
        answered=2,  # of 4 sampled: the noise still divides by 4
        clip=0.5,
        noise_multiplier=1.2,
        denominator=4.0,
        rng=np.random.default_rng(0),
    )
    assert step["w"].std() == pytest.approx(1.2 * 0.5 / 4.0, rel=0.01)
    ones = release_sum({"w": np.ones(3)}, answered=2, clip=0.5, noise_multiplier=0.0, denominator=4.0)
    np.testing.assert_allclose(ones["w"], 0.25)


def test_shares_rebuild_from_a_majority():
    assert [threshold(n) for n in (3, 4, 5, 10)] == [2, 3, 3, 6]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({}, "is for --engine deployment"),
        ({"engine": "deployment", "strategy": "fedmedian"}, "--strategy must be one of fedavg, fedprox"),
        ({"engine": "deployment", "clients": 2, "clients_per_round": 2}, "--clients-per-round >= 3"),
    ],
)
def test_secure_aggregation_is_refused_where_it_cannot_hold(changes, message):
    given = {"superlink": "127.0.0.1:9", "root_certificates": "ca.pem", "clients": 4, "clients_per_round": 4}
    with pytest.raises(ConfigError, match=message):
        FederateConfig(secure_aggregation=True, **{**given, **changes})
