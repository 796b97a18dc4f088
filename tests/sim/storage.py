"""The checkpoint storage of the simulation: an in-memory filesystem that answers as a pyarrow
filesystem does, so the kit's storage code (journal, staged files, lease, Spark's logs) runs
unchanged against it. Every operation is a scheduling point. What it promises is what the kit
relies on: a file appears whole at its ``move`` (the kit writes a temporary and moves it), a
listing shows every file written before it, a delete of a missing file is no error."""

from __future__ import annotations

import functools
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
            self.store.put(self.path, self.getvalue())
        super().close()


class _Tree:
    """An index of paths by folder, so that a listing does not scan every path: the names of the
    paths right in each folder, and the entries of each folder that hold such a folder deeper
    (how many of them). A folder of :meth:`MemoryStore.create_dir` is linked alone. A folder
    whose entries change is dropped from ``listed`` (the listings made from the index)."""

    def __init__(self, listed: dict[str, list[FileInfo]]) -> None:
        self.names: dict[str, set[str]] = {}
        self.deeper: dict[str, dict[str, int]] = {}
        self.listed = listed

    def add(self, path: str) -> None:
        folder, slash, name = path.rpartition("/")
        if not slash:
            return  # in no folder: no listing shows it
        names = self.names.get(folder)
        if names is None:
            names = self.names[folder] = set()
            self.link(folder, 1)
        names.add(name)
        self.listed.pop(folder, None)

    def remove(self, path: str) -> None:
        folder, slash, name = path.rpartition("/")
        if not slash:
            return
        names = self.names[folder]
        names.remove(name)
        self.listed.pop(folder, None)
        if not names:
            del self.names[folder]
            self.link(folder, -1)

    def link(self, folder: str, delta: int) -> None:
        """Count ``folder`` in (out of, with -1) the entries of every folder above it."""
        while "/" in folder:
            folder, _, entry = folder.rpartition("/")
            counts = self.deeper.setdefault(folder, {})
            before = counts.get(entry, 0)
            counts[entry] = before + delta
            if not before or not counts[entry]:  # the entry comes or goes
                self.listed.pop(folder, None)
            if not counts[entry]:
                del counts[entry]
                if not counts:
                    del self.deeper[folder]

    def holds(self, folder: str) -> bool:
        """Whether a path lies under ``folder``."""
        return folder in self.names or folder in self.deeper


class MemoryStore:
    """Files by path; folders are implied by the files under them (and by create_dir). It answers
    the calls :mod:`oncekit.core.storage` makes of a pyarrow filesystem, with pyarrow's types.
    ``files`` is read freely; it changes only through :meth:`put` and :meth:`remove`, which keep
    the index of files by folder. A folder's listing is made once for as long as it holds the
    same entries."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.files: dict[str, bytes] = {}
        self.folders: set[str] = set()
        self._listed: dict[str, list[FileInfo]] = {}
        self._files_tree = _Tree(self._listed)
        self._folders_tree = _Tree(self._listed)

    def put(self, path: str, data: bytes) -> None:
        if path.endswith("/"):
            raise IsADirectoryError(path)  # a file's name never ends in a slash (the kit writes none)
        if path not in self.files:
            self._files_tree.add(path)
        self.files[path] = data

    def remove(self, path: str) -> bytes:
        data = self.files.pop(path)
        self._files_tree.remove(path)
        return data

    def _step(self, what: str, path: str) -> None:
        self.scheduler.step(lambda: f"storage {what} {path.split('/oncekit/')[-1]}")

    def _is_dir(self, path: str) -> bool:
        return path in self.folders or self._files_tree.holds(path.rstrip("/"))

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
        infos = self._listed.get(base)
        if infos is None:
            children = dict.fromkeys(self._files_tree.names.get(base, ()), FileType.File)
            children.update(dict.fromkeys(self._files_tree.deeper.get(base, ()), FileType.Directory))
            children.update(dict.fromkeys(self._folders_tree.deeper.get(base, ()), FileType.Directory))
            infos = self._listed[base] = [FileInfo(f"{base}/{child}", kind) for child, kind in sorted(children.items())]
        if not infos and base not in self.folders and not selector.allow_not_found:
            raise FileNotFoundError(base)
        return list(infos)  # FileInfo is immutable: the caller may keep or change its list only

    def create_dir(self, path: str, recursive: bool = True) -> None:
        path = path.rstrip("/")
        if path not in self.folders:
            self.folders.add(path)
            self._folders_tree.link(path, 1)

    def delete_dir(self, path: str) -> None:
        self._step("delete dir", path)
        path = path.rstrip("/")
        prefix = path + "/"
        for name in [n for n in self.files if n.startswith(prefix)]:
            self.remove(name)
        for name in [f for f in self.folders if f == path or f.startswith(prefix)]:
            self.folders.remove(name)
            self._folders_tree.link(name, -1)

    def delete_file(self, path: str) -> None:
        self._step("delete", path)
        if path not in self.files:
            raise FileNotFoundError(path)
        self.remove(path)

    def move(self, src: str, dest: str) -> None:
        self._step("move into", dest)
        if src not in self.files:
            raise FileNotFoundError(src)  # its folder was deleted meanwhile
        self.put(dest, self.remove(src))

    def open_input_stream(self, path: str) -> pa.NativeFile:
        self._step("read", path)
        if path not in self.files:
            raise FileNotFoundError(path)
        return pa.BufferReader(self.files[path])

    def open_output_stream(self, path: str) -> Any:
        return _Output(self, path)


_stores: dict[str, MemoryStore] = {}


@functools.lru_cache(maxsize=256)
def _resolve(location: str) -> tuple[Any, str]:
    """The store and path of a ``sim://`` location (once per location: a world's names are never
    used again once it ended, and the kit resolves the same few locations all the time)."""
    rest = location.split("://", 1)[1]
    name, _, path = rest.partition("/")
    return _stores[name], "/" + path.rstrip("/")


def install(name: str, store: MemoryStore) -> str:
    """Make ``sim://<name>/...`` locations reach ``store``; returns the location's prefix."""
    register_scheme(SCHEME, _resolve)
    _stores[name] = store
    return f"{SCHEME}://{name}"


def uninstall(name: str) -> None:
    """Forget the store of ``name`` (a world that ended: nothing reaches it any more)."""
    _stores.pop(name, None)
