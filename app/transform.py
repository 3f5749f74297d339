"""The one transform, shared by ingest, training, federated clients and serving (no Ray here).

    encoded JPEG/PNG/WebP bytes → decode_pixels → uint8 HWC → resize_pixels → uint8 [N, 3, size, size]
        (what snapshots store) → augment (training) → normalize_pixels → float32 model input

Decoding needs only Pillow and numpy; torch is imported where tensors start, so an ingest actor
decodes its first batch while torch is still importing.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, UnidentifiedImageError

from app.config import IMAGENET_MEAN, IMAGENET_STD
from app.errors import Reason

if TYPE_CHECKING:
    import torch

MAX_IMAGE_PIXELS = 4096 * 4096
"""Decompression-bomb guard, the same in ingest, training and serving: an image declaring more
pixels is refused before any is decoded, except a JPEG, which decodes at the smallest DCT scale
(1/2, 1/4, 1/8) that fits. Decoded RGB is then at most 50 MB, whatever the bytes' size."""
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP")
"""The formats CONTRACT.md §1 declares: Pillow tries only these (not its ~45 others) to open a value."""
JPEG_SCALES = (1, 2, 4, 8)
"""The DCT scales libjpeg decodes at (PIL's draft mode)."""
MAX_ERROR_CHARS = 300
"""A decoder's message is quoted at most this long in a dead letter's `error` or an HTTP 400."""


class BadImage(ValueError):
    """The bytes are not a decodable image (or are a decompression bomb); `reason` says which."""

    def __init__(self, message: str, reason: Reason = Reason.UNDECODABLE_IMAGE):
        super().__init__(message)
        self.reason = reason


def decode_image(value: bytes, max_pixels: int = MAX_IMAGE_PIXELS, size: int | None = None) -> Image.Image:
    """Decode JPEG/PNG/WebP bytes to RGB, checking the declared size before decoding pixels.

    With `size` (the side the transform resizes to), the image comes back reduced right after
    decoding, each side to between 2x and 4x `size` (JPEGs decode at a DCT scale, the rest are
    box-reduced), so a caller holding many decoded images holds small ones; the transform's
    antialiased resize then finishes from there.

    Raises BadImage, and only BadImage, for any bytes: other formats, and whatever Pillow raises on
    malformed data (besides OSError: ValueError, SyntaxError, IndexError, struct.error, EOFError,
    KeyError, MemoryError, DecompressionBombError…), so one value never fails a batch or a request.
    """
    if not value:
        raise BadImage("empty image", Reason.EMPTY_VALUE)
    try:
        image = Image.open(io.BytesIO(value), formats=IMAGE_FORMATS)
        width, height = image.size
        scale = 1
        if width * height > max_pixels:
            fits = [s for s in JPEG_SCALES if -(-width // s) * -(-height // s) <= max_pixels]
            if image.format != "JPEG" or not fits:
                raise BadImage(
                    f"image of {width}x{height} pixels exceeds the {max_pixels} pixel limit",
                    Reason.IMAGE_TOO_LARGE,
                )
            scale = fits[0]
        if image.format == "JPEG":
            if size:  # the largest scale that keeps both sides at 2x size or more, if larger
                scale = max([scale, *(s for s in JPEG_SCALES if min(width, height) // s >= 2 * size)])
            if scale > 1:
                image.draft("RGB", (width // scale, height // scale))
        image.load()
        image = image.convert("RGB")
        if size:
            factor = (max(1, image.width // (2 * size)), max(1, image.height // (2 * size)))
            if factor != (1, 1):
                image = image.reduce(factor)
        return image
    except BadImage:
        raise
    except UnidentifiedImageError as exc:
        raise BadImage("undecodable image: not a JPEG, PNG or WebP image") from exc
    except MemoryError as exc:
        raise BadImage("undecodable image: out of memory while decoding", Reason.OUT_OF_MEMORY) from exc
    except Exception as exc:
        raise BadImage(f"undecodable image: {type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]) from exc


def resize_pixels(
    images: Sequence[np.ndarray], size: int, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """uint8 HWC pixels → uint8 [N, 3, size, size] (bilinear, antialiased): what snapshots store.

    Resizes while the pixels are still uint8 (torch's vectorised integer path, several times faster
    than resizing float copies). Runs where the tensors are sent, so GPU actors resize on the GPU.
    """
    import torch

    resized = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=device)
    for i, image in enumerate(images):
        resized[i] = resize_uint8(
            torch.from_numpy(image).to(device, non_blocking=True).permute(2, 0, 1), size
        )
    return resized


def normalize_pixels(pixels: torch.Tensor) -> torch.Tensor:
    """Pixel values [N, 3, H, W] (uint8, or floats on the 0–255 scale) → ImageNet-normalised float32,
    in one op on the tensor's device: the training step and serving both end with it."""
    import torch

    mean = torch.tensor(IMAGENET_MEAN, device=pixels.device).view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD, device=pixels.device).view(1, 3, 1, 1) * 255
    return pixels.float().sub_(mean).div_(std) if pixels.dtype == torch.uint8 else (pixels - mean) / std


def normalize(images: Sequence[np.ndarray], size: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """uint8 HWC pixels → float32 [N, 3, size, size]: `resize_pixels`, then `normalize_pixels`."""
    return normalize_pixels(resize_pixels(images, size, device))


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
    return normalize([decode_pixels(v, size) for v in values], size, device)


def decode_pixels(value: bytes, size: int | None = None) -> np.ndarray:
    """Encoded bytes → uint8 HWC pixels: the decode half of the transform (raises BadImage); with
    `size`, reduced to 2x–4x that size right after decoding (see `decode_image`).

    numpy, not torch, so decoding never waits for torch's import (see `Preprocessor`). np.array
    makes the one writable copy torch.from_numpy needs; asarray(...).copy() is 4x slower."""
    return np.array(decode_image(value, size=size))


def image_statistics(tensor: torch.Tensor) -> dict[str, float]:
    """Per-channel mean and standard deviation of one transformed image [3, H, W]: the features
    drift detection compares between training snapshots and served traffic."""
    means, stds = tensor.mean((1, 2)).tolist(), tensor.std((1, 2)).tolist()
    return {**{f"mean_{c}": m for c, m in zip("rgb", means)}, **{f"std_{c}": s for c, s in zip("rgb", stds)}}


def encode_labels(labels: Iterable[str], classes: Sequence[str]) -> np.ndarray:
    """Label names → class indices in `classes`; an unknown label raises KeyError."""
    index = {name: i for i, name in enumerate(classes)}
    return np.array([index[label] for label in labels], dtype=np.int64)


@dataclass(frozen=True)
class Augmentation:
    """Ranges of one augmentation mode; each image of a batch draws its own values."""

    zoom: tuple[float, float]
    """Scale factor of the content (>1 zooms in: 1/sqrt(0.6) crops to 60 % of the area)."""
    shift: float
    """Largest translation, as a fraction of the side."""
    rotate_deg: float
    flip: bool
    brightness: float
    contrast: float
    saturation: float


AUGMENTATIONS = {
    "none": None,
    # Screenshots: text and window layouts are not mirror-symmetric and sit near the same place, so
    # no flips, small zoom and shift, and the colour shifts of different themes and displays.
    "light": Augmentation(
        zoom=(0.92, 1.08),
        shift=0.04,
        rotate_deg=0,
        flip=False,
        brightness=0.15,
        contrast=0.15,
        saturation=0.1,
    ),
    # Natural-image style: crops down to 60 % of the area, flips, small rotations, strong jitter.
    "strong": Augmentation(
        zoom=(1.0, 1.29),
        shift=0.1,
        rotate_deg=10,
        flip=True,
        brightness=0.3,
        contrast=0.3,
        saturation=0.3,
    ),
}


AUGMENT_MODES = tuple(AUGMENTATIONS)


def augment(pixels: torch.Tensor, mode: str | Augmentation, generator: torch.Generator) -> torch.Tensor:
    """uint8 pixels [N, 3, H, W] → augmented pixel values (float32, 0–255) in pixel space, batched.

    One affine warp (`grid_sample`) and one colour jitter for the whole batch, each image with its
    own random parameters (drawn on the CPU from `generator`, so runs are reproducible), on the
    batch's device. `mode` names one of AUGMENTATIONS or gives the ranges; `none` returns the pixels
    as floats."""
    import math

    import torch
    import torch.nn.functional as F

    spec = AUGMENTATIONS[mode] if isinstance(mode, str) else mode
    images = pixels.float()
    if spec is None:
        return images
    n = len(images)

    def uniform(low: float, high: float) -> torch.Tensor:
        return torch.empty(n).uniform_(low, high, generator=generator)

    zoom = uniform(*spec.zoom)
    angle = uniform(-spec.rotate_deg, spec.rotate_deg) * (math.pi / 180)
    flip = torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0) if spec.flip else torch.ones(n)
    # affine_grid maps output coordinates to input ones: zooming in by z samples a 1/z-wide window.
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0] = angle.cos() / zoom * flip
    theta[:, 0, 1] = -angle.sin() / zoom
    theta[:, 1, 0] = angle.sin() / zoom * flip
    theta[:, 1, 1] = angle.cos() / zoom
    theta[:, :, 2] = torch.stack([uniform(-spec.shift, spec.shift), uniform(-spec.shift, spec.shift)], 1) * 2
    grid = F.affine_grid(theta.to(images.device), list(images.shape), align_corners=False)
    images = F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)

    def per_image(values: torch.Tensor) -> torch.Tensor:
        return values.view(n, 1, 1, 1).to(images.device)

    gray = (images * torch.tensor([0.299, 0.587, 0.114], device=images.device).view(1, 3, 1, 1)).sum(
        1, keepdim=True
    )
    images = gray + (images - gray) * per_image(uniform(1 - spec.saturation, 1 + spec.saturation))
    mean = gray.mean((2, 3), keepdim=True)
    images = mean + (images - mean) * per_image(uniform(1 - spec.contrast, 1 + spec.contrast))
    images = images * per_image(uniform(1 - spec.brightness, 1 + spec.brightness))
    return images.clamp_(0, 255)
