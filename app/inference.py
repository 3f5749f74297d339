"""What a serving replica and the pyfunc model (`app.pyfunc`) do with decoded images
(`app.transform.decode_pixels`, under its pixel cap and reduced toward the model's size as ingest
decodes): classify a batch with the training transform, one forward pass per model version in the
batch. Outside `app.serve`, so loading a pyfunc model needs neither Ray nor Serve."""

import numpy as np
import torch

from app import registry
from app.transform import normalize


def infer(items: list[tuple[np.ndarray, registry.LoadedModel]]) -> list[tuple[dict, torch.Tensor]]:
    """Resize, normalise and classify a batch of decoded images, one forward pass per model version
    present in the batch; returns each request's answer with its transformed image.

    Each request is answered by the version it was accepted under, at that version's image size.
    (A module function, not a method: Serve pickles the replica class by value, and torch's
    internals inside a method body do not pickle.)"""
    results: list[tuple[dict, torch.Tensor] | None] = [None] * len(items)
    by_version: dict[str, list[int]] = {}
    for i, (_, loaded) in enumerate(items):
        by_version.setdefault(loaded.version, []).append(i)
    for indices in by_version.values():
        loaded = items[indices[0]][1]
        device = next(loaded.model.parameters()).device
        inputs = normalize([items[i][0] for i in indices], loaded.card.image_size, device)
        with torch.inference_mode():
            probabilities = torch.softmax(loaded.model(inputs), dim=1)
        for i, tensor, row in zip(indices, inputs, probabilities.tolist()):
            best = max(range(len(row)), key=row.__getitem__)
            results[i] = (
                {
                    "label": loaded.card.classes[best],
                    "scores": dict(zip(loaded.card.classes, row)),
                    "model_version": loaded.version,
                },
                tensor,
            )
    return results
