"""The one transform, shared by ingest, training, federated clients and serving (no Ray here).

    encoded JPEG/PNG/WebP bytes → decode_pixels → uint8 HWC → normalize → float32 [N, 3, size, size]

Decoding needs only Pillow and numpy; torch is imported where tensors start, so an ingest actor
decodes its first batch while torch is still importing.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, UnidentifiedImageError

from app.config import IMAGENET_MEAN, IMAGENET_STD

if TYPE_CHECKING:
    import torch

MAX_IMAGE_PIXELS = 40_000_000
"""Decompression-bomb guard: larger declared images are rejected before decoding."""
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP")
"""The formats CONTRACT.md §1 declares: Pillow tries only these (not its ~45 others) to open a value."""


class BadImage(ValueError):
    """The bytes are not a decodable image (or are a decompression bomb)."""


def decode_image(value: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """Decode JPEG/PNG/WebP bytes to RGB, checking the declared size before decoding pixels.

    Raises BadImage, and only BadImage, for any bytes: other formats, and whatever Pillow raises on
    malformed data (besides OSError: ValueError, SyntaxError, IndexError, struct.error, EOFError,
    KeyError, MemoryError, DecompressionBombError…), so one value never fails a batch or a request.
    """
    if not value:
        raise BadImage("empty image")
    try:
        image = Image.open(io.BytesIO(value), formats=IMAGE_FORMATS)
        width, height = image.size
        if width * height > max_pixels:
            raise BadImage(f"image of {width}x{height} pixels exceeds the {max_pixels} pixel limit")
        image.load()
        return image.convert("RGB")
    except BadImage:
        raise
    except UnidentifiedImageError as exc:
        raise BadImage("undecodable image: not a JPEG, PNG or WebP image") from exc
    except Exception as exc:
        raise BadImage(f"undecodable image: {type(exc).__name__}: {exc}") from exc


def normalize(images: Sequence[np.ndarray], size: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """uint8 HWC pixels → float32 [N, 3, size, size]: resize (bilinear, antialiased), ImageNet-normalise.

    Resizes while the pixels are still uint8 (torch's vectorised integer path, several times faster
    than resizing float copies) and normalises the whole batch in one op. Runs where the tensors
    are sent, so GPU actors do the resize and normalisation on the GPU.
    """
    import torch

    resized = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=device)
    for i, image in enumerate(images):
        resized[i] = resize_uint8(
            torch.from_numpy(image).to(device, non_blocking=True).permute(2, 0, 1), size
        )
    mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1) * 255
    return resized.float().sub_(mean).div_(std)


def resize_uint8(image: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 [3, H, W] → uint8 [3, size, size], bilinear with antialiasing: what torchvision's
    `resize` computes, with torch alone (importing torchvision costs each worker ~3 s). On CPU torch
    resizes uint8 natively (vectorised); elsewhere it resizes a float copy and rounds back."""
    import torch
    import torch.nn.functional as F

    if image.shape[-2:] == (size, size):
        return image
    batch = image.unsqueeze(0)
    if image.device.type == "cpu":
        return F.interpolate(batch, size=[size, size], mode="bilinear", align_corners=False, antialias=True)[
            0
        ]
    resized = F.interpolate(
        batch.float(), size=[size, size], mode="bilinear", align_corners=False, antialias=True
    )
    return resized.round_().to(torch.uint8)[0]


def preprocess(values: Sequence[bytes], size: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """The one transform: encoded image bytes → normalised [N, 3, size, size] (raises BadImage)."""
    return normalize([decode_pixels(v) for v in values], size, device)


def decode_pixels(value: bytes) -> np.ndarray:
    """Encoded bytes → uint8 HWC pixels: the decode half of the transform (raises BadImage).

    numpy, not torch, so decoding never waits for torch's import (see `Preprocessor`). np.array
    makes the one writable copy torch.from_numpy needs; asarray(...).copy() is 4x slower."""
    return np.array(decode_image(value))


def image_statistics(tensor: torch.Tensor) -> dict[str, float]:
    """Per-channel mean and standard deviation of one transformed image [3, H, W]: the features
    drift detection compares between training snapshots and served traffic."""
    means, stds = tensor.mean((1, 2)).tolist(), tensor.std((1, 2)).tolist()
    return {**{f"mean_{c}": m for c, m in zip("rgb", means)}, **{f"std_{c}": s for c, s in zip("rgb", stds)}}


def encode_labels(labels: Iterable[str], classes: Sequence[str]) -> np.ndarray:
    """Label names → class indices in `classes`; an unknown label raises KeyError."""
    index = {name: i for i, name in enumerate(classes)}
    return np.array([index[label] for label in labels], dtype=np.int64)


def augment(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random resized crop, horizontal flip and brightness/contrast jitter, on normalised batches."""
    import torch
    import torchvision.transforms.v2.functional as F

    n, _, h, w = images.shape
    out = torch.empty_like(images)
    scales = torch.empty(n).uniform_(0.6, 1.0, generator=generator)
    for i in range(n):
        ch, cw = max(1, int(h * scales[i].sqrt())), max(1, int(w * scales[i].sqrt()))
        top = int(torch.randint(0, h - ch + 1, (1,), generator=generator))
        left = int(torch.randint(0, w - cw + 1, (1,), generator=generator))
        out[i] = F.resized_crop(images[i], top, left, ch, cw, [h, w], antialias=True)
    flip = torch.rand(n, generator=generator) < 0.5
    out[flip] = out[flip].flip(-1)
    contrast = torch.empty(n, 1, 1, 1).uniform_(0.8, 1.2, generator=generator)
    brightness = torch.empty(n, 1, 1, 1).uniform_(-0.2, 0.2, generator=generator)
    return out * contrast.to(out.device) + brightness.to(out.device)
