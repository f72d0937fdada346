"""The kernel cache's files and whether they may be trusted (`build` uses them).

Beside each `<name>-<key>.so` a record `<name>-<key>.json` says what the library must be (its size
and sha256) and what it was built for (flags, instruction sets); it is written after the library,
so a library without a matching record is unfinished, truncated or replaced, and is built again
rather than mapped (ctypes maps a truncated library and the process dies with SIGBUS). A build that
failed leaves `<name>-<key>.failed.json` (the key covers the sources, the compiler, the flags and
the CPU), so later processes do not recompile in vain until one of those changes.
"""

from __future__ import annotations

import grp
import hashlib
import json
import os
import pwd
import stat
import tempfile


def record_path(so: str) -> str:
    return so[: -len(".so")] + ".json"


def failure_path(so: str) -> str:
    return so[: -len(".so")] + ".failed.json"


def _private_group(gid: int) -> bool:
    """Whether `gid` is the user's own group with no other member (umask 002 systems make folders
    group-writable for it)."""
    try:
        me, group = pwd.getpwuid(os.getuid()), grp.getgrgid(gid)
    except KeyError:
        return False
    return gid == me.pw_gid and group.gr_name == me.pw_name and set(group.gr_mem) <= {me.pw_name}


def _not_trusted(st: os.stat_result) -> str | None:
    """Why a file or folder with status `st` could hold someone else's code, or None: owned by
    another user (root excepted), or writable by others (a folder's sticky bit excepted)."""
    if st.st_uid not in (os.getuid(), 0):
        return f"belongs to uid {st.st_uid}, not to you (uid {os.getuid()})"
    sticky = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    if st.st_mode & stat.S_IWOTH and not sticky:
        return "can be written by every user"
    if st.st_mode & stat.S_IWGRP and not sticky and not _private_group(st.st_gid):
        return f"can be written by the members of group {st.st_gid}"
    return None


def unsafe_folder(path: str) -> str | None:
    """Why a library in folder `path` (made if missing) must not be trusted, or None: a folder on
    its way from / that another user owns or can write (without the sticky bit) could swap it."""
    p = os.path.abspath(path)
    while True:
        try:
            why = _not_trusted(os.stat(p))
        except OSError:
            why = None  # made later, as this user (or never: then it cannot be written)
        if why:
            return f"folder {p} {why}"
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_json(path: str) -> dict | None:
    """A trusted JSON file's content; None where it is missing, unreadable or not trusted."""
    try:
        if _not_trusted(os.lstat(path)) or not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def verify(so: str) -> tuple[dict | None, str | None]:
    """(the record of `so`, None) where it is what was built, else (None, why it is not)."""
    try:
        st = os.lstat(so)
    except OSError as e:
        return None, f"cannot be read ({e.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return None, "is not a regular file"
    why = _not_trusted(st)
    if why:
        return None, why
    record = _read_json(record_path(so))
    if record is None:
        return None, "has no record of its build (built by an older selfspec, or interrupted)"
    if st.st_size != record.get("size"):
        return None, f"is {st.st_size} bytes where {record.get('size')} were built (truncated or replaced)"
    if _sha256(so) != record.get("sha256"):
        return None, "does not hold the bytes that were built"
    return record, None


def write_json(path: str, data: dict) -> None:
    """Write `data` to `path` atomically (a temporary file flushed to disk, then renamed), mode 0644."""
    fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def install(tmp: str, so: str, record: dict) -> dict:
    """Move the freshly built library `tmp` to `so` (flushed, 0644, renamed atomically), then its
    record (size, sha256 and `record`) beside it; returns the record."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)  # others who share the cache may read it (mkstemp made it 0600)
    record = {**record, "size": os.path.getsize(tmp), "sha256": _sha256(tmp)}
    os.replace(tmp, so)
    write_json(record_path(so), record)
    return record


def remove(so: str) -> None:
    """Remove a cached library and its record (before it is built again); missing is fine."""
    for p in (record_path(so), so):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def remembered(so: str) -> dict | None:
    """The failure a build of `so` met earlier ({"error": ..., "fix": ...}), or None."""
    data = _read_json(failure_path(so))
    return data if data and isinstance(data.get("error"), str) else None


def remember(so: str, error: str, fix: str) -> None:
    """Keep a failed build's reason beside where `so` would be; best effort (a cache that cannot
    be written just means the next process tries again)."""
    try:
        write_json(failure_path(so), {"error": error, "fix": fix})
    except OSError:
        pass
