"""Files under a Spark checkpoint location, through pyarrow's filesystems.

The journal and the write-ahead log are read and written from Python processes that have no
SparkSession (Spark's driver-side Python workers, executors), so they cannot use Hadoop's
filesystem through the JVM. pyarrow reaches the same local, HDFS and S3 locations, with
credentials of its own (it reads no ``fs.s3a.*`` or ``core-site.xml``): S3 from the AWS
environment variables, ``~/.aws`` or the instance's role, and an S3-compatible store's endpoint
from ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``, which pyarrow itself ignores
(apache/arrow#49643); HDFS through libhdfs (``HADOOP_HOME``, ``CLASSPATH``, a Kerberos ticket).
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable

from pyarrow.fs import FileSelector, FileSystem, FileType, LocalFileSystem, S3FileSystem

ENDPOINT_ENVS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
"""Where an S3-compatible store (MinIO, Ceph) answers, as the AWS SDKs and CLI read it."""

_SCHEMES: dict[str, Callable[[str], tuple[FileSystem, str]]] = {}


def register_scheme(scheme: str, resolve: Callable[[str], tuple[FileSystem, str]]) -> None:
    """Locations ``<scheme>://...`` reach their files through ``resolve`` (location -> filesystem
    and path), before pyarrow's own schemes: the simulation's in-memory store, or a store pyarrow
    does not know."""
    _SCHEMES[scheme] = resolve


def filesystem(location: str) -> tuple[FileSystem, str]:
    """The filesystem and the path within it for a Spark checkpoint location
    (``/path``, ``file:/path``, ``hdfs://...``, ``s3a://...``). A remote filesystem is made once
    per location and endpoint in a process (:func:`_remote`): the journal, the lease and Spark's
    logs are opened many times a batch, and an HDFS client connects to its NameNode, an S3 one
    resolves its credentials, when made."""
    scheme = location.split("://", 1)[0] if "://" in location else ""
    if scheme in _SCHEMES:
        return _SCHEMES[scheme](location)
    if "://" not in location and not location.startswith("file:"):
        return LocalFileSystem(), location.rstrip("/")
    return _remote(location, next((os.environ[name] for name in ENDPOINT_ENVS if os.environ.get(name)), None))


@functools.lru_cache(maxsize=64)
def _remote(location: str, endpoint: str | None) -> tuple[FileSystem, str]:
    """:func:`filesystem` of a URI; pyarrow's filesystems may be shared between threads."""
    if location.startswith("file:") and not location.startswith("file://"):
        location = "file://" + location[len("file:"):]
    if location.startswith(("s3a://", "s3n://")):
        location = "s3://" + location.split("://", 1)[1]
    if location.startswith("s3://") and endpoint:
        scheme, _, host = endpoint.rpartition("://")
        return (S3FileSystem(endpoint_override=host.rstrip("/"), scheme=scheme or "https"),
                location.split("://", 1)[1].split("?", 1)[0].rstrip("/"))
    found, path = FileSystem.from_uri(location)
    return found, path.rstrip("/")


def write_atomically(fs: FileSystem, path: str, data: bytes) -> None:
    """Write a whole file or nothing: to a temporary name, then move it into place. On a local
    (or NFS-mounted) filesystem the file and the move are on disk before this returns (fsync of
    the file, then of its folder): the journal and the staged rows it names must outlive a
    machine that loses power right after Spark logged the batch complete. Object stores and
    HDFS make a closed file durable themselves."""
    parent = path.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    temporary = f"{parent}/.{path.rsplit('/', 1)[1]}.{_TAG}-{next(_COUNT)}.tmp"
    if isinstance(fs, LocalFileSystem):
        with open(temporary, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
        folder = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
        return
    with fs.open_output_stream(temporary) as out:
        out.write(data)
    fs.move(temporary, path)


_TAG = os.urandom(8).hex()
"""This process's part of a temporary file's name (drawn again in a forked child); a count makes
the rest. No other writer, in this process or any other, makes the same name, and no call asks
the kernel for randomness (``os.urandom``, a system call, took 3% of a simulation's time)."""
_COUNT = itertools.count()


def _new_tag() -> None:
    global _TAG
    _TAG = os.urandom(8).hex()


os.register_at_fork(after_in_child=_new_tag)


def temporary_target(name: str) -> str | None:
    """The file name a temporary of :func:`write_atomically` was to become (a writer killed
    between writing and moving leaves it behind), None for any other name."""
    if name.startswith(".") and name.endswith(".tmp") and name.count(".") >= 3:
        return name[1:].rsplit(".", 2)[0]
    return None


def delete_dir_if_spent(fs: FileSystem, directory: str) -> bool:
    """Delete ``directory`` when it holds nothing but temporaries of killed writers; True if it did."""
    names = list_names(fs, directory)
    if any(temporary_target(name) is None for name in names):
        return False
    delete_dir(fs, directory)
    return True


def delete_dir(fs: FileSystem, directory: str) -> None:
    """Delete ``directory`` with everything in it; a missing one is no error."""
    try:
        fs.delete_dir(directory)
    except FileNotFoundError:
        pass


def read_bytes(fs: FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as source:
        return bytes(source.read())


def list_names(fs: FileSystem, directory: str, folders_only: bool = False) -> list[str]:
    """Base names of the entries of ``directory`` (of its folders only, with ``folders_only``);
    empty when it does not exist."""
    infos = fs.get_file_info(FileSelector(directory, allow_not_found=True))
    return [info.base_name for info in infos if not folders_only or info.type == FileType.Directory]


def delete_file(fs: FileSystem, path: str) -> None:
    try:
        fs.delete_file(path)
    except FileNotFoundError:
        pass
