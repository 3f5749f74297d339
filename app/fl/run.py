"""One federated run (`python -m app federate`): a table snapshot → Flower rounds on Ray actors or
devices → checkpoints → a registered version → with `--promote-if-better`, the alias moved only to a better
model. The package docstring (`app.fl`) maps the modules it uses."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np
import pyarrow.compute as pc
import torch
from flwr.app import Context, RecordDict
from flwr.serverapp import Grid
from torch import nn

from app import model as core
from app import registry
from app.cluster import ray_session
from app.config import Settings
from app.data.selection import TableRead, pinned_read, read_rows
from app.data.table import ImageTable
from app.errors import ConfigError
from app.fl.checkpoint import load_checkpoint
from app.fl.config import AUTO_INIT, FederateConfig, FederateReport
from app.fl.evaluation import CentralEvaluation
from app.fl.grid import RayGrid, pool_size, stamp_task_identity
from app.fl.privacy import GaussianAccountant
from app.fl.server_app import Federation, build_server_app, build_strategy, over_budget
from app.fl.task import labelled_rows, model_arrays, partition_sizes
from app.selection import EventTimeSplit, promote_if_better

log = logging.getLogger(__name__)


def _initial_model(
    settings: Settings, cfg: FederateConfig, classes: list[str]
) -> tuple[nn.Module, str | None]:
    """The model the rounds start from, and its registered version (None: a fresh model). An alias
    the run names must exist and fit; `auto` takes the champion only where it does."""

    def fresh() -> nn.Module:
        torch.manual_seed(cfg.seed)
        return core.build_model(settings.model, len(classes))

    if cfg.init_from is None:
        return fresh(), None
    auto = cfg.init_from == AUTO_INIT
    alias = "champion" if auto else cfg.init_from
    version = registry.resolve(settings.tracking_uri, settings.model_name, alias)
    if version is None:
        if auto:
            log.info("no %s@%s yet: the rounds start from a fresh model", settings.model_name, alias)
            return fresh(), None
        raise ConfigError(f"--init-from {alias}: {settings.model_name}@{alias} points at no version")
    loaded = registry.load(settings.tracking_uri, settings.model_name, version)
    card = loaded.card
    wanted = {
        "arch": settings.model,
        "classes": classes,
        "image_size": settings.image_size,
        "features": False,
    }
    have = {
        "arch": card.arch,
        "classes": card.classes,
        "image_size": card.image_size,
        "features": card.features,
    }
    differ = [f"{k} {have[k]!r} (this run: {wanted[k]!r})" for k in wanted if have[k] != wanted[k]]
    if differ:
        message = f"{settings.model_name} v{version} does not fit this run: " + "; ".join(differ)
        if auto:
            log.warning("%s@%s: %s; the rounds start from a fresh model", settings.model_name, alias, message)
            return fresh(), None
        raise ConfigError(f"--init-from {alias}: {message}")
    log.info("fine-tuning %s v%s (%s@%s)", settings.model_name, version, settings.model_name, alias)
    return loaded.model.train(), version


def _trained_without_dp(settings: Settings, version: str | None) -> bool:
    """Whether the registered `version` a run starts from was trained without DP: it may have learnt
    the very images a DP run's epsilon is about."""
    if version is None:
        return False
    return registry.load(settings.tracking_uri, settings.model_name, version).card.privacy is None


def central_test(
    data_files: list[str], classes: list[str], val_fraction: float, model: nn.Module, device: torch.device
) -> tuple[EventTimeSplit, CentralEvaluation]:
    """The event-time split of all labelled records of the table snapshot (its `data_files`), as
    centralised training cuts it, and the server's evaluation on its test slice (read once, on the
    driver, as uint8)."""
    rows = read_rows(data_files, ["event_time_ms"], pc.field("label").isin(classes))
    try:
        split = EventTimeSplit.of(np.asarray(rows.column("event_time_ms").to_numpy()), val_fraction)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    test_x, test_y, _ = labelled_rows(data_files, classes, pc.field("event_time_ms") >= split.test_from)
    return split, CentralEvaluation(model, test_x, test_y, len(classes), device)


def federate(
    settings: Settings,
    cfg: FederateConfig,
    *,
    before_promotion: Callable[[], None] | None = None,
    grid: Grid | None = None,
) -> FederateReport:
    """`python -m app federate`: rounds of Flower FL → checkpoints → a registered version → with
    `promote_if_better`, the alias moved only to a better model.

    The simulation engine runs the clients on Ray actors over the table snapshot; the deployment engine
    hands the run to a SuperLink (`deployment.federate_on_devices`), whose ServerApp calls this
    again with `grid`, its devices. `before_promotion` runs just before the alias may move (the
    demo starts its traffic there, so a rollout happens under it)."""
    on_devices = cfg.engine == "deployment"
    if on_devices and grid is None:
        from app.fl.deployment import federate_on_devices

        return federate_on_devices(settings, cfg)
    with pinned_read(settings, cfg.snapshots) as (table, read):
        return _federate_on(settings, cfg, table, read, before_promotion, grid)


def _federate_on(
    settings: Settings,
    cfg: FederateConfig,
    table: ImageTable,
    read: TableRead,
    before_promotion: Callable[[], None] | None,
    grid: Grid | None,
) -> FederateReport:
    on_devices = cfg.engine == "deployment"
    if read.image_size != settings.image_size:  # clients train on the stored pixels as they are
        raise ConfigError(
            f"table snapshot {read.snapshot_id} holds images of another size than --image-size "
            f"{settings.image_size}: federated clients read the stored pixels; ingest at that size"
        )
    classes = read.classes(settings.classes)
    if len(classes) < 2:
        raise ConfigError(
            f"federated training needs at least two classes; table snapshot {read.snapshot_id} has {classes}"
        )
    files = list(read.files)
    users = len(read_rows(files, ["user_id"]).column("user_id").unique())
    if not on_devices and cfg.clients > users:
        raise ConfigError(
            f"--clients {cfg.clients} but table snapshot {read.snapshot_id} holds {users} users; "
            "a client is at least one user"
        )

    run_name = cfg.run_name or time.strftime("federate-%Y%m%d-%H%M%S")
    checkpoint_uri = settings.uri("checkpoints", "federated", run_name)
    fingerprint = {
        "arch": settings.model,
        "classes": classes,
        "image_size": settings.image_size,
        "clients": cfg.clients,
        "table_snapshot_id": read.snapshot_id,
        "seed": cfg.seed,
        "strategy": cfg.strategy,
        "dp_noise": cfg.dp_noise,
        "dp_clip": cfg.dp_clip,
        "val_fraction": cfg.val_fraction,
    }
    if cfg.client_sampling != "fixed":  # runs checkpointed before the flag existed still resume
        fingerprint["client_sampling"] = cfg.client_sampling
    checkpoint = load_checkpoint(checkpoint_uri)
    if checkpoint is None:
        model, init_version = _initial_model(settings, cfg, classes)
        start_round, history, releases = 0, [], []
    else:
        state, meta = checkpoint
        if meta["fingerprint"] != fingerprint:
            changed = sorted(k for k in fingerprint if meta["fingerprint"].get(k) != fingerprint[k])
            raise ConfigError(
                f"run {run_name!r} was started with different {', '.join(changed)}; "
                "pass a new --run-name to start over"
            )
        model = core.build_model(settings.model, len(classes))
        model.load_state_dict(state)
        start_round, history = meta["round"], meta["history"]
        # (z, q) per release; older checkpoints kept z alone, of unamplified releases
        releases = meta.get("privacy_releases", [[z, 1.0] for z in meta.get("noise_multipliers", [])])
        init_version = meta.get("init_version")
        log.info("resuming federated run %s after round %d", run_name, start_round)
    # Fine-tuning takes small steps: at FRESH_LR non-IID clients undo what the model knew. Resolved
    # here so that MLflow's params show the rate the clients used.
    cfg = dataclasses.replace(cfg, lr=cfg.client_lr(fine_tuning=init_version is not None))
    init_without_dp = cfg.dp and _trained_without_dp(settings, init_version)
    if init_without_dp:
        log.warning(
            "--init-from %s: v%s was trained without differential privacy, possibly on these users' "
            "images; the epsilon reported covers only this run's rounds, not what v%s already learnt",
            cfg.init_from,
            init_version,
            init_version,
        )
    accounted = cfg.accounted
    if cfg.dp and cfg.dp_noise > 0 and not accounted:
        log.warning(
            "--strategy %s with DP noise: epsilon is not reported (no mean, no accountant)", cfg.strategy
        )
    split, central = central_test(files, classes, cfg.val_fraction, model, core.local_device())
    fed = Federation(
        cfg=cfg,
        model=model,
        arrays=model_arrays(model),
        classes=classes,
        data_files=files,
        checkpoint_uri=checkpoint_uri,
        fingerprint=fingerprint,
        val_from=split.val_from,
        test_from=split.test_from,
        run_name=run_name,
        init_version=init_version,
        start_round=start_round,
        history=history,
        init_without_dp=init_without_dp,
        accountant=(
            GaussianAccountant(cfg.dp_delta, releases, poisson=cfg.client_sampling == "poisson")
            if accounted
            else None
        ),
    )
    if fed.start_round == 0 and (epsilon := over_budget(cfg, fed.accountant)) is not None:
        raise ConfigError(
            f"--dp-max-epsilon {cfg.dp_max_epsilon:g}: one round alone spends epsilon {epsilon:.3f} "
            f"(z={cfg.dp_noise:g}, {cfg.clients_per_round} of {cfg.clients} clients, "
            f"delta={cfg.dp_delta:g}); raise --dp-noise or the budget"
        )
    # Node i + 1 runs client i (RayGrid numbers its nodes so): the server's own count of each
    # client's rows weighs its update, whatever the client claims. A device's images are its own:
    # there the guard bounds what it claims.
    examples = None
    if not on_devices:
        sizes = partition_sizes(
            tuple(files), cfg.clients, cfg.seed, tuple(classes), split.val_from, split.test_from
        )
        examples = {partition + 1: size for partition, size in enumerate(sizes)}

    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    if fed.start_round < cfg.rounds and grid is not None:
        with _quiet_flower():
            build_server_app(fed, build_strategy(cfg, examples), evaluate_fn=central)(
                grid=grid, context=context
            )
        wire, num_actors = dict(grid.wire), 0
    elif fed.start_round < cfg.rounds:
        with ray_session(settings), _quiet_flower():
            stamp_task_identity()  # the strategies create their messages as a running ServerApp would
            grid = RayGrid(
                cfg.clients,
                num_actors=pool_size(cfg),
                num_cpus=cfg.num_cpus_per_client,
                num_gpus=cfg.num_gpus_per_client,
            )
            try:
                build_server_app(fed, build_strategy(cfg, examples), evaluate_fn=central)(
                    grid=grid,
                    context=context,
                )
            finally:
                grid.close()
        wire, num_actors = dict(grid.wire), grid.num_actors
    else:
        log.info("run %s already finished %d rounds; registering its model", run_name, fed.start_round)
        wire, num_actors = {}, 0
    return _finish(
        settings, cfg, fed, run_name, (table, read), wire, num_actors, split, central, before_promotion
    )


def _privacy_record(cfg: FederateConfig, fed: Federation) -> dict:
    """The model card's account of its differential privacy (`ModelCard.privacy`)."""
    spent = fed.accountant.get_privacy_spent() if fed.accountant else None
    return {
        "epsilon": spent.epsilon if spent else None,  # None: noise on no mean, nothing accounted
        "delta": cfg.dp_delta,
        "noise_multiplier": cfg.dp_noise,
        "clip": cfg.dp_clip,
        "rounds": len(fed.history),
        "releases": spent.num_releases if spent else 0,
        "client_sampling": cfg.client_sampling,
        "sampling_rate": cfg.clients_per_round / cfg.clients,
        "sampling_secret": True,
        "accountant": f"dp-accounting RdpAccountant, {spent.accounting_method}" if spent else None,
        "max_epsilon": cfg.dp_max_epsilon,
        "stopped": fed.stopped,
        "init_version": fed.init_version,
        "init_without_dp": fed.init_without_dp,
    }


@contextlib.contextmanager
def _quiet_flower():
    """Flower logs every sampling and aggregation at INFO; keep its warnings, drop the chatter."""
    flower = logging.getLogger("flwr")
    level = flower.level
    if not log.isEnabledFor(logging.DEBUG):
        flower.setLevel(logging.WARNING)
    try:
        yield
    finally:
        flower.setLevel(level)


def _finish(
    settings: Settings,
    cfg: FederateConfig,
    fed: Federation,
    run_name: str,
    source: tuple[ImageTable, TableRead],
    wire: dict,
    num_actors: int,
    split: EventTimeSplit,
    central: CentralEvaluation,
    before_promotion: Callable[[], None] | None,
) -> FederateReport:
    """MLflow run (params, per-round metrics, curves), a registered version of training kind
    `federated` whose card carries its test-slice figures and the table snapshot it read
    (`source`), and the champion comparison if asked."""
    table, read = source
    history = fed.history
    last = history[-1]
    epsilon = fed.accountant.get_privacy_spent().epsilon if fed.accountant else None
    metrics = {k: last[k] for k in ("val_accuracy", "val_loss", "train_loss") if k in last}
    # The registered weights' own score (the last row's too, unless it came from an older checkpoint).
    test = central(len(history), fed.arrays)
    metrics.update({k: float(v) for k, v in test.items()})
    metrics.update(
        {
            "rounds": len(history),
            "clients": cfg.clients,
            "bytes_up_total": sum(row["bytes_up"] for row in history),
        }
    )
    if epsilon is not None:
        metrics["epsilon"] = epsilon
    params = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("snapshots", "inject_faults")}
    run_id = registry.log_run(
        settings,
        run_name=run_name,
        history=history,
        step="round",
        title=f"{run_name} ({settings.model}, {cfg.strategy})",
        params={
            **params,
            "model": settings.model,
            "image_size": settings.image_size,
            "classes": ",".join(fed.classes),
            "table": read.table,
            "table_snapshot_id": read.snapshot_id,
            "init_version": fed.init_version,
            "resumed_from": fed.start_round,
            "split_val_from": split.val_from,
            "split_test_from": split.test_from,
            "split_test_records": split.test,
        },
        tags={"training_kind": "federated", "fl.engine": cfg.engine, "fl.checkpoints": fed.checkpoint_uri},
        inputs=[(table.load().location(), read.lineage())],
    )
    card = registry.ModelCard(
        arch=settings.model,
        classes=fed.classes,
        image_size=settings.image_size,
        features=False,
        training_kind="federated",
        lineage=read.lineage(),
        metrics=metrics,
        split=split.to_dict(),
        privacy=_privacy_record(cfg, fed) if cfg.dp else None,
    )
    version = registry.register(settings.tracking_uri, settings.model_name, run_id, fed.model.eval(), card)
    verdict = None
    if cfg.promote_if_better:
        if before_promotion is not None:
            before_promotion()
        verdict = promote_if_better(
            settings,
            version,
            run_id,
            card,
            metrics["test_accuracy"],
            lambda candidate: central.evaluate(candidate)["accuracy"],
        )
    return FederateReport(
        version=version,
        run_id=run_id,
        run_name=run_name,
        metrics=metrics,
        history=history,
        rounds_run=len(history) - fed.start_round,
        resumed_from=fed.start_round,
        classes=fed.classes,
        epsilon=epsilon,
        wire=wire,
        checkpoint_dir=fed.checkpoint_uri,
        init_version=fed.init_version,
        num_actors=num_actors,
        test_split=split.to_dict(),
        verdict=verdict,
    )
