"""The checkpoint storage of the simulation: an in-memory filesystem that answers as a pyarrow
filesystem does, so the kit's storage code (journal, staged files, lease, Spark's logs) runs
unchanged against it. Every operation is a scheduling point. What it promises is what the kit
relies on: a file appears whole at its ``move`` (the kit writes a temporary and moves it), a
listing shows every file written before it, a delete of a missing file is no error."""

from __future__ import annotations

import io
from typing import Any

import pyarrow as pa
from pyarrow.fs import FileInfo, FileSelector, FileType

from oncekit.core.storage import register_scheme
from tests.sim.scheduler import Scheduler

SCHEME = "sim"


class _Output(io.BytesIO):
    def __init__(self, store: MemoryStore, path: str) -> None:
        super().__init__()
        self.store, self.path = store, path

    def close(self) -> None:
        if not self.closed:
            self.store.files[self.path] = self.getvalue()
        super().close()


class MemoryStore:
    """Files by path; folders are implied by the files under them (and by create_dir). It answers
    the calls :mod:`oncekit.core.storage` makes of a pyarrow filesystem, with pyarrow's types."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.files: dict[str, bytes] = {}
        self.folders: set[str] = set()

    def _step(self, what: str, path: str) -> None:
        self.scheduler.step(f"storage {what} {path.split('/oncekit/')[-1]}")

    def _is_dir(self, path: str) -> bool:
        prefix = path.rstrip("/") + "/"
        return path in self.folders or any(name.startswith(prefix) for name in self.files)

    def get_file_info(self, target: Any) -> Any:
        if isinstance(target, FileSelector):
            return self._list(target)
        path = str(target)
        self._step("stat", path)
        if path in self.files:
            return FileInfo(path, FileType.File, size=len(self.files[path]))
        return FileInfo(path, FileType.Directory if self._is_dir(path) else FileType.NotFound)

    def _list(self, selector: FileSelector) -> list[FileInfo]:
        base = selector.base_dir.rstrip("/")
        self._step("list", base)
        prefix = base + "/"
        children: dict[str, FileType] = {}
        for name in self.files:
            if name.startswith(prefix):
                child, _, deeper = name[len(prefix):].partition("/")
                if deeper or children.get(child) == FileType.Directory:
                    children[child] = FileType.Directory
                else:
                    children[child] = FileType.File
        for name in self.folders:
            if name.startswith(prefix):
                children.setdefault(name[len(prefix):].partition("/")[0], FileType.Directory)
        if not children and base not in self.folders and not selector.allow_not_found:
            raise FileNotFoundError(base)
        return [FileInfo(prefix + child, kind) for child, kind in sorted(children.items())]

    def create_dir(self, path: str, recursive: bool = True) -> None:
        self.folders.add(path.rstrip("/"))

    def delete_dir(self, path: str) -> None:
        self._step("delete dir", path)
        prefix = path.rstrip("/") + "/"
        for name in [n for n in self.files if n.startswith(prefix)]:
            del self.files[name]
        self.folders = {f for f in self.folders if f != path.rstrip("/") and not f.startswith(prefix)}

    def delete_file(self, path: str) -> None:
        self._step("delete", path)
        if path not in self.files:
            raise FileNotFoundError(path)
        del self.files[path]

    def move(self, src: str, dest: str) -> None:
        self._step("move into", dest)
        self.files[dest] = self.files.pop(src)

    def open_input_stream(self, path: str) -> pa.NativeFile:
        self._step("read", path)
        if path not in self.files:
            raise FileNotFoundError(path)
        return pa.BufferReader(self.files[path])

    def open_output_stream(self, path: str) -> Any:
        return _Output(self, path)


_stores: dict[str, MemoryStore] = {}


def _resolve(location: str) -> tuple[Any, str]:
    rest = location.split("://", 1)[1]
    name, _, path = rest.partition("/")
    return _stores[name], "/" + path.rstrip("/")


def install(name: str, store: MemoryStore) -> str:
    """Make ``sim://<name>/...`` locations reach ``store``; returns the location's prefix."""
    register_scheme(SCHEME, _resolve)
    _stores[name] = store
    return f"{SCHEME}://{name}"
