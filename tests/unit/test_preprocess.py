"""Ingest's preprocessing UDF (`app.data.preprocess.Preprocessor`) on batches shaped like the Kafka
read's output: what it holds while decoding, and that every failure is a dead letter with a reason."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from app.data import preprocess
from app.data.kafka import RAW_SCHEMA
from app.data.preprocess import Preprocessor
from app.transform import decode_image

from conftest import ERASED_LETTER_HEADERS


def _png(width: int, height: int, colour=(30, 90, 200)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


def _declared_png(width: int, height: int) -> bytes:
    """A PNG header declaring width x height, with no pixel data: a bomb needs no more to be refused."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def _batch(values: list[bytes]) -> dict[str, np.ndarray]:
    n = len(values)
    rows = dict.fromkeys(RAW_SCHEMA.names)
    batch = {name: np.array([rows[name]] * n, dtype=object) for name in RAW_SCHEMA.names}
    batch.update(
        partition=np.zeros(n, dtype=np.int32),
        offset=np.arange(n),
        value=np.array(values, dtype=object),
        label=np.array(["normal"] * n, dtype=object),
        event_time=np.zeros(n, dtype=np.int64),
        late=np.zeros(n, dtype=bool),
        gap_end=np.array([None] * n, dtype=object),
    )
    return batch


def test_a_bomb_and_an_out_of_memory_decode_are_dead_letters_with_reasons(monkeypatch):
    real = preprocess.decode_pixels

    def runs_out_of_memory(value, size):
        if value == b"oom":
            raise MemoryError
        return real(value, size)

    monkeypatch.setattr(preprocess, "decode_pixels", runs_out_of_memory)
    values = [_png(40, 40), _declared_png(6300, 6300), b"oom", _png(1080, 2400), b"not an image"]
    out = Preprocessor(image_size=32, classes=["normal"], max_record_bytes=10_000_000)(_batch(values))
    assert list(out["reason"]) == [None, "image_too_large", "out_of_memory", None, "undecodable_image"]
    assert out["error"][1] == "image of 6300x6300 pixels exceeds the 16777216 pixel limit"
    assert out["image"].shape == (5, 3, 32, 32)
    assert (out["image"][0] == np.array([30, 90, 200], dtype=np.uint8)[:, None, None]).all()
    assert (out["image"][3] == np.array([30, 90, 200], dtype=np.uint8)[:, None, None]).all()
    assert not out["image"][[1, 2, 4]].any()  # dead letters keep a zero image
    assert list(out["value"][[0, 3]]) == [b"", b""] and out["value"][1] == values[1]  # their own bytes


@pytest.mark.parametrize("decode_threads", [1, 3])
def test_decoded_pixels_are_resized_whenever_they_reach_the_budget(monkeypatch, decode_threads):
    """However many 1080x2400 screenshots a batch has, an actor holds at most the budget of decoded
    pixels (each reduced right after decoding) before it resizes them, plus one image."""
    held: list[int] = []
    real_resize = preprocess.resize_pixels

    def counting_resize(images, size, device="cpu"):
        held.append(sum(image.shape[0] * image.shape[1] for image in images))
        return real_resize(images, size, device)

    monkeypatch.setattr(preprocess, "resize_pixels", counting_resize)
    monkeypatch.setattr(preprocess, "PIXEL_BUDGET", 40_000)
    screenshot = _png(1080, 2400)
    width, height = decode_image(screenshot, size=32).size  # each side 2x-4x of 32
    reduced = width * height
    batch = _batch([screenshot] * 12)
    out = Preprocessor(32, ["normal"], 10_000_000, decode_threads=decode_threads)(batch)
    assert list(out["reason"]) == [None] * 12 and out["image"].any(axis=(1, 2, 3)).all()
    assert sum(held) == 12 * reduced and len(held) > 1, held
    assert max(held) < preprocess.PIXEL_BUDGET + reduced, held


def test_an_erased_users_records_before_the_erasure_are_dead_letters_that_keep_nothing_of_them():
    from app.data.metadata import Erasures
    from app.data.records import user_digest
    from app.data.sink import SinkTarget, _dead_letter

    batch = _batch([_png(40, 40)] * 5)
    batch["key"] = np.array(["alice", "alice", "bob", "alice", "carol"], dtype=object)
    batch["device_id"] = np.array(["alices-phone"] * 5, dtype=object)
    batch["partition"] = np.array([0, 1, 0, 0, 0], dtype=np.int32)
    batch["offset"] = np.array([3, 3, 4, 5, 6])
    # alice erased when partition 0 ended at 5 (and partition 1 had nothing); carol with no ends known.
    erasures = Erasures({user_digest("alice"): {0: 5}, user_digest("carol"): None})
    out = Preprocessor(image_size=32, classes=["normal"], max_record_bytes=10**6, erasures=erasures)(batch)
    # Before the end: erased. Past it, or in a partition that had nothing then: alice's new data.
    assert list(out["reason"]) == ["erased", None, None, None, "erased"]
    assert list(out["value"][[0, 4]]) == [b"", b""] and not out["image"][[0, 4]].any()

    row = {name: out[name][0] for name in ("partition", "offset", "kafka_timestamp", "key", "value")}
    row.update({name: out[name][0] for name in ("label", "event_time", "device_id", "error", "reason")})
    target = SinkTarget(None, None, None, "behavior", "behavior.dlq", 1_000_000)
    key, value, headers = _dead_letter(row, target)
    assert (key, value) == (b"", b"")
    assert tuple(name for name, _ in headers) == ERASED_LETTER_HEADERS
    assert not any(b"alice" in v for _, v in headers)
