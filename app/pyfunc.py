"""A registered version as an MLflow pyfunc model (CONTRACT.md §5), saved as code ("models from
code"): MLflow runs this file to load the model, so nothing is unpickled; the weights are
safetensors and the card is checked as serving checks it.

    model = mlflow.pyfunc.load_model("models:/argus-behavior/3")
    model.predict(pd.DataFrame({"image": [png_bytes, jpeg_bytes]}))   # columns label, score

Each row is answered as `POST /predict` answers that image: the same decode, transform and
forward pass (`app.inference.infer`).
"""

from __future__ import annotations

from pathlib import Path

import mlflow
import pandas as pd
from mlflow.pyfunc import PythonModel


class ArgusClassifier(PythonModel):
    def load_context(self, context) -> None:
        from app import registry
        from app.model import build_model, load_state_dict

        card = registry.ModelCard.from_json(Path(context.artifacts[registry.CARD_ARTIFACT]).read_text())
        model = build_model(card.arch, len(card.classes), features=card.features)
        model.load_state_dict(load_state_dict(context.artifacts[registry.WEIGHTS_ARTIFACT]))
        config = context.model_config or {}
        self.loaded = registry.LoadedModel(
            model.eval(), card, config.get("name", ""), config.get("version", ""), config.get("run_id", "")
        )

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        """A DataFrame with an `image` column of encoded bytes → one row per image: the label and
        its probability. An undecodable image fails the call, naming its row."""
        from app.inference import infer
        from app.registry import IMAGE_COLUMN
        from app.transform import BadImage, decode_pixels

        pixels = []
        for row, value in enumerate(model_input[IMAGE_COLUMN]):
            try:
                pixels.append(decode_pixels(bytes(value), self.loaded.card.image_size))
            except BadImage as exc:
                raise ValueError(f"row {row}: {exc}") from None
        answers = [answer for answer, _ in infer([(p, self.loaded) for p in pixels])]
        return pd.DataFrame(
            {
                "label": [a["label"] for a in answers],
                "score": [a["scores"][a["label"]] for a in answers],
            }
        )


mlflow.models.set_model(ArgusClassifier())
