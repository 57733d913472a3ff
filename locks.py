"""Locks that keep two processes off the same piece of work: a sweep's (variant, seed) pair, or a
search's trial, on this machine or on several sharing the ledger's folder.

A lock is an exclusive flock on its file, the same kind of lock as the ledger's appends. The kernel
drops it when the last process holding the file open ends, however it ends (kill -9, the OOM killer
and a reboot included), so a lock is never held by the dead. Whoever takes it may hand it to a child
(`pass_fds=(lock.fd,)`): a child that outlives its sweep still holds its pair. The file itself says
who holds it (host, pid, child pid, what, since when) for the messages; that pid is never what
decides: a file from another machine is judged by its flock alone, which holds across machines
where the shared filesystem's locks do (NFSv4, NFSv3 with lockd), as the ledger's appends do.
A file left behind that no process holds is a stale lock: its holder died before removing it.
"""
import fcntl
import json
import os
import socket
import time
from pathlib import Path


class Lock:
    def __init__(self, path: Path, fd: int, info: dict):
        self.path, self.fd, self.info = path, fd, info
        self.note()

    def note(self, **info):
        """Record more about the holder in the file (a child's pid)."""
        self.info.update(info)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (json.dumps(self.info) + "\n").encode(), 0)

    def release(self):
        """Only once no child holding it can still run: the file goes first, while still locked, so
        a process that opens it from now on finds a new file (see take)."""
        self.path.unlink(missing_ok=True)
        os.close(self.fd)


def take(path, **info):
    """-> (the Lock, or None where another process holds it; what the file said before: its holder,
    or, with a Lock, the stale lock's holder; {} where there was no file or it was still empty)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            found = read(fd)
            os.close(fd)
            return None, found
        try:  # a holder that released it between our open and flock removed the file: ours is gone
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        if current and (current.st_dev, current.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino):
            found = read(fd)
            return Lock(path, fd, dict(host=host(), pid=os.getpid(), **info,
                                       since=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))), found
        os.close(fd)


def host() -> str:
    """This machine's name in locks and in a search's trials: $AION_HOST, else the host name. Set it
    where two machines share a host name (containers), or to run two workers of a study as two hosts."""
    return os.environ.get("AION_HOST") or socket.gethostname()


def read(fd) -> dict:
    try:
        return json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
    except ValueError:  # torn by a kill while it was being written
        return {"torn": True}


def clear_stale(folder) -> list:
    """Remove every lock file under `folder` that no process holds -> [(path, what it said)]."""
    removed = []
    for path in sorted(Path(folder).glob("*.lock")):
        lock, found = take(path)
        if lock:
            lock.release()
            removed.append((path, found))
    return removed


def alive(pid: int) -> bool:
    """Whether `pid` runs on this machine; a zombie (ended, not yet reaped by its new parent) does not."""
    if Path("/proc/self").is_dir():
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        pass
    return True


def holder(info: dict) -> str:
    """Who a lock file names: its pids, and on this machine whether each still runs."""
    if not info.get("pid"):
        return "no holder named (the file was empty or torn)"
    here = info.get("host") == host()
    pids = [f"{name} {info[key]}" + ((" alive" if alive(info[key]) else " dead") if here else "")
            for key, name in (("pid", "pid"), ("child", "child pid")) if info.get(key)]
    return (f"{info.get('what', '-')}: {', '.join(pids)} on host {info.get('host')}"
            f"{'' if here else ' (another machine: its pids are not checked here)'}, since {info.get('since', '-')}")
