"""Storage over local disk, S3 and any pyarrow filesystem: a `Store` handle, for commits without renames.

A `Store` is one location (a local directory or an object-store prefix) with its filesystem,
resolved once; whatever reads or writes under it takes the handle, not a URI to resolve again.

Object stores cannot rename a directory, and an object store's only atomic step is putting one
object. So a commit is one object written last and never overwritten (`Store.write_new`): on local
disk a fully written, fsynced temporary file hard-linked into place (the link fails if the name
exists); on S3 a put with `If-None-Match: *`. Data files are written once under their final names
and fsynced locally before anything that publishes them.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from dataclasses import dataclass

import pyarrow.fs as pafs


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class FileDigest:
    size: int
    sha256: str


class Store:
    """One storage location and its filesystem. Paths given to its methods are relative to it.

    Pickled as its URI: a Ray task or actor that receives one resolves the filesystem in its own
    process, from its own environment (S3 keys never travel in the pickle)."""

    def __init__(self, uri: str, fs: pafs.FileSystem, root: str):
        self._uri, self.fs, self.root = uri.rstrip("/"), fs, root.rstrip("/")

    @classmethod
    def at(cls, uri: str) -> Store:
        """The store at a local path or URI (s3://, hdfs://, ...), its pyarrow filesystem resolved
        now. S3 endpoints, keys and region come from the environment as AWS tools read them
        (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_REGION`, ...)."""
        fs, root = pafs.FileSystem.from_uri(uri)
        return cls(uri, fs, root)

    def __reduce__(self):
        return Store.at, (self._uri,)

    def __eq__(self, other) -> bool:
        return isinstance(other, Store) and other._uri == self._uri

    def __hash__(self) -> int:
        return hash(self._uri)

    def __repr__(self) -> str:
        return f"Store({self._uri!r})"

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def uri(self, *parts: str) -> str:
        """A URI (a local path, on local disk) under this store: for logs, headers and readers such
        as Ray Data that take URIs."""
        return "/".join([self._uri, *parts])

    def path(self, *parts: str) -> str:
        """A path under this store inside its filesystem."""
        return "/".join([self.root, *parts])

    def child(self, *parts: str) -> Store:
        """The store at a folder under this one, on the same filesystem object."""
        return Store(self.uri(*parts), self.fs, self.path(*parts))

    def read(self, relative: str) -> bytes:
        """The object's bytes; FileNotFoundError when there is none."""
        with self.fs.open_input_stream(self.path(relative)) as stream:
            return stream.read()

    def write(self, relative: str, data: bytes) -> FileDigest:
        """Write `data`, replacing what is there in one step (a reader sees the old bytes or the new,
        never a mix), durable before this returns; returns its size and digest."""
        path = self.path(relative)
        if self.is_local:
            # A file rename: local disks have it, and nothing else depends on it.
            os.replace(_durable_temp(path, data), path)
            _fsync_dir(os.path.dirname(path))
        else:  # one put; no directories to create (pyarrow's create_dir would write marker objects)
            with self.fs.open_output_stream(path) as stream:
                stream.write(data)
        return FileDigest(len(data), sha256(data))

    def write_new(self, relative: str, data: bytes) -> bool:
        """Create the object with `data` only if nothing is there: True if this call created it,
        False if it existed. Readers never see a partial object."""
        path = self.path(relative)
        if self.is_local:
            return _write_new_local(path, data)
        if isinstance(self.fs, pafs.S3FileSystem):
            return _write_new_s3(path, data)
        # Other filesystems (HDFS, GCS through pyarrow) get no conditional create here: check, then
        # write. Safe while one writer holds the ingest lease, which is how Argus writes.
        if self.exists(relative):
            return False
        with self.fs.open_output_stream(path) as stream:
            stream.write(data)
        return True

    def exists(self, relative: str = "") -> bool:
        info = self.fs.get_file_info(self.path(relative) if relative else self.root)
        return info.type != pafs.FileType.NotFound

    def list(self, relative: str = "", *, recursive: bool = False) -> list[pafs.FileInfo]:
        """What is under the folder (nothing when it does not exist); `FileInfo.path` is a
        filesystem path, `base_name` the entry's name."""
        folder = self.path(relative) if relative else self.root
        return self.fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True, recursive=recursive))

    def delete(self, relative: str) -> None:
        """Delete one object; FileNotFoundError when there is none."""
        self.fs.delete_file(self.path(relative))

    def delete_dir(self, relative: str = "") -> None:
        """Delete the folder and everything under it."""
        self.fs.delete_dir(self.path(relative) if relative else self.root)


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


def _write_new_s3(path: str, data: bytes) -> bool:
    from botocore.exceptions import ClientError

    bucket, _, key = path.partition("/")  # an S3FileSystem path is bucket/key
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


def _fsync_dir(path: str) -> None:
    """Make a directory entry (a new file, a link) durable, not just the file's bytes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
