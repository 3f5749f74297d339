"""The registry's trust checks against a real MLflow (SQLite and a local artifact store): a version
loads only while its artifacts match the digests registration recorded, and only from a card that
describes a model Argus builds."""

from __future__ import annotations

import dataclasses
import json

import pytest

from app import registry
from app.config import Settings
from app.model import build_model
from app.registry import META_FILE, WEIGHTS_FILE, ModelCard, TamperedModel

CARD = ModelCard(
    arch="cnn",
    classes=["benign", "phishing", "malware"],
    image_size=32,
    features=False,
    training_kind="ddp",
    lineage={
        "table": "argus.behavior_images",
        "snapshot_id": "4242",
        "offsets": {"0": {"start": 0, "end": 90}, "1": {"start": 0, "end": 70}},
    },
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


def test_a_registered_version_loads_and_records_its_digests_and_table_snapshot(registered):
    tracking_uri, version, _ = registered
    loaded = registry.load(tracking_uri, "argus-trust", version)
    assert loaded.card == CARD and loaded.card.table_snapshot_id == 4242
    import mlflow

    tags = mlflow.MlflowClient(tracking_uri).get_model_version("argus-trust", version).tags
    assert len(tags["weights_sha256"]) == len(tags["card_sha256"]) == 64
    assert tags["argus.table_snapshot_id"] == "4242" and tags["argus.table"] == "argus.behavior_images"
    assert json.loads(tags["kafka_offsets"]) == CARD.lineage["offsets"]


def test_pinned_snapshot_ids_are_those_the_versions_of_the_model_name_for_the_table(registered, tmp_path):
    """What expiry keeps: every version's table snapshot, for this table and this model name only;
    a card without a table snapshot pins nothing."""
    tracking_uri, _, _ = registered
    model = build_model("cnn", 3)
    cards = {
        ("argus-trust", "argus.behavior_images", "77"),
        ("argus-trust", "lake.other_images", "88"),  # another table's snapshot
        ("argus-other", "argus.behavior_images", "99"),  # another model's
        ("argus-trust", None, None),  # a version that names no table snapshot
    }
    for name, table, snapshot_id in sorted(cards, key=str):
        lineage = {"table": table, "snapshot_id": snapshot_id, "offsets": {}} if table else {}
        card = dataclasses.replace(CARD, lineage=lineage)
        with registry.start_run(tracking_uri, (tmp_path / "artifacts").as_uri(), name) as run:
            registry.register(tracking_uri, name, run.info.run_id, model, card)
    settings = Settings(storage=str(tmp_path / "data"), mlflow_uri=tracking_uri, model_name="argus-trust")
    assert registry.pinned_snapshot_ids(settings) == {4242, 77}
    other = dataclasses.replace(settings, table="lake.other_images")
    assert registry.pinned_snapshot_ids(other) == {88}


def test_pinned_snapshot_ids_without_a_registry_are_none_and_create_none(tmp_path):
    settings = Settings(storage=str(tmp_path / "data"))
    assert registry.pinned_snapshot_ids(settings) == set()
    assert not (tmp_path / "data").exists()


def test_pinned_snapshot_ids_raise_when_the_registry_does_not_answer(tmp_path, monkeypatch):
    """The caller must not expire anything on a registry it could not read."""
    from app.net import free_port

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    settings = Settings(storage=str(tmp_path / "data"), mlflow_uri=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(Exception, match="127.0.0.1"):
        registry.pinned_snapshot_ids(settings)


def test_a_card_from_before_the_table_still_loads_with_its_snapshot_folders():
    """Cards registered on snapshot folders list them in `snapshots`; they name no table snapshot."""
    fields = {k: v for k, v in json.loads(CARD.to_json()).items() if k != "lineage"}
    folders = [{"snapshot_id": "20261201-0001", "offsets": {"0": {"start": 0, "end": 9}}}]
    card = ModelCard.from_json(json.dumps({**fields, "snapshots": folders}))
    assert card.snapshots == folders and card.lineage == {} and card.table_snapshot_id is None
    assert "snapshots" not in json.loads(CARD.to_json())  # cards since carry the table's lineage only


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
        ({"lineage": ["s1"]}, "lineage"),
    ],
)
def test_cards_that_describe_no_buildable_model_are_refused(change, why):
    with pytest.raises(TamperedModel, match=why):
        ModelCard.from_json(json.dumps({**json.loads(CARD.to_json()), **change}))
    with pytest.raises(TamperedModel, match="model card"):
        ModelCard.from_json(json.dumps({"arch": "cnn"}))


def test_the_stored_card_round_trips():
    assert ModelCard.from_json(CARD.to_json()) == CARD


# Loads and predicts with a registered version as a user's process would where only the pinned
# requirements are installed: this repository's `app` is not importable (its editable install's
# finder is removed), so everything the model runs comes from the version's own `code/` folder.
PYFUNC_USER = """
import base64, importlib.util, json, sys
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
assert importlib.util.find_spec("app") is None, "this repository's app is importable"
import mlflow, pandas as pd
uri, images = json.load(sys.stdin)
model = mlflow.pyfunc.load_model(uri)
answers = model.predict(pd.DataFrame({"image": [base64.b64decode(i) for i in images]}))
try:
    model.predict(pd.DataFrame({"image": [base64.b64decode(images[0]), b"not an image"]}))
    refused = ""
except Exception as exc:
    refused = str(exc)
json.dump({"label": list(answers["label"]), "score": list(answers["score"]), "refused": refused}, sys.stdout)
"""


def test_a_registered_version_is_a_pyfunc_model_that_answers_as_serving_does(registered, tmp_path):
    """CONTRACT.md §5: `mlflow.pyfunc.load_model("models:/NAME/VERSION")` predicts on raw image
    bytes with the labels (and probabilities) a replica computes, in a process where this
    repository is not importable; loading it unpickles nothing."""
    import base64
    import os
    import subprocess
    import sys

    import mlflow

    from app.data import synth
    from app.inference import infer
    from app.transform import decode_pixels

    tracking_uri, version, folder = registered
    assert not list(folder.parent.rglob("*.pkl"))  # saved as code: the model is this repository's file
    shipped = {p.relative_to(folder.parent / "code").as_posix() for p in folder.parent.rglob("code/**/*.py")}
    assert shipped == {f"app/{name}" for name in registry.PYFUNC_PACKAGE_FILES}  # the inference path only
    mlflow.set_tracking_uri(tracking_uri)
    assert mlflow.pyfunc.load_model(
        f"models:/argus-trust/{version}"
    ).metadata.get_input_schema().input_names() == [registry.IMAGE_COLUMN]
    images = [r.value for r in synth.generate(6, seed=3, size=48, late_fraction=0.0, corrupt_fraction=0.0)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"MLFLOW_TRACKING_URI": tracking_uri}
    user = subprocess.run(
        [sys.executable, "-c", PYFUNC_USER],
        input=json.dumps([f"models:/argus-trust/{version}", [base64.b64encode(i).decode() for i in images]]),
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
    )  # fmt: skip
    assert user.returncode == 0, user.stderr[-3000:]
    answers = json.loads(user.stdout)

    served = registry.load(tracking_uri, "argus-trust", version)
    expected = [answer for answer, _ in infer([(decode_pixels(v, CARD.image_size), served) for v in images])]
    assert answers["label"] == [a["label"] for a in expected]
    assert answers["score"] == pytest.approx([a["scores"][a["label"]] for a in expected], abs=1e-6)
    assert "row 1: " in answers["refused"]


def test_a_version_registered_before_the_pyfunc_flavor_still_loads(registered):
    """Weights and card at the top of the version's folder (the layout before the flavor)."""
    tracking_uri, version, folder = registered
    for name in (WEIGHTS_FILE, META_FILE):
        (folder / name).rename(folder.parent / name)
    loaded = registry.load(tracking_uri, "argus-trust", version)
    assert loaded.card == CARD
