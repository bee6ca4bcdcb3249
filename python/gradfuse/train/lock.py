"""One writer per checkpoint folder: a lock held while a Trainer runs.

A ``FolderLock`` is an exclusive ``flock`` on ``.gradfuse-lock`` in the checkpoint folder,
taken without waiting: a second writer (another Trainer in this process or in another one,
on this machine or, where the file system supports locks, another) gets a
``CheckpointFolderInUse`` naming the folder and the holder (its process, host and start
time, which the holder writes into the file) at once, before it writes anything, instead of
removing or renaming the other writer's temporary files. The kernel drops the lock when the
process dies however it dies, so a crashed run never leaves the folder locked; its file is
left behind, harmless (the next writer locks it). A lock that is released deletes its file.

``flock`` locks belong to an open file, so two Trainers in one process exclude each other as
two processes do; where ``flock`` is emulated by per-process locks (NFS) or missing (Windows),
the folders this process holds are also kept in a table, so two writers in one process are
still refused (two processes on such a file system are not).

A ``FolderLock`` is released by ``release()``, or when it is garbage collected; the writers
take one for the duration of a save when none is given (``holding``).

A forked child inherits the descriptor (and so, for the kernel, a share of the ``flock``) but
is not the holder: in the child ``held`` is False (a Trainer there takes a lock of its own to
save, and is refused while the parent holds it), and letting go of the lock there, or the
child's exit, closes the child's copy of the descriptor only: the parent's lock file stays and
the parent keeps the folder.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import socket
import weakref
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: the in-process table alone
    fcntl = None

LOCK_FILE = ".gradfuse-lock"
_held: dict[str, str] = {}  # folder (resolved) -> who holds it, in this process


class CheckpointFolderInUse(RuntimeError):
    """Another writer holds the checkpoint folder's lock."""


class FolderLock:
    """The exclusive hold of ``directory`` (made if missing) for ``holder`` (words for the
    messages, e.g. ``"gradfuse.Trainer"``); ``CheckpointFolderInUse`` if someone holds it."""

    def __init__(self, directory: str | os.PathLike, holder: str = "a checkpoint writer"):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self._key = os.fspath(self.directory.resolve())
        if self._key in _held:
            holder = f"{_held[self._key]} in this process (pid {os.getpid()})"
            raise CheckpointFolderInUse(_busy(self.directory, holder))
        self.holder = f"{holder} (pid {os.getpid()} on {socket.gethostname()}, since {_now()})"
        fd = _lock_file(self.path, self.directory)
        _held[self._key] = self.holder
        self._pid = os.getpid()  # the holder; a forked child is not (module docs)
        self._release = weakref.finalize(self, _unlock, fd, self.path, self._key, self._pid)
        try:  # who holds it, for the message another writer gets
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"holder": self.holder}).encode() + b"\n")
        except OSError:
            self.release()
            raise

    @property
    def held(self) -> bool:
        return self._release.alive and os.getpid() == self._pid

    def release(self) -> None:
        """Let go of the folder (and delete the lock file); a second call does nothing."""
        self._release()

    def check(self, directory: str | os.PathLike) -> None:
        """Raise unless this lock is held, and on ``directory``."""
        if not self.held:
            raise CheckpointFolderInUse(f"the lock on {self.directory} was released: take it again before writing")
        if os.fspath(Path(directory).resolve()) != self._key:
            raise ValueError(f"the lock given is on {self.directory}, not on {directory}")

    def __repr__(self) -> str:
        return f"FolderLock({os.fspath(self.directory)!r}, {'held' if self.held else 'released'})"


@contextlib.contextmanager
def holding(directory: str | os.PathLike, lock: FolderLock | None, holder: str) -> Iterator[FolderLock]:
    """``lock`` when given (checked: held, on ``directory``); else a lock on ``directory`` taken
    for the ``with`` block and released after it."""
    if lock is not None:
        lock.check(directory)
        yield lock
        return
    own = FolderLock(directory, holder)
    try:
        yield own
    finally:
        own.release()


def _lock_file(path: Path, directory: Path) -> int:
    """An open descriptor of ``path`` holding its exclusive ``flock``."""
    directory.mkdir(parents=True, exist_ok=True)
    for _ in range(10):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is None:
            return fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise CheckpointFolderInUse(_busy(directory, _holder_in(path))) from None
        # The holder deletes the file when it lets go: if that happened between our open and our
        # lock, what we locked is no longer the folder's lock file; open it again.
        try:
            mine, now = os.fstat(fd), os.stat(path)
            if (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise CheckpointFolderInUse(_busy(directory, "writers that keep taking and releasing it"))


def _unlock(fd: int, path: Path, key: str, pid: int) -> None:
    _held.pop(key, None)
    if os.getpid() == pid:  # in a forked child the file is the parent's, still locked by it
        with contextlib.suppress(OSError):
            path.unlink()  # while still locked: a writer waiting on this file opens the path again
    os.close(fd)  # closing the last descriptor releases the flock


if hasattr(os, "register_at_fork"):  # a child holds none of the parent's folders (module docs)
    os.register_at_fork(after_in_child=_held.clear)


def _holder_in(path: Path) -> str:
    try:
        return json.loads(path.read_text())["holder"]
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not said which yet)"


def _busy(directory: Path, holder: str) -> str:
    return (
        f"the checkpoint folder {os.fspath(directory)} is in use by {holder}: two writers in one folder would "
        "remove or overwrite each other's checkpoints. Wait until it finishes (a Trainer lets go when fit() "
        "returns, or when close() is called), or give this one another checkpoint_dir"
    )


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")
