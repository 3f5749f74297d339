"""Storage primitives over local disk, S3 and any pyarrow filesystem, for commits without renames.

Object stores cannot rename a directory, and an object store's only atomic step is putting one
object. So a commit is one object written last and never overwritten (`write_new`): on local disk
a fully written, fsynced temporary file hard-linked into place (the link fails if the name exists);
on S3 a put with `If-None-Match: *`. Data files are written once under their final names and
fsynced locally before anything that publishes them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import uuid
from dataclasses import dataclass

import pyarrow.fs as pafs

log = logging.getLogger(__name__)


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem of a local path or URI (s3://, hdfs://, ...) and the path inside it.

    S3 endpoints, keys and region come from the environment as AWS tools read them
    (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_REGION`, ...)."""
    return pafs.FileSystem.from_uri(uri)


def is_local(fs: pafs.FileSystem) -> bool:
    return isinstance(fs, pafs.LocalFileSystem)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class FileDigest:
    size: int
    sha256: str


def write_file(fs: pafs.FileSystem, path: str, data: bytes) -> FileDigest:
    """Write `data` at `path`, replacing what is there in one step (a reader sees the old bytes or
    the new, never a mix), durable before this returns; returns its size and digest."""
    if is_local(fs):
        # A file rename: local disks have it, and nothing else depends on it.
        os.replace(_durable_temp(path, data), path)
        _fsync_dir(os.path.dirname(path))
    else:  # one put; no directories to create (pyarrow's create_dir would write marker objects)
        with fs.open_output_stream(path) as stream:
            stream.write(data)
    return FileDigest(len(data), sha256(data))


def write_new(uri: str, data: bytes) -> bool:
    """Create the object at `uri` with `data` only if nothing is there: True if this call created
    it, False if it existed. Readers never see a partial object."""
    fs, path = filesystem(uri)
    if is_local(fs):
        return _write_new_local(path, data)
    if isinstance(fs, pafs.S3FileSystem):
        return _write_new_s3(uri, data)
    # Other filesystems (HDFS, GCS through pyarrow) get no conditional create here: check, then
    # write. Safe while one writer holds the ingest lease, which is how Argus writes.
    if fs.get_file_info(path).type != pafs.FileType.NotFound:
        return False
    with fs.open_output_stream(path) as stream:
        stream.write(data)
    return True


def _durable_temp(path: str, data: bytes) -> str:
    """`data` fsynced into a temporary file beside `path` (same filesystem); returns its path."""
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return tmp


def _write_new_local(path: str, data: bytes) -> bool:
    tmp = _durable_temp(path, data)
    try:
        os.link(tmp, path)  # atomic, and fails if `path` exists: create-if-absent with full content
        created = True
    except FileExistsError:
        created = False
    finally:
        os.unlink(tmp)
    _fsync_dir(os.path.dirname(path))
    return created


def _write_new_s3(uri: str, data: bytes) -> bool:
    from botocore.exceptions import ClientError

    bucket, _, key = uri.removeprefix("s3://").partition("/")
    try:
        s3_client().put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
        return True
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict"):
            return False
        raise


def s3_client():
    """boto3's S3 client, configured from the environment as pyarrow's S3 filesystem is."""
    import boto3

    return boto3.client("s3")


def read_file(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as stream:
        return stream.read()


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def _fsync_dir(path: str) -> None:
    """Make a directory entry (a new file, a link) durable, not just the file's bytes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
