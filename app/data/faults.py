"""Fault injection for the exactly-once tests: `ARGUS_FAULT=<point>` kills the process at that
point of a table commit, as a crash would, so a rerun can be checked to lose and duplicate nothing:
`after_write` (data files written and proven, nothing committed), `before_commit` (just before the
catalog swap) and `after_commit` (committed, the consumer group's offsets not yet mirrored), in a
bulk `ingest`, in each `watch` part and in `redrive` alike."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

FAULT_ENV = "ARGUS_FAULT"


def fault(point: str) -> None:
    if os.environ.get(FAULT_ENV) == point:
        log.error("fault injection: exiting at %s", point)
        os._exit(137)
