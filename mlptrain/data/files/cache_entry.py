"""The folders of the data cache's entries (:mod:`mlptrain.data.files.cache`): put in place, removed, swept.

An entry is written whole into a temporary folder of its writer's (``<key>.<pid>.<hex>.tmp``) and
renamed into place (:func:`replace`): the old entry is moved aside first, and then only its files
go. The cache removes only what it wrote (:func:`remove`: the files of :data:`ENTRY_FILES`, then the
folder if that emptied it), so a folder that holds anything else (a run directory put there) keeps
it; :func:`foreign` names those things, and the cache leaves such an entry alone. Temporary folders
of writers that died are removed by the next look-up (:func:`sweep`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import stat
import time
from pathlib import Path

from mlptrain.base.fs import fsync_dir, pid_alive

log = logging.getLogger(__name__)

ENTRY_FILES = re.compile(r"meta\.json|(train|test)_(x|y|missing)\.npy")  # all an entry is made of
TEMP_ENTRY = re.compile(r"[0-9a-f]{24}\.(\d+)(\.[0-9a-f]{8})?(\.old)?\.tmp")  # <key>.<pid>[.<hex>][.old].tmp
STALE_S = 24 * 3600  # a temporary entry this old is removed even if a process has its writer's pid


def replace(folder: Path, tmp: Path) -> None:
    """Put the entry ``tmp`` in ``folder``'s place: the old entry is moved aside, then only its files removed."""
    aside = folder.with_name(f"{folder.name}.{os.getpid()}.{secrets.token_hex(4)}.old.tmp")
    try:
        os.rename(folder, aside)
        moved = True
    except FileNotFoundError:  # no entry yet, or another writer moved it aside a moment ago
        moved = False
    try:
        os.rename(tmp, folder)  # a whole entry or none (another writer's new entry there: ENOTEMPTY, this one goes)
    finally:
        if moved:
            remove(aside)
    fsync_dir(folder.parent)


def foreign(folder: Path) -> list[str]:
    """What ``folder`` (an entry) holds that the cache did not write; ``[]`` when it does not exist."""
    try:
        st = folder.lstat()
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(st.st_mode):
        return [f"{folder.name} itself (a link or a file, not a folder)"]
    return sorted(e.name for e in os.scandir(folder) if not _entry_file(e))


def _entry_file(e: os.DirEntry) -> bool:
    return bool(ENTRY_FILES.fullmatch(e.name)) and e.is_file(follow_symlinks=False)


def remove(folder: Path) -> bool:
    """Remove the files of an entry (:data:`ENTRY_FILES`), then the folder if that left it empty; never
    anything else. Returns whether the folder is gone (False: it was not there, or holds other things)."""
    try:
        if not stat.S_ISDIR(folder.lstat().st_mode):
            return False
        for e in os.scandir(folder):
            if _entry_file(e):
                os.unlink(e.path)
        folder.rmdir()
    except OSError:
        return False
    return True


def sweep(tables: Path) -> list[Path]:
    """Remove the temporary entries in ``tables`` that writers left when they died (SIGKILL, a crash); returns them.

    One goes only if it is a folder of this user named as a writer names it, and its writer's process
    is gone or it is older than :data:`STALE_S` (a writer alive now, in this process or another, is
    left to finish); and only its entry files go (:func:`remove`).
    """
    removed = []
    with contextlib.suppress(OSError):
        candidates = sorted(tables.glob("*.tmp"))
        for tmp in candidates:
            m = TEMP_ENTRY.fullmatch(tmp.name)
            try:
                st = tmp.lstat()
                if not m or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                    continue
                if pid_alive(int(m.group(1))) and time.time() - st.st_mtime < STALE_S:
                    continue
            except (OSError, OverflowError):
                continue
            if remove(tmp):
                log.warning("removed %s, a cache entry left half-written by a writer that died", tmp)
                removed.append(tmp)
    return removed
