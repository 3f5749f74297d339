"""What a federated run is asked for (`FederateConfig`, validated on creation) and what it gives
back (`FederateReport`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from app.errors import ConfigError
from app.fl.task import UPDATE_DTYPES
from app.selection import Verdict
from app.transform import AUGMENTATIONS

STRATEGIES = ("fedavg", "fedprox", "fedmedian", "fedtrimmedavg", "krum")
MEAN_STRATEGIES = ("fedavg", "fedprox")
FAULTS = ("nan", "scale", "crash", "slow")
CLIENT_SAMPLING = ("fixed", "poisson")
ENGINES = ("simulation", "deployment")
AUTO_INIT = "auto"
FRESH_LR = 0.05
FINE_TUNE_LR = 0.002
"""Client learning rate from a registered model: bench/fl.py's fine-tuning of a central model on
non-IID users (digits, 6 seeds) lost 0.125 test accuracy (median) at FRESH_LR, 0.011 at 0.005,
and gained 0.011 at 0.002 (PASS of #27's after ≥ before − 0.005)."""


@dataclass(kw_only=True)
class FederateConfig:
    rounds: int = 5
    """Federated rounds in total; a resumed run continues up to this many."""
    clients: int = 10
    """Simulated clients; the table snapshot's users are dealt into this many groups."""
    clients_per_round: int = 5
    """Clients sampled for training each round (the expected number under Poisson sampling)."""
    client_sampling: str = "fixed"
    """fixed: exactly `clients_per_round` clients, drawn without replacement; poisson: each client
    joins independently with probability clients_per_round / clients (under DP the accountant then
    counts the subsampling's amplification). Without DP both are seeded by `seed` and the round, so
    a resumed run samples what an unbroken one would; under DP by a secret drawn each round."""
    local_epochs: int = 1
    batch_size: int = 32
    lr: float | None = None
    """Client SGD learning rate (momentum 0.9, fresh optimiser every round); None: FRESH_LR from a
    fresh model, FINE_TUNE_LR when fine-tuning a registered one (`init_from`)."""
    strategy: str = "fedavg"
    """fedavg (example-weighted), fedprox, fedmedian, fedtrimmedavg or krum."""
    mu: float = 0.01
    """FedProx proximal weight: the client adds mu/2·||w − w_global||² to its loss."""
    trimmed_beta: float = 0.2
    """FedTrimmedAvg: share cut from each tail."""
    krum_malicious: int = 0
    """Krum: number of malicious clients assumed."""
    dp_noise: float = 0.0
    """Gaussian noise multiplier z: N(0, (z·clip/clients_per_round)²) on the mean of the clipped
    updates (needs --dp-clip), drawn from fresh OS entropy each round; 0 clips without noise."""
    dp_clip: float | None = None
    """Clip each client's update to this L2 norm; None turns differential privacy off."""
    dp_delta: float = 1e-5
    """Delta at which epsilon is reported."""
    dp_max_epsilon: float | None = None
    """Privacy budget: no round runs whose release would take epsilon past this (the run stops
    early and registers what it has); None: no limit. Needs DP noise and a mean strategy."""
    update_dtype: str = "fp16"
    """Precision of the updates clients send (fp16 or fp32); aggregation is always fp32."""
    min_clients: int | None = None
    """Fewest valid updates that make a round; None means half the clients per round (at least 1)."""
    round_timeout_s: float = 600.0
    """A client that has not answered this long after a round's start is dropped."""
    outlier_factor: float = 10.0
    """Reject updates whose norm exceeds this multiple of the round's median norm."""
    init_from: str | None = AUTO_INIT
    """Registry alias whose model the run starts from and fine-tunes (at FINE_TUNE_LR unless `lr`
    is given). `auto`: the champion when one exists and fits this run, else a fresh model; None
    (`--init-from none`): a fresh model."""
    seed: int = 0
    snapshots: int | None = None
    """The table snapshot id the run reads (`--snapshots ID`); None: the table's current snapshot."""
    val_fraction: float = 0.2
    """The newest share of all labelled records by event time, held out (`app.selection`): its
    older half validates on the clients, its newest half is the server's test slice, which no
    client ever reads. Centralised training splits the same way."""
    evaluate_clients: int | None = None
    """Clients sampled for evaluation each round; None means all of them."""
    augment: str = "light"
    """Client augmentation mode: none, light or strong (`app.transform.AUGMENTATIONS`)."""
    promote_if_better: bool = False
    """After registering, move the serving alias to the new version only if it beats the champion
    on the test slice (`app.selection.promote_if_better`)."""
    num_cpus_per_client: float = 0.5
    """Logical CPUs per client actor (fractions pack several on a core)."""
    num_gpus_per_client: float = 0.0
    max_actors: int | None = None
    """Cap on the client actor pool; None means as many as free resources fit (≤ clients per round)."""
    run_name: str | None = None
    """Rerunning with the same name resumes from its last complete round."""
    inject_faults: tuple[str, ...] = ()
    """Fault injection for tests, `CLIENT:KIND` with KIND in nan, scale, crash, slow."""
    engine: str = "simulation"
    """simulation: clients are Ray actors over the central table snapshot; deployment: devices
    (`argus device`) train on their own images and reach a Flower SuperLink over TLS."""
    superlink: str | None = None
    """Deployment: the SuperLink's HOST:PORT (its Fleet and Control APIs share one TLS port)."""
    root_certificates: str | None = None
    """Deployment: the CA certificate (PEM) that signed the SuperLink's certificate."""
    superlink_certfile: str | None = None
    """Deployment: with `superlink_keyfile`, start a SuperLink for the run, bound to `superlink`,
    with this certificate (PEM), rather than join a running one."""
    superlink_keyfile: str | None = None
    device_keys: str | None = None
    """Deployment, starting a SuperLink: a folder of the devices' public keys (`*.pub`, OpenSSH
    ECDSA) to register; only registered devices may connect."""
    secure_aggregation: bool = False
    """Deployment: SecAgg+ (`app.fl.secure`): the server learns only the sum of a round's updates;
    under DP the devices clip their own updates."""

    def __post_init__(self) -> None:
        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        require(self.rounds >= 1, f"--rounds must be >= 1, got {self.rounds}")
        require(
            self.snapshots is None or type(self.snapshots) is int,  # bool is an int too
            f"--snapshots takes one table snapshot id (an integer), got {self.snapshots!r}",
        )
        require(self.clients >= 1, f"--clients must be >= 1, got {self.clients}")
        require(
            1 <= self.clients_per_round <= self.clients,
            f"--clients-per-round must be in 1..{self.clients}, got {self.clients_per_round}",
        )
        require(
            self.client_sampling in CLIENT_SAMPLING,
            f"--client-sampling must be fixed or poisson, got {self.client_sampling!r}",
        )
        if self.min_clients is None:
            self.min_clients = max(1, math.ceil(self.clients_per_round / 2))
        require(
            1 <= self.min_clients <= self.clients_per_round,
            f"--min-clients must be in 1..{self.clients_per_round}, got {self.min_clients}",
        )
        require(self.local_epochs >= 1, f"--local-epochs must be >= 1, got {self.local_epochs}")
        require(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        require(self.lr is None or self.lr > 0, "--lr must be > 0")
        require(
            self.strategy in STRATEGIES,
            f"--strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}",
        )
        require(self.mu >= 0, "--mu must be >= 0")
        require(self.strategy != "fedprox" or self.mu > 0, "--strategy fedprox needs --mu > 0")
        require(0 <= self.trimmed_beta < 0.5, "--trimmed-beta must be in [0, 0.5)")
        require(self.krum_malicious >= 0, "--krum-malicious must be >= 0")
        require(self.dp_noise >= 0, "--dp-noise must be >= 0")
        require(self.dp_clip is None or self.dp_clip > 0, "--dp-clip must be > 0")
        require(
            self.dp_noise == 0 or self.dp_clip is not None, "--dp-noise needs --dp-clip (the sensitivity)"
        )
        require(0 < self.dp_delta < 1, "--dp-delta must be in (0, 1)")
        if self.dp_max_epsilon is not None:
            require(self.dp_max_epsilon > 0, "--dp-max-epsilon must be > 0")
            require(
                self.dp_noise > 0 and self.strategy in MEAN_STRATEGIES,
                "--dp-max-epsilon needs --dp-clip, --dp-noise > 0 and a mean strategy "
                f"({', '.join(MEAN_STRATEGIES)}): only then is epsilon accounted",
            )
        require(
            self.update_dtype in UPDATE_DTYPES,
            f"--update-dtype must be fp16 or fp32, got {self.update_dtype!r}",
        )
        require(self.round_timeout_s > 0, "--round-timeout-s must be > 0")
        require(self.outlier_factor > 1, "--outlier-factor must be > 1")
        if self.init_from is not None and self.init_from.strip().lower() == "none":
            self.init_from = None
        require(
            self.init_from is None or bool(self.init_from.strip()),
            "--init-from needs an alias (e.g. champion), auto or none",
        )
        require(0 < self.val_fraction < 1, "--val-fraction must be in (0, 1)")
        require(
            self.augment in AUGMENTATIONS,
            f"--augment must be one of {', '.join(AUGMENTATIONS)}, got {self.augment!r}",
        )
        require(
            self.evaluate_clients is None or 1 <= self.evaluate_clients <= self.clients,
            f"--evaluate-clients must be in 1..{self.clients}",
        )
        require(self.num_cpus_per_client > 0, "--num-cpus-per-client must be > 0")
        require(self.num_gpus_per_client >= 0, "--num-gpus-per-client must be >= 0")
        require(self.max_actors is None or self.max_actors >= 1, "--max-actors must be >= 1")
        require(
            self.run_name is None or bool(re.fullmatch(r"[A-Za-z0-9._-]+", self.run_name)),
            "--run-name may hold only letters, digits, '.', '_' and '-'",
        )
        require(self.engine in ENGINES, f"--engine must be simulation or deployment, got {self.engine!r}")
        if self.engine == "deployment":
            require(
                bool(self.superlink) and bool(self.root_certificates),
                "--engine deployment needs --superlink HOST:PORT and --root-certificates CA.pem "
                "(devices and the server reach the SuperLink over TLS only)",
            )
            require(not self.inject_faults, "fault injection is for the simulation engine")
        if self.secure_aggregation:
            require(
                self.engine == "deployment",
                "--secure-aggregation is for --engine deployment (the simulation's clients hold no secrets)",
            )
            require(
                self.strategy in MEAN_STRATEGIES,
                f"--secure-aggregation gives the server only the sum of the updates: --strategy must be "
                f"one of {', '.join(MEAN_STRATEGIES)}, not {self.strategy}",
            )
            require(self.clients_per_round >= 3, "--secure-aggregation needs --clients-per-round >= 3")
        require(
            (self.superlink_certfile is None) == (self.superlink_keyfile is None),
            "--superlink-certfile and --superlink-keyfile go together (a SuperLink of the run's own)",
        )
        require(
            self.device_keys is None or self.superlink_certfile is not None,
            "--device-keys registers devices with a SuperLink this run starts: it needs "
            "--superlink-certfile and --superlink-keyfile",
        )
        for spec in self.inject_faults:
            client, _, kind = spec.partition(":")
            require(
                client.isdigit() and int(client) < self.clients and kind in FAULTS,
                f"fault {spec!r}: expected CLIENT:KIND with CLIENT < {self.clients} "
                f"and KIND in {', '.join(FAULTS)}",
            )

    @property
    def dp(self) -> bool:
        return self.dp_clip is not None

    def client_lr(self, fine_tuning: bool) -> float:
        """The clients' learning rate: `lr`, else FINE_TUNE_LR from a registered model, FRESH_LR otherwise."""
        if self.lr is not None:
            return self.lr
        return FINE_TUNE_LR if fine_tuning else FRESH_LR

    @property
    def accounted(self) -> bool:
        """Whether epsilon is accounted: DP noise on a mean, which the accountant's events describe."""
        return self.dp and self.dp_noise > 0 and self.strategy in MEAN_STRATEGIES


@dataclass
class FederateReport:
    version: str
    run_id: str
    run_name: str
    metrics: dict
    """The final round's federated evaluation and totals."""
    history: list[dict]
    """One row per round: losses, accuracies, clients ok/failed/timed out/rejected, bytes, epsilon."""
    rounds_run: int
    """Rounds this call ran (fewer than `rounds` when it resumed or the privacy budget ran out)."""
    resumed_from: int
    classes: list[str]
    epsilon: float | None
    wire: dict[str, int]
    """Reply schemas (JSON: message type, array keys → dtype and shape, metric keys) → count."""
    checkpoint_dir: str
    init_version: str | None
    num_actors: int
    test_split: dict
    """The central event-time split (`EventTimeSplit.to_dict()`): boundaries and slice sizes."""
    verdict: Verdict | None = None
    """The champion comparison under --promote-if-better; None when not asked."""

    def __str__(self) -> str:
        last = self.history[-1]
        privacy = f", epsilon {self.epsilon:.2f}" if self.epsilon is not None else ""
        resumed = f" (resumed after round {self.resumed_from})" if self.resumed_from else ""
        val, test = self.metrics.get("val_accuracy", float("nan")), self.metrics["test_accuracy"]
        text = (
            f"registered v{self.version} (run {self.run_id}, federated {self.run_name}): "
            f"val_accuracy {val:.3f}, test_accuracy {test:.3f} after {len(self.history)} rounds"
            f"{resumed}; {last['bytes_up'] / 1e6:.2f} MB up in the last round{privacy}"
        )
        verdict = self.verdict
        if verdict is not None and verdict.promoted:
            text += f"\npromoted v{self.version} to the serving alias: {verdict.reason}"
        elif verdict is not None:
            text += f"\nkept v{verdict.champion_version} as champion, not v{self.version}: {verdict.reason}"
        return text
