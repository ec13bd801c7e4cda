"""A FUSE filesystem (the kernel's /dev/fuse protocol, no libfuse) with one file, `held`, that never answers the
FLUSH a close sends. A process that opened `held` and is then killed never finishes dying: its exit closes the
file, and the kernel waits for a forced FLUSH uninterruptibly (state D), SIGKILL or not. It is the closest real
stand-in for a rank stuck in the GPU driver after an XID 79, made without a GPU.

Usage: fuse_hold.py MOUNTPOINT. Prints "ready" once mounted. SIGTERM (or SIGINT) ends it: closing /dev/fuse aborts
the connection, which ends the pending FLUSH, so the stuck process finishes dying; the mount is then detached.
Needs /dev/fuse and CAP_SYS_ADMIN (root); otherwise it prints "unavailable: <why>" and exits 3."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import stat
import struct
import sys

LOOKUP, FORGET, GETATTR, OPEN, RELEASE, FLUSH, INIT = 1, 2, 3, 14, 18, 25, 26
OPENDIR, READDIR, RELEASEDIR, INTERRUPT, BATCH_FORGET = 27, 28, 29, 36, 42
NO_REPLY = {FORGET, BATCH_FORGET, INTERRUPT, FLUSH}  # FLUSH: never answered, on purpose
IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding
OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # ino size blocks atime mtime ctime *nsec mode nlink uid gid rdev blksize
ROOT, HELD = 1, 2
MS_NOSUID, MS_NODEV, MNT_DETACH = 2, 4, 2


def attr(node: int) -> bytes:
    mode = (stat.S_IFDIR | 0o755) if node == ROOT else (stat.S_IFREG | 0o644)
    return ATTR.pack(node, 0, 0, 0, 0, 0, 0, 0, 0, mode, 2 if node == ROOT else 1, 0, 0, 0, 4096, 0)


def answer(opcode: int, node: int, body: bytes) -> tuple[int, bytes]:
    """(negative errno or 0, reply body) for one request."""
    if opcode == INIT:
        readahead = struct.unpack_from("<III", body)[2]  # (major, minor, max_readahead) the kernel offers
        return 0, struct.pack("<IIIIHHIIHHII", 7, 31, readahead, 0, 16, 12, 1 << 17, 1, 32, 0, 0, 0).ljust(64, b"\0")
    if opcode == LOOKUP:
        if body.split(b"\0", 1)[0] != b"held":
            return -errno.ENOENT, b""
        return 0, struct.pack("<QQQQII", HELD, 0, 3600, 3600, 0, 0) + attr(HELD)
    if opcode == GETATTR:
        return 0, struct.pack("<QII", 3600, 0, 0) + attr(node)
    if opcode in (OPEN, OPENDIR):
        return 0, struct.pack("<QIi", 1, 0, 0)
    if opcode in (RELEASE, RELEASEDIR, READDIR):
        return 0, b""
    return -errno.ENOSYS, b""


def main(mountpoint: str) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        fd = os.open("/dev/fuse", os.O_RDWR)
    except OSError as err:
        print(f"unavailable: /dev/fuse: {err.strerror}", flush=True)
        return 3
    options = f"fd={fd},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()}".encode()
    if libc.mount(b"fuse_hold", mountpoint.encode(), b"fuse.fuse_hold", MS_NOSUID | MS_NODEV, options) != 0:
        print(f"unavailable: mount: {os.strerror(ctypes.get_errno())}", flush=True)
        return 3

    def end(_signum, _frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, end)
    signal.signal(signal.SIGINT, end)
    print("ready", flush=True)
    try:
        while True:
            try:
                request = os.read(fd, (1 << 17) + 4096)
            except OSError as err:
                if err.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):  # ENOENT: a request interrupted
                    continue
                return 0  # ENODEV: unmounted
            length, opcode, unique, node, *_ = IN_HEADER.unpack_from(request)
            if opcode in NO_REPLY:
                continue
            error, body = answer(opcode, node, request[IN_HEADER.size:length])
            with contextlib.suppress(OSError):  # the requester is gone (interrupted): nothing to answer
                os.write(fd, OUT_HEADER.pack(OUT_HEADER.size + len(body), error, unique) + body)
    finally:
        os.close(fd)  # aborts the connection: the FLUSH never answered ends, and its process with it
        libc.umount2(mountpoint.encode(), MNT_DETACH)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
