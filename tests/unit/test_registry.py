"""The registry's trust checks against a real MLflow (SQLite and a local artifact store): a version
loads only while its artifacts match the digests registration recorded, and only from a card that
describes a model Argus builds."""

from __future__ import annotations

import json

import pytest

from app import registry
from app.model import build_model
from app.registry import META_FILE, WEIGHTS_FILE, ModelCard, TamperedModel

CARD = ModelCard(
    arch="cnn",
    classes=["benign", "phishing", "malware"],
    image_size=32,
    features=False,
    training_kind="ddp",
    snapshots=[],
    metrics={"val_accuracy": 0.5},
)


@pytest.fixture
def registered(tmp_path):
    """A registered v1 and where its artifacts lie."""
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with registry.start_run(tracking_uri, (tmp_path / "artifacts").as_uri(), "trust") as run:
        version = registry.register(tracking_uri, "argus-trust", run.info.run_id, build_model("cnn", 3), CARD)
    (artifacts,) = (tmp_path / "artifacts").rglob(WEIGHTS_FILE)
    return tracking_uri, version, artifacts.parent


def test_a_registered_version_loads_and_records_its_digests(registered):
    tracking_uri, version, _ = registered
    loaded = registry.load(tracking_uri, "argus-trust", version)
    assert loaded.card == CARD
    import mlflow

    tags = mlflow.MlflowClient(tracking_uri).get_model_version("argus-trust", version).tags
    assert len(tags["weights_sha256"]) == len(tags["card_sha256"]) == 64


def test_weights_changed_in_the_artifact_store_are_refused(registered):
    tracking_uri, version, folder = registered
    weights = folder / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of one weight: still valid safetensors
    weights.write_bytes(bytes(data))
    with pytest.raises(TamperedModel, match=f"{WEIGHTS_FILE} differs from what was registered"):
        registry.load(tracking_uri, "argus-trust", version)


def test_a_card_changed_in_the_artifact_store_is_refused(registered):
    tracking_uri, version, folder = registered
    card = json.loads((folder / META_FILE).read_text())
    (folder / META_FILE).write_text(json.dumps({**card, "image_size": 4096}))
    with pytest.raises(TamperedModel, match=f"{META_FILE} differs"):
        registry.load(tracking_uri, "argus-trust", version)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"arch": "os.system"}, "arch 'os.system'"),
        ({"classes": [f"c{i}" for i in range(registry.MAX_CLASSES + 1)]}, "classes must be"),
        ({"classes": ["a", "a"]}, "classes must be"),
        ({"classes": "ab"}, "classes must be"),
        ({"image_size": 100_000}, "image_size"),
        ({"image_size": "32"}, "image_size"),
        ({"features": "yes"}, "features"),
        ({"extra": 1}, "unknown fields"),
    ],
)
def test_cards_that_describe_no_buildable_model_are_refused(change, why):
    with pytest.raises(TamperedModel, match=why):
        ModelCard.from_json(json.dumps({**json.loads(CARD.to_json()), **change}))
    with pytest.raises(TamperedModel, match="model card"):
        ModelCard.from_json(json.dumps({"arch": "cnn"}))


def test_the_stored_card_round_trips():
    assert ModelCard.from_json(CARD.to_json()) == CARD
