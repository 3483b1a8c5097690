"""Reading and writing the engine's files safely: bounded reads of regular files only,
atomic, durable writes."""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Iterable, Union


PathLike = Union[str, "os.PathLike[str]"]


def write_atomically(path: PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: a temporary file of a unique name (``mkstemp``) in the
    same directory, then a rename. A reader never sees a half-written file, a failed write keeps the
    old file, and two writers (two engines in one process) never share a temporary file."""
    target = Path(path)
    fd, temporary = tempfile.mkstemp(dir=os.fspath(target.parent), prefix=f".{target.name}.",
                                     suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, target)
        _fsync_directory(target.parent)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort: not every file system allows it)."""
    try:
        fd = os.open(os.fspath(directory), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class NotARegularFileError(OSError):
    """A path that must name a regular file names a directory, device, FIFO or socket."""


def read_regular_file(path: PathLike, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them.

    Opened without blocking (a FIFO cannot hang the caller) and checked on the open descriptor: a
    directory, a device such as ``/dev/zero``, a FIFO or a socket raises NotARegularFileError, a
    larger file OSError, a missing one FileNotFoundError; never a hang or an unbounded read.
    """
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotARegularFileError(
                f"{os.fspath(path)} is not a regular file (a directory, device or FIFO)")
        if info.st_size > max_bytes:
            raise OSError(f"{os.fspath(path)} has {info.st_size} bytes, more than the "
                          f"{max_bytes} bytes allowed")
        chunks = []
        remaining = info.st_size
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def create_exclusively(path: PathLike, data: bytes) -> bool:
    """Create ``path`` holding ``data``, only where nothing is there yet: True if created, False if
    a file (or anything else) already has that name, which is left untouched.

    The data goes to a temporary file first (``mkstemp``: mode 0600), made durable, then hard-linked
    to ``path`` (``link`` never replaces): a reader never sees the file without its data, and a
    crash leaves either no file or the whole of it. Where the file system has no hard links, the
    file is created with ``O_EXCL`` and written in place."""
    target = Path(path)
    fd, temporary = tempfile.mkstemp(dir=os.fspath(target.parent), prefix=f".{target.name}.",
                                     suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        try:
            os.link(temporary, target)
        except FileExistsError:
            return False
        except OSError:  # no hard links here (e.g. FAT): exclusive create, written in place
            return _create_in_place(target, data)
        _fsync_directory(target.parent)
        return True
    finally:
        Path(temporary).unlink(missing_ok=True)


def _create_in_place(target: Path, data: bytes) -> bool:
    try:
        fd = os.open(os.fspath(target), os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                     0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())
    _fsync_directory(target.parent)
    return True


def write_atomically_from(path: PathLike, chunks: Iterable[bytes]) -> int:
    """:func:`write_atomically` for data that comes in pieces (a file too large to hold in memory
    at once): the same temporary file, rename and directory sync; the bytes written."""
    target = Path(path)
    fd, temporary = tempfile.mkstemp(dir=os.fspath(target.parent), prefix=f".{target.name}.",
                                     suffix=".tmp")
    written = 0
    try:
        with os.fdopen(fd, "wb") as stream:
            for chunk in chunks:
                stream.write(chunk)
                written += len(chunk)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, target)
        _fsync_directory(target.parent)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return written
