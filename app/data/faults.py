"""Fault injection for the exactly-once tests: `ARGUS_FAULT=<point>` kills the process at that
point of a commit (`after_write`, `before_manifest`, `before_commit`, `before_compact_manifest`),
as a crash would, so a rerun can be checked to lose and duplicate nothing."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

FAULT_ENV = "ARGUS_FAULT"


def fault(point: str) -> None:
    if os.environ.get(FAULT_ENV) == point:
        log.error("fault injection: exiting at %s", point)
        os._exit(137)
