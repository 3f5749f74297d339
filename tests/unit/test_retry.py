import random

from app.retry import Backoff


def test_waits_double_up_to_the_cap_with_jitter_and_reset_on_success():
    backoff = Backoff(base_s=2.0, cap_s=60.0, rng=random.Random(3))
    waits = [backoff.failed() for _ in range(10)]
    ceilings = [min(60.0, 2.0 * 2**i) for i in range(10)]
    assert all(c / 2 <= w <= c for w, c in zip(waits, ceilings)), waits
    assert backoff.failures == 10 and max(waits) <= 60.0 and waits[-1] >= 30.0
    backoff.succeeded()
    assert backoff.failures == 0 and backoff.failed() <= 2.0


def test_two_loops_failing_together_do_not_retry_in_step():
    first, second = Backoff(2.0, 60.0, rng=random.Random(1)), Backoff(2.0, 60.0, rng=random.Random(2))
    assert [first.failed() for _ in range(6)] != [second.failed() for _ in range(6)]
