"""Bytes per record of a snapshot's image column (issue #15 item 1): normalised float32, as
snapshots stored images before, against the uint8 pixels they store now.

    .venv/bin/python bench/snapshot_bytes.py                 # 224 px, 256 synthetic screenshots

Both columns are cut from the same decoded images with the shared transform and written as the
sink writes them (Ray's tensor extension column in Parquet, pyarrow's default compression). On
disk: Parquet bytes / record; in memory: the column's Arrow buffer bytes / record, which is what
Ray Data moves through the object store into the training workers each epoch. `--keep-source`
adds the encoded image (its bytes are printed too). No Ray cluster, no broker.
"""

from __future__ import annotations

import argparse
import sys

import _common as common
from _common import print_table


def column_bytes(images, name: str) -> tuple[float, float]:
    """(Parquet bytes, Arrow bytes) per record of one tensor column."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from ray.data._internal.tensor_extensions.arrow import ArrowTensorArray

    table = pa.table({name: ArrowTensorArray.from_numpy(images)})
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    n = len(images)
    return buffer.getvalue().size / n, table.nbytes / n


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--records", type=int, default=256)
    parser.add_argument("--source-image-size", type=int, default=256, help="side of the encoded screenshots")
    args = parser.parse_args()

    from app.transform import decode_pixels, normalize_pixels, resize_pixels

    print(common.machine_line())
    records = common.synthetic_pool(args.records, args.source_image_size, seed=3)
    values = [r.value for r in records]
    pixels = resize_pixels([decode_pixels(v) for v in values], args.image_size)
    floats = normalize_pixels(pixels)  # what ingest stored before: the model input itself

    rows = []
    before = column_bytes(floats.numpy(), "image")
    after = column_bytes(pixels.numpy(), "image")
    rows.append(["float32, ImageNet-normalised (before)", *before])
    rows.append(["uint8 pixels (now)", *after])
    source = sum(len(v) for v in values) / len(values)
    rows.append([f"+ --keep-source: encoded PNG at {args.source_image_size} px", source, source])
    print_table(
        f"image column bytes per record at {args.image_size} px ({args.records} synthetic screenshots)",
        ["column", "Parquet bytes/record", "in memory bytes/record"],
        rows,
    )
    print(
        f"uint8 vs float32: {before[0] / after[0]:.2f}× fewer bytes on disk, "
        f"{before[1] / after[1]:.2f}× fewer in memory"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
