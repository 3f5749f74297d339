"""The training driver: one table snapshot → Ray Train `TorchTrainer` (DDP, ring all-reduce) → registry.

    python -m app train --model cnn --image-size 64 --epochs 3 --num-workers 2

`train()` pins a snapshot of the table (`--snapshots ID`, default the current one) and its
classes, cuts its rows into event-time slices
(`app.train.data`), starts the worker group (`app.train.loop`: AdamW with a warmup-then-cosine
schedule per step, a checkpoint every epoch, `app.train.checkpoint`), and once it is done loads the
best epoch's weights, judges them on the test slice, logs the run to MLflow and registers the
version; `--promote-if-better` moves the serving alias only if it beats the champion. A lost worker
restarts the group from the last checkpoint; ranks compare parameter checksums and the run fails
loudly if they differ.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from functools import partial

import torch
from torch import nn

from app import model as core
from app import registry
from app.config import Settings, TrainConfig
from app.data.selection import TableRead, pinned_read
from app.data.table import ImageTable
from app.errors import ConfigError
from app.selection import Verdict, promote_if_better
from app.train.checkpoint import load_checkpoint
from app.train.data import build_datasets, class_weights, data_config
from app.train.loop import WorkerConfig, train_loop_per_worker
from app.transform import normalize_pixels

log = logging.getLogger(__name__)


@dataclass
class TrainReport:
    version: str
    run_id: str
    metrics: dict
    epochs: int
    classes: list[str]
    checksum: str
    verdict: Verdict | None = None
    """The test-slice comparison with the champion, when `--promote-if-better` asked for it."""


def train(settings: Settings, cfg: TrainConfig) -> TrainReport:
    """`python -m app train`: fit on one table snapshot, log to MLflow, register the best epoch's model."""
    with pinned_read(settings, cfg.snapshots) as (table, read):
        return _train_on(settings, cfg, table, read)


def _train_on(settings: Settings, cfg: TrainConfig, table: ImageTable, read: TableRead) -> TrainReport:
    import ray.train
    from ray.train.torch import TorchTrainer

    classes = read.classes(settings.classes)
    if len(classes) < 2:
        raise ConfigError(
            f"training needs at least two classes; table snapshot {read.snapshot_id} has {classes}"
        )
    features = read.features
    # With features the head sits on the backbone that computed them, as ingest recorded it.
    backbone_weights = read.features_weights if features else cfg.weights
    arch = "resnet50" if features else settings.model
    data = build_datasets(settings, read, classes, cfg.val_fraction, features)
    split = data.split
    log.info(
        "training on table snapshot %d: %d records; the newest %d pick the epoch (event time >= %d), "
        "the %d after them judge it (event time >= %d)",
        read.snapshot_id,
        split.train,
        split.val,
        split.val_from,
        split.test,
        split.test_from,
    )

    run_name = cfg.run_name or time.strftime("train-%Y%m%d-%H%M%S")
    storage_path = settings.uri("checkpoints", "train")
    if settings.is_local_storage:
        os.makedirs(storage_path, exist_ok=True)
    worker_config = WorkerConfig(
        run_name=run_name,
        model=arch,
        features=features,
        backbone_weights=backbone_weights,
        classes=tuple(classes),
        epochs=cfg.epochs,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        label_smoothing=cfg.label_smoothing,
        warmup_fraction=cfg.warmup_fraction,
        train_records=split.train,
        seed=cfg.seed,
        amp=cfg.amp,
        grad_accum=cfg.grad_accum,
        balance=cfg.balance,
        augment=cfg.augment,
        class_weights=tuple(class_weights(read.label_counts, classes)),
        snapshot_id=read.snapshot_id,
        threads=max(1, int(cfg.cpus_per_worker)) if not cfg.use_gpu else 4,
        fail_at_epoch=cfg.fail_at_epoch,
        fault_marker=f"{storage_path}/{run_name}/.fault-fired",
        steps_per_epoch_hint=max(1, split.train // (cfg.batch_size * cfg.max_workers)),
    )
    progress = _EpochLines(cfg.epochs)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=dataclasses.asdict(worker_config),
        # A (min, max) pair makes the worker group elastic: it starts with what fits and grows.
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.num_workers,
            use_gpu=cfg.use_gpu,
            resources_per_worker={"CPU": cfg.cpus_per_worker},
            elastic_resize_monitor_interval_s=cfg.resize_check_s,
        ),
        run_config=ray.train.RunConfig(
            name=run_name,
            storage_path=storage_path,
            failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=2, checkpoint_score_attribute="val_accuracy", checkpoint_score_order="max"
            ),
            callbacks=[progress.callback],
        ),
        datasets={"train": data.train, "val": data.val},
        dataset_config=data_config(cfg),
    )
    with progress:
        result = trainer.fit()
    if result.error:
        raise RuntimeError(f"training failed: {result.error}")
    best_checkpoint, best_metrics = max(result.best_checkpoints, key=lambda cm: cm[1]["val_accuracy"])
    state = load_checkpoint(best_checkpoint)
    history = load_checkpoint(result.checkpoint)["history"]  # the latest one has every epoch
    net = core.build_model(arch, len(classes), features=features, weights=backbone_weights)
    net.load_state_dict(state["model"])
    test_accuracy = partial(_accuracy_on, data.test, "features" if features else "image", len(classes))
    candidate_accuracy = test_accuracy(net.eval())
    log.info(
        "best epoch %d: validation %.3f, test slice %.3f",
        best_metrics["epoch"],
        best_metrics["val_accuracy"],
        candidate_accuracy,
    )

    card = registry.ModelCard(
        arch=arch,
        classes=classes,
        image_size=settings.image_size,
        features=features,
        training_kind="ddp",
        lineage=read.lineage(),
        metrics={
            "val_accuracy": best_metrics["val_accuracy"],
            "test_accuracy": candidate_accuracy,
            "train_loss": best_metrics["train_loss"],
            "epoch": best_metrics["epoch"],
        },
        split=split.to_dict(),
    )
    params = {
        **{k: v for k, v in asdict(cfg).items() if k != "snapshots"},
        "model": settings.model,
        "image_size": settings.image_size,
        "classes": ",".join(classes),
        "table": read.table,
        "table_snapshot_id": read.snapshot_id,
    }
    recall = {
        f"val_recall.{name}": r for name, r in zip(classes, best_metrics["per_class_recall"]) if r is not None
    }
    run_id = registry.log_run(
        settings,
        run_name=run_name,
        params=params,
        history=history,
        step="epoch",
        metrics={
            **recall,
            "best_val_accuracy": best_metrics["val_accuracy"],
            "test_accuracy": candidate_accuracy,
        },
        title=f"{run_name} ({settings.model})",
        inputs=[(table.load().location(), read.lineage())],
    )
    version = registry.register(settings.tracking_uri, settings.model_name, run_id, net, card)
    verdict = None
    if cfg.promote_if_better:
        verdict = promote_if_better(settings, version, run_id, card, candidate_accuracy, test_accuracy)
    report_metrics = {**best_metrics, "test_accuracy": candidate_accuracy}
    return TrainReport(
        version, run_id, report_metrics, len(history), classes, history[-1]["checksum"], verdict
    )


class _EpochLines:
    """One line per epoch on the driver while `fit` runs (Ray's own report lines stay in its logs):
    a Train callback, run on the controller, passes rank 0's metrics through a queue to a thread.
    Progress lines are best effort: nothing here may fail a run."""

    def __init__(self, epochs: int):
        import ray.train
        from ray.util.queue import Queue
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        class Relay(ray.train.UserCallback):
            def __init__(self, queue):
                self.queue = queue

            def after_report(self, run_context, metrics, checkpoint):
                try:
                    self.queue.put(metrics[0], timeout=5)
                except Exception:  # the queue gone or full: lose a progress line, not the run
                    log.debug("epoch line dropped", exc_info=True)

        # On the driver's node: a 0-CPU actor may land anywhere, and one on a node that dies would
        # take the progress lines with it.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.epochs = epochs
        self.queue = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": here})
        self.callback = Relay(self.queue)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._relay, daemon=True)

    def __enter__(self):
        self._thread.start()

    def __exit__(self, *exc):
        self._done.set()  # every report is in the queue once `fit` returns: the thread drains it
        self._thread.join()
        self.queue.shutdown()

    def _relay(self) -> None:
        from ray.util.queue import Empty

        while True:
            try:
                m = self.queue.get(timeout=0.5)
            except Empty:
                if self._done.is_set():
                    return
                continue
            except Exception:  # the queue's actor is gone: no more lines
                log.debug("epoch lines stopped", exc_info=True)
                return
            log.info(
                "epoch %d/%d: train loss %.3f, validation accuracy %.3f, %.0f images/s, %.1fs",
                m["epoch"] + 1,
                self.epochs,
                m["train_loss"],
                m["val_accuracy"],
                m["images_per_second"],
                m["epoch_seconds"],
            )


def _accuracy_on(dataset, column: str, num_classes: int, model: nn.Module) -> float:
    """A model's accuracy on a dataset of stored inputs, normalised as the training step does."""

    def batches():
        for batch in dataset.iter_torch_batches(batch_size=256):
            inputs = batch[column]
            yield (inputs.float() if column == "features" else normalize_pixels(inputs)), batch["label_index"]

    return core.evaluate(model, batches(), num_classes, device=torch.device("cpu"))["accuracy"]
