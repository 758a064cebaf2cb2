"""The state file's lock: `<path>.lock`, held (flock) with the owner's pid in it while one exporter
has the file open, so that a second exporter, or a second store in this process, is refused and
told which process holds it."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os

from exporter.core.logs import get_logger
from exporter.state.errors import StateError

log = get_logger(__name__)


class LockFile:
    """The lock of the state file at `path`, taken at creation: a `StateError` if another holds it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock_path = f"{os.path.realpath(path)}.lock"  # (beside the file itself: one a symlink names too)
        self.made = not os.path.lexists(self.lock_path)
        """Whether there was no lock file before: `abandon` takes it away again."""
        self._fd: int | None = self._take()

    def _take(self, attempts: int = 3) -> int:
        """Open and lock `<path>.lock`, write our pid into it; refuse if another holds it."""
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise StateError(
                    self.path,
                    f"state file {self.path}: cannot create its lock file {self.lock_path}: the directory is "
                    f"read-only or not writable ({error.strerror})",
                ) from None
            raise StateError(
                self.path, f"state file {self.path}: cannot open its lock file {self.lock_path} ({error.strerror})"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not self._still_there(fd):  # (taken away by one that made it, and failed, while this opened it)
                os.close(fd)
                if attempts <= 1:
                    raise StateError(
                        self.path, f"state file {self.path}: its lock file {self.lock_path} keeps being replaced"
                    )
                return self._take(attempts - 1)
        except OSError as error:
            try:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            finally:
                os.close(fd)
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StateError(
                    self.path, f"state file {self.path}: cannot lock {self.lock_path} ({error.strerror})"
                ) from None
            pid = holder if holder.isdigit() else "unknown"
            raise StateError(
                self.path,
                f"state file {self.path} is in use by another exporter (pid {pid}); "
                "each exporter needs its own state.path",
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # the lock holds without the pid; only the message to a second exporter is poorer
        return fd

    def _still_there(self, fd: int) -> bool:
        """Whether the file locked at `fd` is the one at the lock's path (both read through a
        descriptor, so that a file system that numbers them otherwise for a path agrees; True when
        that cannot be told)."""
        try:
            there = os.open(self.lock_path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        except OSError:
            return True
        try:
            mine, theirs = os.fstat(fd), os.fstat(there)
        finally:
            os.close(there)
        return (theirs.st_dev, theirs.st_ino) == (mine.st_dev, mine.st_ino)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing releases the flock
            self._fd = None

    def abandon(self) -> None:
        """Release the lock of a state file that could not be opened, and remove the lock file if
        taking the lock made it: a path that names no state file of this exporter's (another
        program's, a device, a directory) is left with nothing of it beside."""
        if self._fd is not None and self.made:
            with contextlib.suppress(OSError):
                os.unlink(self.lock_path)  # (while still held: no other exporter takes it meanwhile)
        self.release()

    def check(self) -> None:
        """Take the lock again if `<path>.lock` was deleted or replaced while running."""
        if self._fd is None or self._still_there(self._fd):
            return
        fd = self._take()  # refused if another exporter took the new lock file meanwhile
        os.close(self._fd)
        self._fd = fd
        log.warning("state lock file was deleted while running; locked it again", path=self.lock_path)
