"""Federated learning: users' devices train locally and only model updates travel (issue #5).

    python -m app federate --model cnn --image-size 64 --rounds 5 --clients 10 --clients-per-round 5

`federate` (`run`) pins a table snapshot, splits its labelled records by event time
(`app.selection`), deals the users into clients (which read only records before the test slice,
from the snapshot's Parquet files), runs Flower rounds
(`server_app`, updates checked by `guard`, released under DP by `privacy`) on our Ray actors
(`grid`, running `client_app` over `task`) or, with `--engine deployment`, on devices that reach
a Flower SuperLink over TLS (`deployment`, `device`), evaluates the global model on the test
slice after every round (`evaluation`), checkpoints every round (`checkpoint`), logs and registers
the result, and with `--promote-if-better` moves the alias only to a better model.
Design and reasons: docs/federated.md.

The names below load on first use: a device starts a fresh ClientApp process for every message,
and importing `client_app` runs this file, so it must not pull in the server's side (Ray, MLflow).
"""

from __future__ import annotations

import importlib

__all__ = ["FederateConfig", "FederateReport", "central_test", "federate"]

_HOMES = {
    "FederateConfig": "app.fl.config",
    "FederateReport": "app.fl.config",
    "central_test": "app.fl.run",
    "federate": "app.fl.run",
}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
