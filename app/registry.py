"""The MLflow model registry: the single source of model versions, their lineage and the alias
that decides what is served (CONTRACT.md §5). Weights travel as safetensors, never as pickles;
registration records the SHA-256 of the weights and the card in the version's tags (the tracking
server's database), and loading checks the artifacts against them and the card against what a
model can be before anything is built from it.

    python -m app promote VERSION     # move the serving alias; replicas follow it
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import torch

from app.config import MODELS
from app.model import build_model, load_state_dict, save_state_dict

log = logging.getLogger(__name__)

EXPERIMENT = "argus"
WEIGHTS_FILE = "weights.safetensors"
META_FILE = "argus_model.json"
DIGEST_TAGS = {WEIGHTS_FILE: "weights_sha256", META_FILE: "card_sha256"}
MAX_CLASSES = 1000
# The pyfunc flavor (CONTRACT.md §5): `app/pyfunc.py` saved as code, the weights and card as its
# artifacts (in the version's `artifacts/` folder), and as its code the part of the `app` package
# that loading and predicting import (closed under imports; a test loads a version where this
# repository is not importable, so a module missing here fails it).
PYFUNC_CODE = Path(__file__).with_name("pyfunc.py")
PYFUNC_PACKAGE_FILES = (
    "__init__.py", "pyfunc.py", "registry.py", "model.py", "inference.py", "transform.py",
    "config.py", "errors.py", "net.py", "data/__init__.py", "data/kafka.py", "data/kafka_config.py",
    "data/records.py",
)  # fmt: skip
WEIGHTS_ARTIFACT, CARD_ARTIFACT = "weights", "card"
ARTIFACT_FILES = {WEIGHTS_ARTIFACT: WEIGHTS_FILE, CARD_ARTIFACT: META_FILE}
IMAGE_COLUMN = "image"
TABLE_TAG, SNAPSHOT_TAG = "argus.table", "argus.table_snapshot_id"
"""Version tags naming the table snapshot a version learnt from: what `pinned_snapshot_ids` reads."""
# What `app.pyfunc` imports (it needs neither Ray nor Kafka), pinned to the versions that trained it.
PYFUNC_REQUIREMENTS = ("mlflow", "torch", "torchvision", "pillow", "numpy", "safetensors", "pyarrow")


class TamperedModel(RuntimeError):
    """A registered version's artifacts do not match what registration recorded, or its card
    describes no model Argus builds."""


def _mlflow(tracking_uri: str):
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    return mlflow


@contextlib.contextmanager
def start_run(tracking_uri: str, artifact_root: str | None, run_name: str) -> Iterator:
    """An MLflow run in the `argus` experiment (artifacts under `artifact_root`), ended on exit."""
    mlflow = _mlflow(tracking_uri)
    with mlflow.start_run(experiment_id=experiment_id(tracking_uri, artifact_root), run_name=run_name) as run:
        yield run


def log_run(
    settings,
    *,
    run_name: str,
    params: dict,
    history: list[dict],
    step: str,
    title: str,
    metrics: dict[str, float] | None = None,
    tags: dict[str, str] | None = None,
    inputs: Iterable[tuple[str, dict]] = (),
) -> str:
    """One MLflow run in the `argus` experiment, as train and federate both log theirs: params, each
    history row's numbers as metrics at that row's `step` (epoch or round), extra `metrics`, the
    curves (PNG) and history (JSON) as artifacts, and the table snapshot it learnt from (the
    table's location and the read's lineage in `inputs`) as a dataset input. Returns the run id."""
    import mlflow

    from app.plots import save_curves

    with start_run(settings.tracking_uri, artifact_root(settings), run_name) as run:
        mlflow.log_params(params)
        for uri, lineage in inputs:
            mlflow.log_input(table_dataset(uri, lineage), context="training")
        if tags:
            mlflow.set_tags(tags)
        for row in history:
            mlflow.log_metrics(
                {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != step}, step=row[step]
            )
        if metrics:
            mlflow.log_metrics(metrics)
        with tempfile.TemporaryDirectory() as directory:
            save_curves(history, f"{directory}/curves.png", title=title, x=step)
            Path(directory, "history.json").write_text(json.dumps(history, indent=2))
            mlflow.log_artifacts(directory)
        return run.info.run_id


def table_dataset(uri: str, lineage: dict):
    """A table snapshot as an MLflow dataset: the table's location, named by the snapshot id, its
    digest that of the snapshot's Kafka offsets (the same offsets are the same records, CONTRACT.md §2)."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    with warnings.catch_warnings():
        # MLflow registers its local-file source twice and warns that a file:// URI is ambiguous.
        warnings.filterwarnings("ignore", "The specified dataset source can be interpreted")
        source = resolve_dataset_source(uri if "://" in uri else Path(uri).as_uri())
    digest = hashlib.sha256(json.dumps(lineage["offsets"], sort_keys=True).encode()).hexdigest()[:16]
    return MetaDataset(source, name=lineage["snapshot_id"], digest=digest)


def experiment_id(tracking_uri: str, artifact_root: str | None) -> str:
    """The `argus` experiment, created with its artifacts at `artifact_root` (None: where the
    tracking server keeps them)."""
    mlflow = _mlflow(tracking_uri)
    experiment = mlflow.get_experiment_by_name(EXPERIMENT)
    if experiment is not None:
        return experiment.experiment_id
    return mlflow.create_experiment(EXPERIMENT, artifact_location=artifact_root)


def artifact_root(settings) -> str | None:
    """Artifacts live beside the snapshots: `<storage>/mlartifacts`, on local disk or an object
    store (MLflow reads S3's endpoint and keys from the environment, as pyarrow does). With a
    tracking server (http[s]://), None: the server's own artifact store, behind its authentication,
    which every client of a shared registry can reach."""
    if urlsplit(settings.tracking_uri).scheme in ("http", "https"):
        return None
    uri = settings.uri("mlartifacts")
    return Path(uri).as_uri() if settings.is_local_storage else uri


@dataclass
class ModelCard:
    """What a registered version needs to be rebuilt and explained (GET /model)."""

    arch: str
    classes: list[str]
    image_size: int
    features: bool
    training_kind: str
    lineage: dict
    """The table snapshot the version learnt from (`TableRead.lineage()`): {table, snapshot_id,
    offsets: {partition: {start, end}}}; {} on a card registered before the table."""
    metrics: dict
    split: dict | None = None
    """The event-time split (`app.selection.EventTimeSplit`): which records picked the model and
    which judged it; None for versions registered before the split existed."""
    privacy: dict | None = None
    """Under differential privacy, what it promises and how it was counted (epsilon, delta, noise
    multiplier, clip, rounds, client sampling, accountant, and whether the starting model had
    seen these users' data without DP); None for a model trained without DP."""
    snapshots: list[dict] | None = None
    """Cards registered before the Iceberg table: [{snapshot_id, offsets}] of the snapshot folders
    they were trained on (still shown by GET /model); None on every card since."""

    def to_json(self) -> str:
        fields = {k: v for k, v in self.__dict__.items() if not (k == "snapshots" and v is None)}
        return json.dumps(fields, indent=2, sort_keys=True)

    @property
    def table_snapshot_id(self) -> int | None:
        """The table snapshot the version learnt from (None: a card from before the table)."""
        snapshot_id = self.lineage.get("snapshot_id") if isinstance(self.lineage, dict) else None
        return int(snapshot_id) if snapshot_id is not None else None

    @classmethod
    def from_json(cls, text: str) -> ModelCard:
        """A card as stored, checked before a model is built from it: a known architecture, a
        bounded class list and an image size training accepts."""
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TamperedModel(f"model card is not JSON: {exc}") from None
        known = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(fields, dict) or not set(fields) <= known:
            raise TamperedModel(f"model card has unknown fields: {sorted(set(fields) - known)}")
        if "snapshots" in fields:  # registered before the table: its lineage is that list
            fields.setdefault("lineage", {})
        try:
            card = cls(**fields)
        except TypeError as exc:  # a required field missing
            raise TamperedModel(f"model card: {exc}") from None
        classes = card.classes
        checks = [
            (card.arch in MODELS, f"arch {card.arch!r} is none of {', '.join(MODELS)}"),
            (
                isinstance(classes, list)
                and 2 <= len(classes) <= MAX_CLASSES
                and all(isinstance(c, str) and 0 < len(c) <= 200 for c in classes)
                and len(set(classes)) == len(classes),
                f"classes must be 2..{MAX_CLASSES} distinct names",
            ),
            (
                isinstance(card.image_size, int) and 8 <= card.image_size <= 1024,
                f"image_size {card.image_size!r} is outside 8..1024",
            ),
            (isinstance(card.features, bool), "features must be true or false"),
            (isinstance(card.lineage, dict), "lineage must be an object"),
        ]
        for ok, why in checks:
            if not ok:
                raise TamperedModel(f"model card: {why}")
        return card


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def register(
    tracking_uri: str,
    model_name: str,
    run_id: str,
    model: torch.nn.Module,
    card: ModelCard,
    alias_if_first: str = "champion",
) -> str:
    """Log weights and card as the run's `model`, a pyfunc model, and register it as a new version.

    The first version of a name also gets the serving alias, so a fresh system serves something.
    """
    mlflow = _mlflow(tracking_uri)
    client = mlflow.MlflowClient()
    with tempfile.TemporaryDirectory() as tmp:
        files = Path(tmp, "files")
        files.mkdir()
        save_state_dict(model, str(files / WEIGHTS_FILE))
        (files / META_FILE).write_text(card.to_json())
        digests = {tag: _sha256(files / name) for name, tag in DIGEST_TAGS.items()}
        save_pyfunc(f"{tmp}/model", files, card, {"name": model_name, "run_id": run_id})
        client.log_artifacts(run_id, f"{tmp}/model", artifact_path="model")
    source = f"{client.get_run(run_id).info.artifact_uri}/model"
    if not client.search_registered_models(filter_string=f"name = '{model_name}'"):
        client.create_registered_model(model_name, description="Argus behaviour-image classifier")
    tags = {
        "training_kind": card.training_kind,
        "arch": card.arch,
        "classes": json.dumps(card.classes),
        "image_size": str(card.image_size),
        **_lineage_tags(card.lineage),
        **{f"metric.{k}": f"{v:.4f}" for k, v in card.metrics.items() if isinstance(v, (int, float))},
        **digests,
    }
    version = client.create_model_version(model_name, source, run_id=run_id, tags=tags).version
    if alias_if_first and not _aliases(client, model_name):
        client.set_registered_model_alias(model_name, alias_if_first, version)
        log.info("%s v%s is the first version: alias %r points at it", model_name, version, alias_if_first)
    return str(version)


def _lineage_tags(lineage: dict) -> dict[str, str]:
    """The version's tags for its table snapshot (none for a card without one)."""
    if not lineage.get("snapshot_id"):
        return {}
    return {
        TABLE_TAG: lineage["table"],
        SNAPSHOT_TAG: str(lineage["snapshot_id"]),
        "kafka_offsets": json.dumps(lineage["offsets"], sort_keys=True),
    }


def save_pyfunc(path: str, files: Path, card: ModelCard, config: dict) -> None:
    """The pyfunc model folder at `path`: MLmodel (signature: a column of image bytes → label and
    score), the code, the weights and card from `files`, an input example, pinned requirements."""
    import importlib.metadata
    import io

    import mlflow
    import pandas as pd
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, Schema
    from PIL import Image

    signature = ModelSignature(
        inputs=Schema([ColSpec(DataType.binary, IMAGE_COLUMN)]),
        outputs=Schema([ColSpec(DataType.string, "label"), ColSpec(DataType.double, "score")]),
    )
    example = io.BytesIO()
    Image.new("RGB", (card.image_size, card.image_size), (128, 128, 128)).save(example, "PNG")
    with tempfile.TemporaryDirectory() as code:
        package = Path(code) / "app"
        for name in PYFUNC_PACKAGE_FILES:
            (package / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(PYFUNC_CODE.parent / name, package / name)
        mlflow.pyfunc.save_model(
            path=path,
            python_model=str(PYFUNC_CODE),
            artifacts={key: str(files / name) for key, name in ARTIFACT_FILES.items()},
            code_paths=[str(package)],
            model_config=config,
            signature=signature,
            input_example=pd.DataFrame({IMAGE_COLUMN: [example.getvalue()]}),
            pip_requirements=[f"{p}=={importlib.metadata.version(p)}" for p in PYFUNC_REQUIREMENTS],
        )


def record_metrics(
    tracking_uri: str, model_name: str, version: str, run_id: str, metrics: dict[str, float]
) -> None:
    """Figures measured after registration (the test-slice comparison): on the run and the version."""
    client = _mlflow(tracking_uri).MlflowClient()
    for key, value in metrics.items():
        client.log_metric(run_id, key, value)
        client.set_model_version_tag(model_name, version, f"metric.{key}", f"{value:.4f}")


def _aliases(client, model_name: str) -> dict:
    return dict(client.get_registered_model(model_name).aliases or {})


def promote(tracking_uri: str, model_name: str, version: str, alias: str = "champion") -> None:
    client = _mlflow(tracking_uri).MlflowClient()
    client.get_model_version(model_name, version)  # raises for an unknown version
    client.set_registered_model_alias(model_name, alias, version)


def pinned_snapshot_ids(settings) -> set[int]:
    """The table snapshot ids that the registered versions of `settings.model_name` name for
    `settings.table`: expiry keeps them, so every version's data can be read again (drift's
    reference, a retraining). Raises when the registry cannot be read: then nothing may expire."""
    uri = settings.tracking_uri
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        return set()  # no registry yet, so no version: do not create one here
    client = _mlflow(uri).MlflowClient()
    pinned, token = set(), None
    while True:
        page = client.search_model_versions(f"name = '{settings.model_name}'", page_token=token)
        for version in page:
            tags = version.tags or {}
            if tags.get(SNAPSHOT_TAG) and tags.get(TABLE_TAG) == settings.table:
                pinned.add(int(tags[SNAPSHOT_TAG]))
        token = page.token
        if not token:
            return pinned


def resolve(tracking_uri: str, model_name: str, alias: str) -> str | None:
    """The version the alias points at, or None when it points nowhere yet."""
    from mlflow.exceptions import MlflowException

    client = _mlflow(tracking_uri).MlflowClient()
    try:
        return str(client.get_model_version_by_alias(model_name, alias).version)
    except MlflowException:
        return None


@dataclass
class LoadedModel:
    model: torch.nn.Module
    card: ModelCard
    name: str
    version: str
    run_id: str


def load(tracking_uri: str, model_name: str, version: str) -> LoadedModel:
    """Rebuild a registered version from its card with the shared model factory, in eval mode,
    once its artifacts match the digests registration recorded (TamperedModel otherwise)."""
    mlflow = _mlflow(tracking_uri)
    model_version = mlflow.MlflowClient().get_model_version(model_name, version)
    source = model_version.source
    with tempfile.TemporaryDirectory() as tmp:
        # Only the two files read here: a pyfunc version's folder also holds its code, ~90 files, each
        # a request (and a password check) to a tracking server. One registered before the flavor
        # keeps them at the top; a pyfunc version under artifacts/.
        top = {Path(info.path).name for info in mlflow.artifacts.list_artifacts(artifact_uri=source)}
        if WEIGHTS_FILE not in top:
            source = f"{source}/artifacts"
        folder = Path(tmp)
        for name in DIGEST_TAGS:
            mlflow.artifacts.download_artifacts(artifact_uri=f"{source}/{name}", dst_path=tmp)
        for name, tag in DIGEST_TAGS.items():
            recorded = model_version.tags.get(tag)
            if recorded is None:
                raise TamperedModel(f"{model_name} v{version} has no {tag} tag: register it again")
            if _sha256(folder / name) != recorded:
                raise TamperedModel(f"{model_name} v{version}: {name} differs from what was registered")
        card = ModelCard.from_json((folder / META_FILE).read_text())
        state = load_state_dict(str(folder / WEIGHTS_FILE))
    model = build_model(card.arch, len(card.classes), features=card.features)
    model.load_state_dict(state)
    return LoadedModel(model.eval(), card, model_name, str(version), model_version.run_id)
