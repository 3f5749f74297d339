"""The model commands' flags (CONTRACT.md §3), one adder per command: train, federate, device,
serve, promote, drift, demo. As in `app.options`, whose `add_table` they share, each adder only
declares flags; defaults live in the typed configs, so a flag left out means "the config's default".
"""

from __future__ import annotations

import argparse

from app.config import AMP_MODES
from app.options import add_table
from app.transform import AUGMENT_MODES


def _snapshot_id(text: str) -> int:
    """`--snapshots`: one table snapshot id (what `train` and `federate` read, CONTRACT.md §2)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected one table snapshot id (an integer), got {text!r}"
        ) from None


def add_train(parser) -> None:
    add_table(parser)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--batch-size", type=int, help="per-worker micro-batch (default 32)")
    parser.add_argument(
        "--num-workers", help="training workers, N or MIN-MAX for an elastic group (default 2)"
    )
    parser.add_argument("--use-gpu", action="store_true", default=None)
    parser.add_argument("--cpus-per-worker", type=float, help="logical CPUs per worker (default 0.5)")
    parser.add_argument("--amp", choices=AMP_MODES, help="mixed precision (auto: on with a GPU, off on CPU)")
    parser.add_argument("--grad-accum", type=int, help="micro-batches per optimiser step (default 1)")
    parser.add_argument("--lr", type=float, help="peak learning rate of the schedule (default 3e-3)")
    parser.add_argument("--seed", type=int)
    parser.add_argument(
        "--snapshots",
        type=_snapshot_id,
        metavar="ID",
        help="the table snapshot id to read (default: the table's current snapshot)",
    )
    parser.add_argument(
        "--val-fraction", type=float, help="newest share by event time held out (default 0.2)"
    )
    parser.add_argument(
        "--balance", choices=["weights", "sampler", "none"], help="uneven classes (default weights)"
    )
    parser.add_argument(
        "--augment", choices=AUGMENT_MODES, help="light (default): no flips, mild zoom/shift and colour"
    )
    parser.add_argument("--weight-decay", type=float, help="AdamW weight decay (default 0.05)")
    parser.add_argument("--label-smoothing", type=float, help="cross-entropy label smoothing (default 0)")
    parser.add_argument(
        "--warmup-fraction", type=float, help="share of steps warming up before cosine decay (default 0.1)"
    )
    parser.add_argument("--weights", help="local ResNet state dict to start the backbone from")
    parser.add_argument("--run-name", help="rerunning with the same name resumes it")
    parser.add_argument("--max-failures", type=int, help="worker failures to recover from (default 2)")
    parser.add_argument(
        "--resize-check-s", type=float, help="how often an elastic group looks for room to grow (default 60)"
    )
    add_promote_if_better(parser)
    parser.add_argument("--fail-at-epoch", type=int, help=argparse.SUPPRESS)


def add_federate(parser) -> None:
    add_table(parser)
    parser.add_argument("--rounds", type=int, help="federated rounds (default 5)")
    parser.add_argument("--clients", type=int, help="simulated clients, each a group of users (default 10)")
    parser.add_argument("--clients-per-round", type=int, help="clients sampled per round (default 5)")
    parser.add_argument(
        "--client-sampling",
        choices=("fixed", "poisson"),
        help="fixed: exactly --clients-per-round a round (default); poisson: each client with "
        "probability clients-per-round/clients",
    )
    parser.add_argument("--local-epochs", type=int, help="client epochs per round (default 1)")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument(
        "--lr",
        type=float,
        help="client SGD learning rate (default 0.05; 0.002 when fine-tuning with --init-from)",
    )
    parser.add_argument(
        "--strategy", help="fedavg, fedprox, fedmedian, fedtrimmedavg or krum (default fedavg)"
    )
    parser.add_argument("--mu", type=float, help="FedProx proximal weight (default 0.01)")
    parser.add_argument("--dp-clip", type=float, help="clip each update to this L2 norm (enables DP)")
    parser.add_argument(
        "--dp-noise", type=float, help="Gaussian noise multiplier on the aggregate (needs --dp-clip)"
    )
    parser.add_argument("--dp-delta", type=float, help="delta at which epsilon is reported (default 1e-5)")
    parser.add_argument(
        "--dp-max-epsilon",
        type=float,
        help="privacy budget: stop before a round whose release would take epsilon past it",
    )
    parser.add_argument("--update-dtype", help="fp16 (default) or fp32 updates on the wire")
    parser.add_argument("--min-clients", type=int, help="fewest valid updates that make a round")
    parser.add_argument("--round-timeout-s", type=float, help="drop clients slower than this (default 600)")
    parser.add_argument(
        "--init-from",
        help="fine-tune the model behind this alias; default auto: the champion when one exists and "
        "fits, else a fresh model; none: a fresh model",
    )
    parser.add_argument(
        "--snapshots",
        type=_snapshot_id,
        metavar="ID",
        help="the table snapshot id to read (default: the table's current snapshot)",
    )
    parser.add_argument("--seed", type=int)
    parser.add_argument("--run-name", help="rerunning with the same name resumes after its last round")
    parser.add_argument(
        "--num-cpus-per-client", type=float, help="logical CPUs per client actor (default 0.5)"
    )
    parser.add_argument("--augment", choices=AUGMENT_MODES, help="client augmentation (default light)")
    parser.add_argument(
        "--val-fraction", type=float, help="newest share by event time held out (default 0.2)"
    )
    add_promote_if_better(parser)
    parser.add_argument(
        "--engine",
        choices=("simulation", "deployment"),
        help="simulation: clients are Ray actors over the snapshots (default); deployment: devices "
        "(`argus device`) train on their own images and reach a Flower SuperLink over TLS",
    )
    parser.add_argument("--superlink", help="deployment: the SuperLink's HOST:PORT")
    parser.add_argument(
        "--root-certificates", help="deployment: the CA (PEM) that signed the SuperLink's certificate"
    )
    parser.add_argument(
        "--superlink-certfile",
        help="deployment: start a SuperLink for this run at --superlink with this certificate (PEM)",
    )
    parser.add_argument("--superlink-keyfile", help="deployment: that certificate's private key (PEM)")
    parser.add_argument(
        "--secure-aggregation",
        action="store_true",
        default=None,
        help="deployment: SecAgg+, the server learns only the sum of each round's updates",
    )
    parser.add_argument(
        "--device-keys",
        help="deployment, with a SuperLink of the run's own: a folder of device public keys (*.pub) "
        "to register; only those devices may connect",
    )


def add_device(parser) -> None:
    parser.add_argument(
        "--data-dir", required=True, help="the device's own images: DIR/<label>/<image files>"
    )
    parser.add_argument("--superlink", required=True, help="the SuperLink's HOST:PORT")
    parser.add_argument(
        "--root-certificates",
        required=True,
        help="the CA (PEM) that signed the SuperLink's certificate: devices talk over TLS only",
    )
    parser.add_argument(
        "--auth-key",
        required=True,
        help="this device's private key (OpenSSH ECDSA); its public key must be registered",
    )
    parser.add_argument(
        "--max-retries", type=int, help="connection attempts before giving up (default: keep trying)"
    )


def add_promote_if_better(parser) -> None:
    parser.add_argument(
        "--promote-if-better",
        action="store_true",
        default=None,
        help="move the alias only if the new version beats the champion on the test slice",
    )


def add_serve(parser) -> None:
    parser.add_argument("--http-host", help="default 127.0.0.1")
    parser.add_argument("--http-port", type=int, help="default 8000")
    parser.add_argument(
        "--replicas",
        help="N replicas (default 1), or MIN-MAX: Serve scales between them on ongoing requests",
    )
    parser.add_argument(
        "--proxy-location",
        choices=("EveryNode", "HeadOnly"),
        help="where Serve runs HTTP proxies (default EveryNode; HeadOnly for several nodes on one host)",
    )
    parser.add_argument("--alias", help="registry alias to serve (default champion)")
    parser.add_argument("--max-batch-size", type=int)
    parser.add_argument("--batch-wait-timeout-s", type=float)
    parser.add_argument("--max-body-bytes", type=int)
    parser.add_argument(
        "--api-tokens",
        metavar="FILE",
        help="bearer tokens for /predict, /model and /rollout: one token or sha256:<hex> per line "
        "(ARGUS_API_TOKENS); required for a non-loopback --http-host",
    )
    parser.add_argument(
        "--rate-limit",
        type=float,
        metavar="RPS",
        help="requests/s per token across all replicas (default 50, 0: off)",
    )
    parser.add_argument("--rate-burst", type=int, help="requests a token may send at once (default 2 x RPS)")
    parser.add_argument(
        "--docs",
        action="store_true",
        default=None,
        help="serve Swagger UI at /docs (/openapi.json is always up)",
    )
    parser.add_argument(
        "--detach",
        action="store_true",
        default=None,
        help="deploy onto the running cluster (--ray-address) and return",
    )


def add_demo(parser) -> None:
    parser.add_argument(
        "--records", type=int, default=1200, help="synthetic records to publish (default 1200)"
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="federated rounds (default 3)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument(
        "--hold",
        action="store_true",
        help="keep Ray's dashboard and the Serve endpoint up at the end until Ctrl-C",
    )


def add_promote(parser) -> None:
    parser.add_argument("version")
    parser.add_argument("--alias", default="champion")
    parser.add_argument(
        "--wait-url",
        help="wait until every replica behind this endpoint serves VERSION "
        "(default: the deployment `serve` recorded under the storage dir)",
    )
    parser.add_argument(
        "--timeout-s", type=float, help="fail (exit 1) if not every replica serves it by then (default 120)"
    )
    parser.epilog = "A deployment with API tokens: set ARGUS_API_TOKEN to one, for the wait on GET /rollout."


def add_drift(parser) -> None:
    add_table(parser)
    parser.add_argument("--window-s", type=float, help="recent traffic window (default 3600)")
    parser.add_argument("--threshold", type=float, help="PSI above this is drift (default 0.2)")
    parser.add_argument("--label-threshold", type=float, help="predicted-class PSI threshold (default 0.5)")
    parser.add_argument(
        "--output-p-value",
        type=float,
        help="output drift when the MMD test of served vs reference probabilities has p below this "
        "(default 0.01)",
    )
    parser.add_argument("--min-requests", type=int, help="fewest requests for a verdict (default 30)")
    parser.add_argument(
        "--retrain",
        action="store_true",
        default=None,
        help="on drift, submit ingest → train --promote-if-better as a Ray job",
    )
    parser.add_argument("--alias", help="the served alias (default champion)")
