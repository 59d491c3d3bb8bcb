"""Writing files so that a crash never leaves a torn one, and where mlptrain keeps its caches.

:func:`atomic_write` is the one way mlptrain writes a file that something else reads back
(checkpoints, ``metrics.jsonl`` when it is rewritten, ``run.json``, plan caches, dataset caches):
the bytes go to a temporary file of this writer's own in the same folder, which is flushed and
fsynced, renamed over the destination with :func:`os.replace` and the folder fsynced. A crash,
a full disk or a second Ctrl-C at any moment leaves the old file or the new one, never a mix;
two writers never share a temporary file. A temporary file left by a killed writer matches
:data:`TEMP_GLOB`; the run directory removes (and reports) them at the next start, and the
commands (``predict``, ``evaluate``, ``export``) remove those of their output whose writer is dead
(:func:`remove_stale_temps`). :func:`spreadsheet_text` is how a CSV cell of text from the data is written,
:func:`json_ready` how a JSON file holds an undefined (inf/NaN) number.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import logging
import math
import os
import re
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

TEMP_SUFFIX = ".tmp"
TEMP_GLOB = "*" + TEMP_SUFFIX
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")  # what starts a formula in Excel, LibreOffice, Google Sheets
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def temp_name(path: Path) -> Path:
    """A temporary file beside ``path`` that no other writer (process or call) uses: ``<name>.<pid>.<hex>.tmp``."""
    return path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts: it cannot be signalled, but it is there)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(path: Path) -> list[Path]:
    """Remove the temp files of ``path`` (:func:`temp_name`) whose writer is dead, saying so; returns them.

    A command killed mid-write (SIGKILL, or a crash) cannot remove its temp file. Unlike a run, a
    command holds no lock, so a temp file of a live process (another command writing the same
    output now) is kept, as is anything that is not a regular file of this user.
    """
    pattern = re.compile(re.escape(path.name) + r"\.(\d+)\.[0-9a-f]{8}" + re.escape(TEMP_SUFFIX))
    removed = []
    for tmp in sorted(path.parent.glob(f"{glob.escape(path.name)}.*{TEMP_SUFFIX}")):
        m = pattern.fullmatch(tmp.name)
        try:
            if not m or tmp.is_symlink() or not tmp.is_file() or tmp.stat().st_uid != os.getuid():
                continue
            if pid_alive(int(m.group(1))):
                continue
            tmp.unlink()
        except (OSError, OverflowError):  # gone meanwhile, not ours to remove, or a pid no process can have
            continue
        log.warning("removed %s, the temporary file of a write that was interrupted", tmp)
        removed.append(tmp)
    return removed


def atomic_write(path: Path, content: bytes | str | Callable[[IO[bytes]], None]) -> None:
    """Replace ``path`` with ``content`` atomically: temp file, fsync, rename, fsync the folder.

    ``content`` is bytes, text (UTF-8), or a function that writes to the open binary file.

    Raises:
        OSError: the file cannot be written; ``path`` is then as it was, and no temp file is left
            (where the folder still lets us remove it).
    """
    path = Path(path)
    tmp = temp_name(path)
    try:
        write_temp(tmp, content)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        with contextlib.suppress(OSError):  # a read-only folder refuses even this: the original error wins
            tmp.unlink(missing_ok=True)


def open_nofollow(path: Path, mode: str = "a", **kwargs: Any) -> IO[Any]:
    """``open(path, mode)`` for appending (``a``) or rewriting in place (``w``), never through a symbolic link.

    A link planted where a run appends (``mlptrain.log``, ``metrics.jsonl``) would have the run write
    into the file it points to, outside the run directory: ``O_NOFOLLOW`` makes that open fail
    (``ELOOP``) instead.
    """
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    return open(path, mode, opener=lambda p, _: os.open(p, flags, 0o666), **kwargs)


def log_file_handler(path: Path) -> logging.FileHandler:
    """A logging handler appending to ``path`` (UTF-8), opened now with :func:`open_nofollow`."""
    handler = logging.FileHandler(path, encoding="utf-8", delay=True)
    handler.stream = open_nofollow(path, "a", encoding="utf-8")  # type: ignore[assignment]
    return handler


def write_temp(tmp: Path, content: bytes | str | Callable[[IO[bytes]], None]) -> None:
    """Write ``content`` to the new file ``tmp``, flushed and fsynced (the first half of :func:`atomic_write`)."""
    with open(tmp, "xb") as f:  # a new file: never one planted under the name (nor a link)
        if callable(content):
            content(f)
        else:
            f.write(content.encode("utf-8") if isinstance(content, str) else content)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (POSIX; a no-op where folders cannot be opened or synced)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - file systems that refuse fsync on folders
        pass
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    """The SHA-256 of a regular file's bytes (hex), read in 4 MiB chunks, at most the size it had when opened.

    A FIFO, a device (``/dev/zero``) or a socket would be read forever, on whatever thread hashes it,
    and would keep the process from exiting: it is refused before a byte is read (opened without
    blocking, so a FIFO with no writer does not block the open either).

    Raises:
        OSError: the file cannot be read, or is not a regular file (``EINVAL``, naming its kind).
    """
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with open(fd, "rb", closefd=True) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{file_type(st.st_mode)}, not a regular file", str(path))
        left = st.st_size
        while left > 0:
            chunk = f.read(min(left, 1 << 22))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def file_type(mode: int) -> str:
    """What a ``stat`` mode says a file is, for a message: ``a FIFO``, ``a directory``, ``a character device``..."""
    kinds = [
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def cache_root() -> Path:
    """mlptrain's cache: ``$MLPTRAIN_DATA``, else ``$XDG_CACHE_HOME/mlptrain``, else ``~/.cache/mlptrain``.

    Downloads, dataset caches, cuBLASLt plans and measured choices live there, never in a run directory.
    """
    if os.environ.get("MLPTRAIN_DATA"):
        return Path(os.environ["MLPTRAIN_DATA"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "mlptrain"
    return Path.home() / ".cache" / "mlptrain"


def spreadsheet_text(cell: Any) -> Any:
    """``cell`` as a CSV cell that a spreadsheet shows rather than runs: text starting with one of
    :data:`FORMULA_START` gets a leading ``'`` (``=1+2`` -> ``'=1+2``), as OWASP's advice on CSV injection
    says; numbers (``-3``, ``-1.5e3``, as numbers or as text) and other text are left as they are. Every CSV
    that writes names from the data uses it (predict's output, cross-validation's ``oof_predictions.csv``)."""
    if not isinstance(cell, str) or not cell.startswith(FORMULA_START) or _NUMBER.fullmatch(cell):
        return cell
    return "'" + cell


def json_ready(value: Any) -> Any:
    """``value`` (dicts, lists, numbers, text) with every inf/NaN float written ``None``, as the run's JSON files hold
    an undefined score (``json.dumps(..., allow_nan=False)`` then writes strict JSON: ``NaN`` is not JSON)."""
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_ready(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value
