"""The one transform (app.transform): decode, resize, normalise, exactly as training and serving see it."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from app.transform import BadImage, decode_image, decode_pixels, normalize, preprocess, resize_uint8


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


def _encoded(fmt: str, mode: str = "RGB", size: tuple[int, int] = (8, 8)) -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, 90).save(out, format=fmt)
    return out.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_with_chunk_after_idat(kind: bytes, data: bytes) -> bytes:
    png = _encoded("PNG")
    iend = png.rindex(b"IEND") - 4  # the IEND chunk's length field
    return png[:iend] + _png_chunk(kind, data) + png[iend:]


@pytest.mark.parametrize(
    "fmt, mode", [("JPEG", "RGB"), ("JPEG", "L"), ("PNG", "RGBA"), ("PNG", "P"), ("WEBP", "RGB")]
)
def test_the_declared_formats_decode_to_rgb(fmt, mode):
    pixels = decode_pixels(_encoded(fmt, mode))
    assert pixels.shape == (8, 8, 3) and pixels.dtype == np.uint8


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "TIFF", "ICO", "PPM", "TGA"])
def test_other_formats_are_bad_images_though_pillow_reads_them(fmt):
    value = _encoded(fmt)
    assert Image.open(io.BytesIO(value)).format == fmt  # Pillow alone would decode it
    with pytest.raises(BadImage, match="not a JPEG, PNG or WebP image"):
        decode_image(value)


# What Pillow 13 raises for each value, checked here so a Pillow upgrade that changes it shows.
MALFORMED = {
    # an empty iCCP chunk after the image data: PngStream.chunk_iCCP indexes past its end on load()
    "png, empty iCCP after IDAT": (_png_with_chunk_after_idat(b"iCCP", b""), IndexError),
    "png, iCCP without compression method": (_png_with_chunk_after_idat(b"iCCP", b"name\x00"), IndexError),
    "png, truncated gAMA after IDAT": (_png_with_chunk_after_idat(b"gAMA", b"\x00"), ValueError),
    "png, truncated tRNS after IDAT": (_png_with_chunk_after_idat(b"tRNS", b"\x00"), ValueError),
    "png, truncated": (_encoded("PNG")[:50], OSError),
    "webp, truncated": (_encoded("WEBP")[:30], OSError),
    "jpeg, truncated": (_encoded("JPEG")[:200], OSError),
    "jpeg, broken SOF": (_encoded("JPEG").replace(b"\xff\xc0", b"\xff\xc0\x00\x02", 1), OSError),
    "garbage": (b"\x89PNG not really", OSError),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_whatever_pillow_raises_on_malformed_bytes_is_a_bad_image(name):
    value, raised = MALFORMED[name]
    with pytest.raises(raised) as pillow:
        image = Image.open(io.BytesIO(value), formats=["JPEG", "PNG", "WEBP"])
        image.load()
        image.convert("RGB")
    with pytest.raises(BadImage, match="^undecodable image: ") as bad:
        decode_image(value)
    if not isinstance(pillow.value, OSError):
        assert str(bad.value).startswith(f"undecodable image: {type(pillow.value).__name__}: ")


@pytest.mark.parametrize(
    "exc",
    [EOFError("no more frames"), struct.error("unpack"), KeyError("mode"), MemoryError(), TypeError("x")],
)
def test_any_exception_from_the_decoder_is_a_bad_image(monkeypatch, exc):
    """Pillow documents none of these, but each has come out of some plugin's decoder."""

    value = _encoded("PNG")

    def broken(*args, **kwargs):
        raise exc

    monkeypatch.setattr(ImageFile.ImageFile, "load", broken)
    words = "out of memory" if isinstance(exc, MemoryError) else type(exc).__name__
    with pytest.raises(BadImage, match=f"^undecodable image: {words}") as bad:
        decode_pixels(value)
    assert bad.value.reason == ("out_of_memory" if isinstance(exc, MemoryError) else "undecodable_image")


def test_empty_and_oversized_values_are_bad_images():
    with pytest.raises(BadImage, match="empty image") as empty:
        decode_image(b"")
    assert empty.value.reason == "empty_value"
    with pytest.raises(BadImage, match="exceeds the 63 pixel limit") as large:
        decode_image(_encoded("PNG"), max_pixels=63)
    assert large.value.reason == "image_too_large"


def test_a_jpeg_over_the_pixel_limit_decodes_at_the_dct_scale_that_fits():
    value = _encoded("JPEG", size=(64, 48))
    assert decode_image(value, max_pixels=64 * 48).size == (64, 48)
    assert decode_image(value, max_pixels=32 * 24).size == (32, 24)  # 1/2
    assert decode_image(value, max_pixels=8 * 6).size == (8, 6)  # 1/8
    with pytest.raises(BadImage, match="exceeds the 47 pixel limit"):
        decode_image(value, max_pixels=47)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_a_large_image_is_reduced_right_after_decoding_to_two_to_four_times_the_size(fmt):
    """What a batch holds of a 1080x2400 screenshot is ~2-4x the target side, not 7.8 MB."""
    value = _encoded(fmt, size=(1080, 2400))
    width, height = decode_image(value, size=32).size
    assert 64 <= width < 128 and 64 <= height < 128, (width, height)
    assert decode_image(_encoded(fmt, size=(100, 70)), size=32).size == (100, 70)  # under 4x: as is


def test_reducing_first_changes_the_resized_pixels_by_little():
    """Box-reducing to 2-4x before the antialiased resize is close to resizing from full size."""
    ramp = np.linspace(0, 255, 1200, dtype=np.float32)
    pixels = np.stack(
        [np.add.outer(ramp[:900] * 0.5, ramp * 0.5), np.tile(ramp, (900, 1)), np.zeros((900, 1200))], -1
    )
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, format="PNG")
    reduced = preprocess([out.getvalue()], 32)
    direct = normalize([np.array(Image.open(io.BytesIO(out.getvalue())).convert("RGB"))], 32)
    assert (reduced - direct).abs().max() < 0.05  # in normalised units: under ~3 of 255 levels


def _pixels(n: int = 4, size: int = 32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=generator)


def test_normalize_pixels_is_the_normalize_of_the_transform():
    from app.transform import normalize, normalize_pixels, resize_pixels

    images = [np.random.default_rng(i).integers(0, 256, (40, 30, 3), dtype=np.uint8) for i in range(3)]
    pixels = resize_pixels(images, 16)
    assert pixels.dtype == torch.uint8 and pixels.shape == (3, 3, 16, 16)
    assert torch.equal(normalize_pixels(pixels), normalize(images, 16))
    assert torch.allclose(normalize_pixels(pixels.float()), normalize_pixels(pixels))


def test_augment_none_and_a_zero_range_warp_keep_the_pixels():
    from app.transform import Augmentation, augment

    pixels = _pixels()
    assert torch.equal(augment(pixels, "none", torch.Generator()), pixels.float())
    still = Augmentation(
        zoom=(1, 1), shift=0, rotate_deg=0, flip=False, brightness=0, contrast=0, saturation=0
    )
    assert torch.allclose(augment(pixels, still, torch.Generator()), pixels.float(), atol=1e-3)


def test_light_augmentation_never_mirrors_and_draws_per_image():
    from app.transform import augment

    # A bright left half, as a window's title bar or text margin: mirroring would move it right.
    pixels = torch.zeros(64, 3, 32, 32, dtype=torch.uint8)
    pixels[..., :16] = 200
    out = augment(pixels, "light", torch.Generator().manual_seed(1))
    assert (out[..., :12].mean((1, 2, 3)) > out[..., 20:].mean((1, 2, 3)) + 100).all()
    assert len({round(v, 3) for v in out.mean((1, 2, 3)).tolist()}) > 32  # each image its own draw
    again = augment(pixels, "light", torch.Generator().manual_seed(1))
    assert torch.equal(out, again)  # reproducible from the generator
    strong = augment(pixels, "strong", torch.Generator().manual_seed(1))
    flipped = strong[..., :12].mean((1, 2, 3)) < strong[..., 20:].mean((1, 2, 3))
    assert 10 < int(flipped.sum()) < 54  # strong flips about half
    assert out.min() >= 0 and out.max() <= 255 and out.dtype == torch.float32
