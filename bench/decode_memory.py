"""Peak memory of one preprocessing actor's batch (issue #26): decompression bombs and ordinary
screenshots, Argus's `Preprocessor` (each image reduced right after decoding, resized whenever the
decoded pixels held reach `PIXEL_BUDGET`) vs the plain way it worked before (decode the whole batch
at full resolution, then resize).

    .venv/bin/python bench/decode_memory.py          # ~1 minute on 2 cores; bench/ingest.py runs it too

Each measurement runs in a fresh child process: its peak RSS (ru_maxrss) minus its RSS once the
batch's encoded bytes are built, so only what decoding adds counts.
  bombs: 4000 x 4000 single-colour PNGs (~50 KB each, 48 MB decoded: under the 16.7 Mpx cap),
         plus one 6300 x 6300 PNG (119 MB decoded) in every 8, which the cap refuses undecoded;
  screenshots: 1080 x 2400 PNGs (7.8 MB decoded each).
Goal: ≤ 2 GB per actor at any batch size; the plain way runs only at the smallest batch (at 256
bombs it would need ~12 GB).
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import subprocess
import sys

import _common as common
from _common import ROOT, goal_line, print_table

GOAL_MB = 2048
IMAGE_SIZE = 224


def _png(width: int, height: int, screenshot: bool) -> bytes:
    import numpy as np
    from PIL import Image

    if screenshot:  # bands of "UI" with noise, so the PNG is not trivially small
        rng = np.random.default_rng(0)
        pixels = np.full((height, width, 3), 240, dtype=np.uint8)
        for top in range(0, height, 120):
            pixels[top : top + 60] = rng.integers(0, 255, (60, width, 3), dtype=np.uint8) // 4 + 100
        image = Image.fromarray(pixels)
    else:
        image = Image.new("RGB", (width, height), (20, 120, 200))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _values(kind: str, batch: int) -> list[bytes]:
    if kind == "bombs":
        bomb, huge = _png(4000, 4000, False), _png(6300, 6300, False)
        return [huge if i % 8 == 7 else bomb for i in range(batch)]
    screenshot = _png(1080, 2400, True)
    return [screenshot] * batch


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def child(kind: str, batch: int, approach: str) -> dict:
    """In a fresh process: decode and resize one batch; the memory that added, in MB."""
    import numpy as np

    from app.data.kafka import RAW_SCHEMA
    from app.data.preprocess import Preprocessor
    from app.transform import resize_pixels

    values = _values(kind, batch)
    import torch  # noqa: F401  (imported before the baseline RSS: both approaches need it)

    before = _rss_mb()
    if approach == "argus":
        columns = {name: np.array([None] * batch, dtype=object) for name in RAW_SCHEMA.names}
        columns.update(
            offset=np.arange(batch),
            value=np.array(values, dtype=object),
            label=np.array(["normal"] * batch, dtype=object),
            gap_end=np.array([None] * batch, dtype=object),
        )
        out = Preprocessor(IMAGE_SIZE, ["normal"], 10**9)(columns)
        good = int(sum(reason is None for reason in out["reason"]))
    else:  # decode everything at full size (no cap), then resize: what a batch held before
        from PIL import Image

        Image.MAX_IMAGE_PIXELS = None
        decoded = [np.array(Image.open(io.BytesIO(value)).convert("RGB")) for value in values]
        resize_pixels(decoded, IMAGE_SIZE)
        good = len(decoded)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"added_MB": peak - before, "decoded": good}


def measure(kind: str, batch: int, approach: str) -> dict:
    result = subprocess.run(
        [sys.executable, __file__, "--child", kind, str(batch), approach],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def run(batches: tuple[int, ...] = (64, 256)) -> tuple[list[tuple], list[str]]:
    """The table's rows and the goal lines, for `bench/ingest.py` too."""
    rows, goals = [], []
    for kind in ("bombs", "screenshots"):
        worst = 0.0
        for batch in batches:
            argus = measure(kind, batch, "argus")
            worst = max(worst, argus["added_MB"])
            row = [kind, batch, "Argus", argus["added_MB"], argus["decoded"]]
            rows.append(row)
            if batch == batches[0]:
                plain = measure(kind, batch, "plain")
                rows.append([kind, batch, "plain: full-size decode", plain["added_MB"], plain["decoded"]])
                ratio = plain["added_MB"] / argus["added_MB"]
                goals.append(f"{kind}, batch {batch}: plain / Argus peak memory {ratio:.1f}× (info)")
        goals.append(
            goal_line(
                f"{kind}: Argus's worst peak per actor / {GOAL_MB} MB",
                worst / GOAL_MB,
                1.0,
                higher_is_better=False,
                note=f"({worst:.0f} MB)",
            )
        )
    return rows, goals


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--child", nargs=3, metavar=("KIND", "BATCH", "APPROACH"), help=argparse.SUPPRESS)
    parser.add_argument("--batches", default="64,256", help="batch sizes (the plain way runs the first only)")
    args = parser.parse_args()
    if args.child:
        kind, batch, approach = args.child
        print(json.dumps(child(kind, int(batch), approach)))
        return 0
    print(f"bench/decode_memory.py · {common.machine_line()}")
    rows, goals = run(tuple(int(b) for b in args.batches.split(",")))
    print_table("peak memory one batch adds", ["images", "batch", "how", "peak added MB", "decoded"], rows)
    for line in goals:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
