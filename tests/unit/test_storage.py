"""Files under the checkpoint: written whole or not at all, and on a local (or NFS) checkpoint
on disk before the write returns: the journal entry of a batch that Spark then logs complete
must survive the machine losing power."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pyarrow.fs import LocalFileSystem

from oncekit.core.storage import list_names, write_atomically


def test_local_write_is_fsynced_file_then_folder_and_leaves_no_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    target = tmp_path / "oncekit" / "sink" / "journal" / "7.json"
    write_atomically(LocalFileSystem(), str(target), b'{"batch_id": 7}')
    assert target.read_bytes() == b'{"batch_id": 7}'
    assert len(synced) == 2 and synced[0].endswith(".tmp") and synced[1] == str(target.parent)
    assert list_names(LocalFileSystem(), str(target.parent)) == ["7.json"]


def test_an_s3_compatible_stores_endpoint_comes_from_the_aws_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from pyarrow.fs import S3FileSystem

    from oncekit.core.storage import filesystem

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://minio.local:9000")
    found, path = filesystem("s3a://bucket/checkpoints/q/")
    assert isinstance(found, S3FileSystem) and path == "bucket/checkpoints/q"
    settings = found.__reduce__()[1][0]  # what pyarrow was built with; it has no getters for them
    assert (settings["endpoint_override"], settings["scheme"]) == ("minio.local:9000", "http")


def test_a_remote_filesystem_is_made_once_per_location_and_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """The journal, the lease and Spark's logs open the checkpoint many times a batch; an HDFS
    client connects to its NameNode and an S3 one resolves credentials when made."""
    from oncekit.core.storage import filesystem

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://minio.local:9000")
    first, again = filesystem("s3a://bucket/cache-test"), filesystem("s3a://bucket/cache-test")
    assert first[0] is again[0] and first[1] == again[1] == "bucket/cache-test"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://other.local:9000")
    assert filesystem("s3a://bucket/cache-test")[0] is not first[0]
