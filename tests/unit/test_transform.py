"""The one transform (app.transform): decode, resize, normalise, exactly as training and serving see it."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from app.transform import preprocess, resize_uint8


def test_preprocess_normalises_with_imagenet_statistics():
    white = io.BytesIO()
    Image.new("RGB", (50, 30), (255, 255, 255)).save(white, format="PNG")
    tensor = preprocess([white.getvalue()], 16)
    assert tensor.shape == (1, 3, 16, 16)
    expected = (1 - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
    assert np.allclose(tensor[0, :, 5, 5].numpy(), expected, atol=1e-5)


@pytest.mark.parametrize(
    "height, width, size",
    [(128, 128, 64), (37, 91, 64), (300, 17, 224), (64, 64, 224), (500, 400, 32), (224, 224, 224)],
)
def test_resize_is_torchvisions_antialiased_bilinear_bit_for_bit(height, width, size):
    """The transform resizes with torch alone (workers skip importing torchvision); the pixels are
    exactly what torchvision's resize gives, down- and upscaling, square or not."""
    import torchvision.transforms.v2.functional as F

    image = torch.randint(
        0, 256, (height, width, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(size)
    )
    chw = image.permute(2, 0, 1)
    assert torch.equal(resize_uint8(chw, size), F.resize(chw, [size, size], antialias=True))
