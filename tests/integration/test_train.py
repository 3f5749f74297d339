"""Training: real Ray Train on CPU with 2 workers, real MLflow; plus the core's numerics."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from app.data.snapshot import read_manifest
from app.transform import normalize_pixels


def test_training_learns_and_registers_lineage(trained):
    settings, snapshot, _, report, train_gauges = trained
    assert report.metrics["val_accuracy"] > 0.7, report.metrics  # chance is 1/6
    assert report.epochs == 5
    import mlflow

    mlflow.set_tracking_uri(settings.tracking_uri)
    client = mlflow.MlflowClient()
    version = client.get_model_version(settings.model_name, report.version)
    assert version.tags["training_kind"] == "ddp"
    assert version.tags["snapshot_ids"] == snapshot.snapshot_id
    manifest = read_manifest(settings, snapshot.snapshot_id)
    offsets = json.loads(version.tags["kafka_offsets"])[snapshot.snapshot_id]
    assert offsets == {str(p): {"start": o.start, "end": o.end} for p, o in manifest.offsets.items()}
    assert json.loads(version.tags["classes"]) == report.classes == manifest.classes
    assert str(client.get_model_version_by_alias(settings.model_name, "champion").version) == report.version
    artifacts = {a.path for a in client.list_artifacts(report.run_id)}
    assert {"curves.png", "history.json", "model"} <= artifacts
    run_metrics = client.get_run(report.run_id).data.metrics
    recall_metrics = [k for k in run_metrics if k.startswith("val_recall.")]
    assert len(recall_metrics) == len(report.classes)
    # The epoch was picked on validation; the test slice, newer still, measured it once after.
    from app import registry

    card = registry.load(settings.tracking_uri, settings.model_name, report.version).card
    assert card.metrics["test_accuracy"] == run_metrics["test_accuracy"] == report.metrics["test_accuracy"]
    assert card.metrics["val_accuracy"] == report.metrics["val_accuracy"]
    split = card.split
    assert split["train"] + split["val"] + split["test"] == manifest.records
    assert split["val_from"] <= split["test_from"] and split["val"] > 0 and split["test"] > 0
    history = json.loads(open(_artifact(settings, report.run_id, "history.json")).read())
    lrs = [row["lr"] for row in history]
    assert lrs[0] > lrs[1] > lrs[2]  # warmup done within epoch 0, then the cosine decays per step
    run_name = client.get_run(report.run_id).info.run_name
    missing = [
        name for name, samples in train_gauges.items() if not any(f'run="{run_name}"' in s for s in samples)
    ]
    assert not missing, f"not exported to Prometheus while training: {missing}"


@pytest.mark.slow
def test_elastic_worker_group_starts_with_what_fits(trained):
    """`--num-workers 1-4` at 0.8 CPU a worker on 2 logical CPUs: Ray Train starts the 2 that fit."""
    from app.config import TrainConfig
    from app.train import train

    settings, _, _, _, _ = trained
    report = train(
        settings,
        TrainConfig(
            epochs=1,
            num_workers="1-4",
            cpus_per_worker=0.8,
            batch_size=32,
            max_failures=0,
            run_name="elastic",
        ),
    )
    assert report.metrics["workers"] == 2, report.metrics


@pytest.mark.slow
def test_same_seed_same_metrics(trained):
    from app.train import train

    settings, _, train_config, report, _ = trained
    again = train(settings, train_config)
    assert again.metrics["val_accuracy"] == report.metrics["val_accuracy"]
    assert again.metrics["train_loss"] == pytest.approx(report.metrics["train_loss"], rel=1e-6)
    assert again.checksum == report.checksum


@pytest.mark.slow
def test_killed_worker_resumes_from_checkpoint(trained, tmp_path):
    """Rank 1 dies mid-epoch 1: the group restarts from epoch 0's checkpoint. Resumption, not a
    silent restart from scratch: epoch 0 finished before the fault and is kept as it was, each
    epoch is trained once, and the schedule's step count carries on."""
    from app.train import train

    settings, _, train_config, _, _ = trained
    cfg = dataclasses.replace(train_config, epochs=3, fail_at_epoch=1, max_failures=1, run_name="fault-run")
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
def test_rerun_with_the_same_name_resumes(trained):
    from app.train import train

    settings, _, train_config, _, _ = trained
    first = train(settings, dataclasses.replace(train_config, epochs=1, run_name="resumable"))
    # A different seed would change every epoch it retrained; epoch 0 must come from the first run.
    second = train(settings, dataclasses.replace(train_config, epochs=2, run_name="resumable", seed=99))
    assert second.epochs == 2
    history = json.loads(open(_artifact(settings, second.run_id, "history.json")).read())
    assert history[0]["checksum"] == first.checksum and history[1]["checksum"] != first.checksum


@pytest.mark.slow
def test_promotion_is_judged_on_the_test_slice(trained):
    """A worse candidate (one epoch at a tiny learning rate) is registered but keeps the champion;
    the comparison's figures, on the slice that picked neither model, are on its run."""
    import mlflow

    from app import registry
    from app.train import train

    settings, _, train_config, _, _ = trained
    champion = registry.resolve(settings.tracking_uri, settings.model_name, "champion")
    weak = dataclasses.replace(
        train_config, epochs=1, lr=1e-6, promote_if_better=True, run_name="weak-candidate"
    )
    report = train(settings, weak)
    verdict = report.verdict
    assert not verdict.promoted and verdict.champion_version == champion
    assert verdict.candidate_accuracy == report.metrics["test_accuracy"]
    assert verdict.champion_accuracy > verdict.candidate_accuracy
    assert registry.resolve(settings.tracking_uri, settings.model_name, "champion") == champion
    mlflow.set_tracking_uri(settings.tracking_uri)
    metrics = mlflow.MlflowClient().get_run(report.run_id).data.metrics
    assert metrics["promoted"] == 0 and metrics["champion_test_accuracy"] == verdict.champion_accuracy


def _artifact(settings, run_id: str, name: str) -> str:
    import mlflow

    mlflow.set_tracking_uri(settings.tracking_uri)
    return mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=name)


def test_feature_snapshot_trains_a_head_that_serves_images(settings, ray_cluster):
    """--features resnet50: the head trains on stored features; served on images, the frozen
    backbone reproduces those features, so serving sees what training saw."""
    import ray.data

    from app import registry
    from app.config import IngestConfig, ProduceConfig, TrainConfig
    from app.data.ingest import ingest
    from app.data.produce import produce
    from app.data.snapshot import snapshot_uri
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
    rows = ray.data.read_parquet(
        snapshot_uri(settings, snapshot.snapshot_id), file_extensions=["parquet"]
    ).take(3)
    with torch.inference_mode():
        from_features = loaded.model(torch.stack([torch.as_tensor(r["features"]) for r in rows]))
        pixels = torch.stack([torch.as_tensor(np.array(r["image"])) for r in rows])
        from_images = loaded.model(normalize_pixels(pixels))
    assert torch.allclose(from_features, from_images, atol=1e-4)


@pytest.mark.slow
def test_a_snapshot_keeping_sources_trains_at_another_size(settings, ray_cluster):
    """--keep-source: the encoded images ride along in the snapshot, so a model at a new image
    size trains from it without Kafka (`select_snapshots` refuses another size without them)."""
    from app import registry
    from app.config import IngestConfig, ProduceConfig, TrainConfig
    from app.data.ingest import ingest
    from app.data.produce import produce
    from app.train import train

    produce(
        settings,
        ProduceConfig(synthetic=96, seed=6, source_image_size=32, corrupt_fraction=0),
        settings.kafka_connection(),
    )
    snapshot = ingest(settings, IngestConfig(keep_source=True), settings.kafka_connection())
    manifest = read_manifest(settings, snapshot.snapshot_id)
    assert manifest.source and manifest.image_size == settings.image_size
    smaller = dataclasses.replace(settings, image_size=16)
    report = train(smaller, TrainConfig(epochs=1, num_workers=1, batch_size=16, max_failures=0))
    loaded = registry.load(settings.tracking_uri, settings.model_name, report.version)
    assert loaded.card.image_size == 16
    assert loaded.model(torch.zeros(2, 3, 16, 16)).shape == (2, len(report.classes))
