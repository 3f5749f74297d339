"""What a replica does with an accepted image: decode it under a pixel cap, then classify a batch
with the training transform (`app/transform.py`), one forward pass per model version in the batch."""

import io
import math

import numpy as np
import torch
from PIL import Image

from app import registry
from app.transform import IMAGE_FORMATS, BadImage, decode_image, normalize

MAX_DECODE_PIXELS = 4096 * 4096
"""Far more than any model's input: larger images are refused (400), or, JPEG, decoded at 1/2..1/8."""


def decode_upload(value: bytes) -> np.ndarray:
    """Encoded bytes → uint8 HWC pixels, as `decode_pixels` but capped at MAX_DECODE_PIXELS: larger
    declared sizes are refused before any pixel is decoded (BadImage), except JPEGs, which decode
    at the smallest DCT scale (1/2, 1/4, 1/8) that fits (PIL's draft mode), never at full size."""
    try:
        image = Image.open(io.BytesIO(value), formats=IMAGE_FORMATS)
        width, height = image.size
    except Exception:
        image = None  # decode_image says why, in its own words
    if image is None or image.format != "JPEG" or width * height <= MAX_DECODE_PIXELS:
        return np.array(decode_image(value, max_pixels=MAX_DECODE_PIXELS))
    for scale in (2, 4, 8):
        if math.ceil(width / scale) * math.ceil(height / scale) <= MAX_DECODE_PIXELS:
            break
    else:
        raise BadImage(f"image of {width}x{height} pixels exceeds the {MAX_DECODE_PIXELS} pixel limit")
    try:
        image.draft("RGB", (width // scale, height // scale))
        image.load()
        return np.array(image.convert("RGB"))
    except Exception as exc:  # malformed data raises anything (see decode_image)
        raise BadImage(f"undecodable image: {type(exc).__name__}: {exc}") from exc


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
