"""Training: real Ray Train on CPU with 2 workers, real MLflow; plus the core's numerics."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from app.data.selection import chw_images, select
from app.data.table import ImageTable
from app.transform import normalize_pixels


def _read(settings, snapshot_id: int):
    """A table snapshot as `train` reads it."""
    table = ImageTable.at(settings.storage, settings.catalog, settings.table)
    return select(table, settings.image_size, snapshot_id)


def test_training_learns_and_registers_lineage(trained):
    settings, snapshot, _, report, train_gauges = trained
    assert report.metrics["val_accuracy"] > 0.7, report.metrics  # chance is 1/6
    assert report.epochs == 5
    import mlflow

    mlflow.set_tracking_uri(settings.tracking_uri)
    client = mlflow.MlflowClient()
    version = client.get_model_version(settings.model_name, report.version)
    assert version.tags["training_kind"] == "ddp"
    # Lineage: the version names the table snapshot the ingest committed, and its Kafka offsets.
    assert version.tags["argus.table_snapshot_id"] == str(snapshot.snapshot_id)
    assert version.tags["argus.table"] == settings.table
    read = _read(settings, snapshot.snapshot_id)
    offsets = {str(p): {"start": start, "end": end} for p, (start, end) in snapshot.offsets.items()}
    assert json.loads(version.tags["kafka_offsets"]) == offsets == read.lineage()["offsets"]
    assert json.loads(version.tags["classes"]) == report.classes == read.classes(None)
    assert str(client.get_model_version_by_alias(settings.model_name, "champion").version) == report.version
    artifacts = {a.path for a in client.list_artifacts(report.run_id)}
    assert {"curves.png", "history.json", "model"} <= artifacts
    (dataset,) = client.get_run(report.run_id).inputs.dataset_inputs  # the table snapshot, as MLflow sees it
    assert dataset.dataset.name == str(snapshot.snapshot_id)
    assert json.loads(dataset.dataset.source)["uri"].endswith("warehouse/argus/behavior_images")
    assert client.get_run(report.run_id).data.params["table_snapshot_id"] == str(snapshot.snapshot_id)
    assert [tag.value for tag in dataset.tags] == ["training"]
    run_metrics = client.get_run(report.run_id).data.metrics
    recall_metrics = [k for k in run_metrics if k.startswith("val_recall.")]
    assert len(recall_metrics) == len(report.classes)
    # The epoch was picked on validation; the test slice, newer still, measured it once after.
    from app import registry

    card = registry.load(settings.tracking_uri, settings.model_name, report.version).card
    assert card.metrics["test_accuracy"] == run_metrics["test_accuracy"] == report.metrics["test_accuracy"]
    assert card.metrics["val_accuracy"] == report.metrics["val_accuracy"]
    assert card.lineage == read.lineage() and card.table_snapshot_id == snapshot.snapshot_id
    split = card.split
    assert split["train"] + split["val"] + split["test"] == snapshot.records
    assert snapshot.records == sum(read.label_counts.values())
    assert split["val_from"] <= split["test_from"] and split["val"] > 0 and split["test"] > 0
    history = json.loads(open(_artifact(settings, report.run_id, "history.json")).read())
    lrs = [row["lr"] for row in history]
    assert lrs[0] > lrs[1] > lrs[2]  # warmup done within epoch 0, then the cosine decays per step
    run_name = client.get_run(report.run_id).info.run_name
    missing = [
        name for name, samples in train_gauges.items() if not any(f'run="{run_name}"' in s for s in samples)
    ]
    assert not missing, f"not exported to Prometheus while training: {missing}"


# Each run below checks several things, so the module trains as few times as it can: one elastic
# run with grad accumulation and the balancing sampler, two one-epoch runs of the fixture's
# configuration (same seed: equal; one resumed by name; one judged for promotion) and one killed run.


@pytest.fixture(scope="module")
def varied(trained):
    """`--num-workers 1-4` at 0.8 CPU a worker on 2 logical CPUs, `--grad-accum 2`, `--balance
    sampler`, over two epochs: (the report, the run's last checkpoint)."""
    from app.train import train

    cfg = dataclasses.replace(
        trained.train_config,
        epochs=2,
        num_workers="1-4",
        cpus_per_worker=0.8,
        grad_accum=2,
        balance="sampler",
        run_name="elastic-accumulating-sampler",
    )
    return train(trained.settings, cfg), _last_checkpoint(trained.settings, cfg.run_name)


@pytest.fixture(scope="module")
def one_epoch(trained):
    """Two one-epoch runs of the fixture's configuration under different names, the second asking
    `--promote-if-better`: (the first report, the second report)."""
    from app.train import train

    cfg = dataclasses.replace(trained.train_config, epochs=1)
    first = train(trained.settings, dataclasses.replace(cfg, run_name="resumable"))
    candidate = train(
        trained.settings, dataclasses.replace(cfg, promote_if_better=True, run_name="one-epoch-candidate")
    )
    return first, candidate


@pytest.mark.slow
def test_elastic_worker_group_starts_with_what_fits(varied):
    """`1-4` workers at 0.8 CPU on 2 logical CPUs: Ray Train starts the 2 that fit."""
    report, _ = varied
    assert report.metrics["workers"] == 2, report.metrics


@pytest.mark.slow
def test_grad_accum_steps_the_optimizer_once_per_window(trained, varied):
    """`--grad-accum 2` under Ray Train: each epoch the optimiser (its own step count, saved in the
    checkpoint) steps ceil(micro-batches / 2) times, and the schedule with it."""
    _, checkpoint = varied
    history = checkpoint["history"]
    assert [row["epoch"] for row in history] == [0, 1]
    steps_before = 0
    for row in history:
        per_rank = sum(row["train_examples_per_class"]) / row["workers"]
        assert row["micro_batches"] == math.ceil(per_rank / trained.train_config.batch_size) > 2, row
        assert row["steps"] - steps_before == math.ceil(row["micro_batches"] / 2), history
        steps_before = row["steps"]
    optimizer_steps = {int(s["step"]) for s in checkpoint["optimizer"]["state"].values()}
    assert optimizer_steps == {history[-1]["steps"]}


def _off_even(counts) -> float:
    """The largest relative distance of a class's share from an even share (0: perfectly even)."""
    shares = np.asarray(counts) / np.sum(counts)
    return float(np.abs(shares * len(shares) - 1).max())


@pytest.mark.slow
def test_balance_sampler_reaches_the_workers_and_evens_out_the_classes(trained, varied):
    """`--balance sampler` under Ray Train: the rarest class of the training slice is shown well
    above its share, and the classes come out more even than the data, which the default (a
    weighted loss) shows as it is. Resampling keeps the number of examples an epoch shows. (The
    weights are the whole snapshot's, not this slice's, so the run is not exactly even: the next
    test checks the balance itself.)"""
    _, checkpoint = varied
    data = np.asarray(trained.report.metrics["train_examples_per_class"])
    shown = np.sum([row["train_examples_per_class"] for row in checkpoint["history"]], axis=0)
    assert all(sum(row["train_examples_per_class"]) == data.sum() for row in checkpoint["history"])
    assert _off_even(data) > 0.4, data  # skewed enough to tell the sampler's work from noise
    rarest = data.argmin()
    assert shown[rarest] / shown.sum() > 1.25 * data[rarest] / data.sum(), (shown, data)
    assert _off_even(shown) < _off_even(data), (shown, data)


def test_sampler_batches_show_skewed_classes_evenly(ray_cluster):
    """The sampler itself, over many batches of a Ray dataset skewed 1:10 between classes, with the
    class weights `train` computes from such counts: every class is shown about equally often."""
    import ray.data

    from app.train.data import class_weights
    from app.train.loop import WorkerConfig, _batches

    classes = tuple("abcdef")
    counts = [50, 100, 200, 300, 400, 500]
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(len(classes)), counts))
    shard = ray.data.from_items([{"features": np.zeros(4, np.float32), "label_index": k} for k in labels])
    weights = class_weights(dict(zip(classes, counts)), list(classes))
    cfg = WorkerConfig(
        run_name="sampler",
        model="cnn",
        features=True,
        backbone_weights=None,
        classes=classes,
        epochs=1,
        batch_size=32,
        lr=1e-3,
        weight_decay=0.0,
        label_smoothing=0.0,
        warmup_fraction=0.0,
        train_records=len(labels),
        seed=0,
        amp="off",
        grad_accum=1,
        balance="sampler",
        augment="none",
        class_weights=tuple(weights),
        snapshot_id=0,
        threads=1,
        fail_at_epoch=None,
        fault_marker="",
        steps_per_epoch_hint=1,
    )
    shown = np.zeros(len(classes), dtype=np.int64)
    for epoch_seed in range(3):
        for _, targets in _batches(shard, cfg, torch.device("cpu"), epoch_seed, training=True):
            shown += np.bincount(targets.numpy(), minlength=len(classes))
    assert shown.sum() == 3 * len(labels)
    assert _off_even(counts) > 0.8 and _off_even(shown) < 0.25, shown


@pytest.mark.slow
def test_same_seed_same_metrics(one_epoch):
    first, again = one_epoch
    assert again.metrics["val_accuracy"] == first.metrics["val_accuracy"]
    assert again.metrics["train_loss"] == pytest.approx(first.metrics["train_loss"], rel=1e-6)
    assert again.checksum == first.checksum


@pytest.mark.slow
def test_killed_worker_resumes_from_checkpoint(trained):
    """Rank 1 dies mid-epoch 1: the group restarts from epoch 0's checkpoint. Resumption, not a
    silent restart from scratch: epoch 0 finished before the fault and is kept as it was, each
    epoch is trained once, and the schedule's step count carries on."""
    from app.train import train

    settings = trained.settings
    cfg = dataclasses.replace(
        trained.train_config, epochs=3, fail_at_epoch=1, max_failures=1, run_name="fault-run"
    )
    report = train(settings, cfg)
    assert report.epochs == 3
    marker = f"{settings.uri('checkpoints', 'train')}/fault-run/.fault-fired"
    fault_at = float(open(marker).read())  # the fault really fired
    history = json.loads(open(_artifact(settings, report.run_id, "history.json")).read())
    assert [row["epoch"] for row in history] == [0, 1, 2]
    assert history[0]["finished_at"] < fault_at < history[1]["finished_at"]
    steps = [row["steps"] for row in history]
    assert steps == [steps[0], 2 * steps[0], 3 * steps[0]], steps


@pytest.mark.slow
def test_rerun_with_the_same_name_resumes(trained, one_epoch):
    from app.train import train

    first, _ = one_epoch
    # A different seed would change every epoch it retrained; epoch 0 must come from the first run.
    second = train(
        trained.settings, dataclasses.replace(trained.train_config, epochs=2, run_name="resumable", seed=99)
    )
    assert second.epochs == 2
    history = json.loads(open(_artifact(trained.settings, second.run_id, "history.json")).read())
    assert history[0]["checksum"] == first.checksum and history[1]["checksum"] != first.checksum


@pytest.mark.slow
def test_promotion_is_judged_on_the_test_slice(trained, one_epoch):
    """A worse candidate (one epoch against the champion's five) is registered but keeps the
    champion; the comparison's figures, on the slice that picked neither model, are on its run."""
    import mlflow

    from app import registry

    settings = trained.settings
    _, report = one_epoch
    verdict = report.verdict
    assert not verdict.promoted and verdict.champion_version == trained.report.version
    assert verdict.candidate_accuracy == report.metrics["test_accuracy"]
    assert verdict.champion_accuracy > verdict.candidate_accuracy
    assert registry.resolve(settings.tracking_uri, settings.model_name, "champion") == trained.report.version
    mlflow.set_tracking_uri(settings.tracking_uri)
    metrics = mlflow.MlflowClient().get_run(report.run_id).data.metrics
    assert metrics["promoted"] == 0 and metrics["champion_test_accuracy"] == verdict.champion_accuracy


def _last_checkpoint(settings, run_name: str) -> dict:
    """The newest epoch's checkpoint of a run, as `app.train.checkpoint` reads it."""
    from ray.train import Checkpoint

    from app.train.checkpoint import CHECKPOINT_FILE, load_checkpoint

    run = Path(settings.uri("checkpoints", "train"), run_name)
    states = [load_checkpoint(Checkpoint.from_directory(str(f.parent))) for f in run.rglob(CHECKPOINT_FILE)]
    assert states, f"no checkpoint under {run}"
    return max(states, key=lambda state: state["epoch"])


def _artifact(settings, run_id: str, name: str) -> str:
    import mlflow

    mlflow.set_tracking_uri(settings.tracking_uri)
    return mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=name)


def test_feature_snapshot_trains_a_head_that_serves_images(settings, ray_cluster):
    """--features resnet50: the head trains on stored features; served on images, the frozen
    backbone reproduces those features, so serving sees what training saw."""
    from app import registry
    from app.config import IngestConfig, ProduceConfig, TrainConfig
    from app.data.ingest import ingest
    from app.data.produce import produce
    from app.train import train

    produce(
        settings,
        ProduceConfig(synthetic=96, seed=4, source_image_size=32, corrupt_fraction=0),
        settings.kafka_connection(),
    )
    snapshot = ingest(settings, IngestConfig(features="resnet50"), settings.kafka_connection())
    report = train(settings, TrainConfig(epochs=1, num_workers=2, batch_size=16, max_failures=0))
    loaded = registry.load(settings.tracking_uri, settings.model_name, report.version)
    assert loaded.card.features and loaded.card.arch == "resnet50"
    table = ImageTable.at(settings.storage, settings.catalog, settings.table)
    rows = table.scan(snapshot.snapshot_id, ["features", "pixels", "height", "width"]).slice(0, 3)
    size = rows.column("height")[0].as_py()
    with torch.inference_mode():
        from_features = loaded.model(torch.tensor(rows.column("features").to_pylist()))
        pixels = torch.from_numpy(chw_images(rows.column("pixels").to_pylist(), size, size))
        from_images = loaded.model(normalize_pixels(pixels))
    assert torch.allclose(from_features, from_images, atol=1e-4)


@pytest.mark.slow
def test_a_pinned_snapshot_keeping_sources_trains_at_another_size(settings, ray_cluster):
    """--keep-source: the encoded images ride along in the table, so a model at a new image size
    trains from them without Kafka (`select` refuses another size without them). `--snapshots ID`
    pins an older table snapshot: a commit since adds nothing to what the run reads or records."""
    from app import registry
    from app.config import IngestConfig, ProduceConfig, TrainConfig
    from app.data.ingest import ingest
    from app.data.produce import produce
    from app.train import train

    def publish(records: int, seed: int) -> None:
        config = ProduceConfig(synthetic=records, seed=seed, source_image_size=32, corrupt_fraction=0)
        produce(settings, config, settings.kafka_connection())

    publish(96, seed=6)
    pinned = ingest(settings, IngestConfig(keep_source=True), settings.kafka_connection())
    read = _read(settings, pinned.snapshot_id)
    assert read.source and read.image_size == settings.image_size
    publish(32, seed=7)
    later = ingest(settings, IngestConfig(keep_source=True), settings.kafka_connection())
    assert later.snapshot_id != pinned.snapshot_id and later.records == 32

    smaller = dataclasses.replace(settings, image_size=16)
    pin = {"snapshots": pinned.snapshot_id, "run_name": "pinned"}
    cfg = TrainConfig(epochs=1, num_workers=1, batch_size=16, max_failures=0, **pin)
    report = train(smaller, cfg)
    loaded = registry.load(settings.tracking_uri, settings.model_name, report.version)
    assert loaded.card.image_size == 16
    assert loaded.model(torch.zeros(2, 3, 16, 16)).shape == (2, len(report.classes))
    assert loaded.card.table_snapshot_id == pinned.snapshot_id
    assert loaded.card.lineage["offsets"] == read.lineage()["offsets"]
    assert sum(loaded.card.split[k] for k in ("train", "val", "test")) == pinned.records == 96
    assert _last_checkpoint(smaller, "pinned")["table_snapshot_id"] == pinned.snapshot_id
