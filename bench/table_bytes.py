"""Bytes per record the Iceberg table keeps of an image (issue #25; #15 item 1 before it): the
table's `pixels` column (uint8 HWC bytes, one binary value a row) against the layouts before it,
uint8 pixels as Ray's tensor-extension column (the snapshot folders) and ImageNet-normalised
float32 (before those).

    .venv/bin/python bench/table_bytes.py                 # 224 px, 256 synthetic screenshots

Every layout is cut from the same decoded images with the shared transform. The table's rows are
committed through `ImageTable.commit` (PyIceberg's Parquet writer and its default compression)
into a scratch table, once as `ingest` writes them and once with `--keep-source`'s encoded image;
the baselines are written by pyarrow with its defaults, as the old sink wrote snapshot folders.
On disk: Parquet bytes / record of the image column (and of whole rows); in memory: the column's
Arrow buffer bytes / record as a reader gets it (`app.data.selection.read_rows`), which is what
Ray Data moves through the object store into the training workers. No Ray cluster, no broker.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import _common as common
from _common import print_table


def tensor_column_bytes(images, name: str) -> tuple[float, float]:
    """(Parquet bytes, Arrow bytes) per record of one tensor column, as snapshot folders held it."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from ray.data._internal.tensor_extensions.arrow import ArrowTensorArray

    table = pa.table({name: ArrowTensorArray.from_numpy(images)})
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    n = len(images)
    return buffer.getvalue().size / n, table.nbytes / n


def table_bytes(root: Path, images, sources: list[bytes] | None) -> dict[str, float]:
    """Bytes per record of one commit of `images` (uint8 [N, 3, S, S]) to a scratch table under
    `root` (with each encoded image in `source` when given): `pixels` on disk and in memory, and
    whole rows on disk."""
    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    from app.data.selection import hwc_bytes, read_rows
    from app.data.table import ImageTable

    n, size = len(images), images.shape[-1]
    columns = {
        "kafka_partition": pa.array([0] * n, pa.int32()),
        "kafka_offset": pa.array(range(n), pa.int64()),
        "user_id": [f"user-{i % 50}" for i in range(n)],
        "label": ["normal"] * n,
        "event_time_ms": pa.array([1_700_000_000_000 + i for i in range(n)], pa.int64()),
        "device_id": [f"device-{i % 50}" for i in range(n)],
        "pixels": pa.array(hwc_bytes(images), pa.binary()),
        "height": pa.array([size] * n, pa.int32()),
        "width": pa.array([size] * n, pa.int32()),
    }
    if sources is not None:
        columns["source"] = pa.array(sources, pa.binary())
    table = ImageTable.at(str(root), source=sources is not None)
    snapshot_id = table.commit(pa.table(columns), {0: (0, n)}, dlq_records=0, topic="bench")
    files = table.data_file_uris(snapshot_id)
    on_disk = pixels_on_disk = 0
    for uri in files:
        filesystem, path = pafs.FileSystem.from_uri(uri)
        on_disk += filesystem.get_file_info(path).size
        metadata = pq.ParquetFile(filesystem.open_input_file(path)).metadata
        for group in range(metadata.num_row_groups):
            for i in range(metadata.num_columns):
                column = metadata.row_group(group).column(i)
                if column.path_in_schema == "pixels":
                    pixels_on_disk += column.total_compressed_size
    in_memory = read_rows(files, ["pixels"]).column("pixels").nbytes
    return {"pixels_disk": pixels_on_disk / n, "pixels_memory": in_memory / n, "row_disk": on_disk / n}


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
    floats = normalize_pixels(pixels)  # what ingest stored before #15: the model input itself

    floats_disk, floats_memory = tensor_column_bytes(floats.numpy(), "image")
    tensor_disk, tensor_memory = tensor_column_bytes(pixels.numpy(), "image")
    with common.scratch_dir("argus-bench-table-") as scratch:
        table = table_bytes(scratch / "plain", pixels.numpy(), None)
        kept = table_bytes(scratch / "source", pixels.numpy(), values)
    source = sum(len(v) for v in values) / len(values)
    print_table(
        f"image bytes per record at {args.image_size} px ({args.records} synthetic screenshots)",
        ["layout", "Parquet bytes/record", "in memory bytes/record"],
        [
            ["float32, ImageNet-normalised tensor column (before #15)", floats_disk, floats_memory],
            ["uint8 tensor column (snapshot folders, before #25)", tensor_disk, tensor_memory],
            ["table: `pixels`, uint8 HWC binary (now)", table["pixels_disk"], table["pixels_memory"]],
            ["table: whole rows", table["row_disk"], "-"],
            [f"table: whole rows, --keep-source (PNG at {args.source_image_size} px)", kept["row_disk"], "-"],
            ["  of which the encoded image itself", source, source],
        ],
    )
    print(
        f"table pixels vs the snapshot folders' uint8 column: {table['pixels_disk'] / tensor_disk:.2f}× the "
        f"bytes on disk, {table['pixels_memory'] / tensor_memory:.2f}× in memory; vs float32: "
        f"{floats_disk / table['pixels_disk']:.2f}× fewer on disk, "
        f"{floats_memory / table['pixels_memory']:.2f}× fewer in memory"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
