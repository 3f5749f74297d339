"""What readers read (app.data.selection): one pinned table snapshot, on a real SQLite catalog."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from app.data.selection import UnsafeDataFile, chw_images, hwc_bytes, read_rows, select
from app.data.table import ImageTable

from tables import TOPIC, batch


def test_a_pinned_read_keeps_its_rows_files_and_lineage_after_later_commits(tmp_path):
    table = ImageTable.at(str(tmp_path))
    first_id = table.commit(batch(0, range(0, 6)), {0: (0, 6)}, 0, TOPIC)
    first = select(table, image_size=8)
    table.commit(batch(0, range(6, 9)), {0: (6, 9)}, 0, TOPIC)

    again = select(table, image_size=8, snapshot_id=first_id)
    assert again == first and first.snapshot_id == first_id
    offsets = read_rows(again.files, ["kafka_offset"]).column("kafka_offset").to_pylist()
    assert sorted(offsets) == list(range(6))
    assert first.lineage() == {
        "table": "argus.behavior_images",
        "snapshot_id": str(first_id),
        "offsets": {"0": {"start": 0, "end": 6}},
    }
    # batch() leaves every third offset unlabelled: those are not counted as a class.
    assert first.label_counts == {"tap": 4} and first.classes(None) == ["tap"]
    assert first.classes(("tap", "swipe")) == ["tap", "swipe"]
    assert len(select(table, image_size=8).files) > len(first.files)


def test_a_table_without_rows_or_at_another_image_size_is_refused_with_what_to_do(tmp_path):
    table = ImageTable.at(str(tmp_path))
    with pytest.raises(ValueError, match="no commits yet: run `ingest` first"):
        select(table, image_size=8)
    table.commit(batch(0, [])[:0], {0: (0, 2)}, 2, TOPIC)  # two dead letters, no rows
    with pytest.raises(ValueError, match="holds no rows"):
        select(table, image_size=8)
    table.commit(batch(0, range(2, 4)), {0: (2, 4)}, 0, TOPIC)
    with pytest.raises(ValueError, match="--keep-source"):
        select(table, image_size=16)


def test_pixels_go_from_the_tables_row_major_bytes_to_the_models_channels_first_and_back():
    images = np.random.default_rng(0).integers(0, 256, (4, 3, 5, 7), dtype=np.uint8)
    stored = hwc_bytes(images)
    assert stored[0] == np.ascontiguousarray(images[0].transpose(1, 2, 0)).tobytes()
    assert np.array_equal(chw_images(stored, 5, 7), images)


def test_a_data_file_that_declares_an_extension_type_is_refused_before_its_values_are_read(tmp_path):
    import ray.data  # noqa: F401  (registers Ray's types, as in every reader that uses Ray Data)

    table = ImageTable.at(str(tmp_path))
    table.commit(batch(0, range(3)), {0: (0, 3)}, 0, TOPIC)
    uri = select(table, image_size=8).files[0]  # batch() spans two event dates: two files
    path = uri.removeprefix("file://")
    rows = pq.read_table(path)
    # Ray's pickled-object type (binary storage) declared on `pixels`, as a hostile writer of the
    # storage could: Ray Data would unpickle every value it reads.
    declared = {b"ARROW:extension:name": b"ray.data.arrow_pickled_object", b"ARROW:extension:metadata": b""}
    index = rows.schema.get_field_index("pixels")
    pq.write_table(rows.cast(rows.schema.set(index, rows.schema.field(index).with_metadata(declared))), path)
    with pytest.raises(UnsafeDataFile, match="column 'pixels' declares an Arrow extension type"):
        select(table, image_size=8)
