"""Where the commands write: outputs that never replace what they must not, and pairs written as a unit.

``predict``, ``evaluate`` and ``export`` check each output file before any work (:func:`check_output`).
An output is

* never an input of the command (the input file, the checkpoint), compared after resolving
  symlinks and ``..``, and hard links by their inode;
* never an mlptrain checkpoint, wherever it is, nor anything in a folder named ``checkpoints``
  (a run directory's, which ``resume=last`` reads: it holds checkpoints only);
* never a folder; and an existing file is replaced only when it is the same kind of file as the
  one the command writes (an earlier output of it), or empty, or with ``overwrite=true``.

The files are written once the work is done, by :func:`write_together`: each to a temp file of
its own (:func:`mlptrain.base.fs.temp_name`), complete and fsynced, and only then renamed into place,
in the order given, with Ctrl-C and SIGTERM held until the last rename is done. Evaluate's pair
(``confusion.png``, then ``evaluation.json``, which records the figure's SHA-256) therefore goes
out as one unit: an interrupt before the renames leaves both old files, one after them both new
ones. :data:`written` lists what a command wrote, so that its interrupt message is true.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO

from mlptrain.base.errors import OutputError
from mlptrain.base.fs import fsync_dir, remove_stale_temps, temp_name, write_temp
from mlptrain.run.checkpoint import CHECKPOINT_DIR

Content = bytes | str | Callable[[IO[bytes]], None]

written: list[Path] = []  # the outputs this command has put in place (cleared by commands.main)

_HELD = (signal.SIGINT, signal.SIGTERM)


def check_output(
    path: Path,
    *,
    inputs: dict[str, Path],
    kind: str,
    same_kind: Callable[[Path], bool],
    overwrite: bool,
    key: str = "output",
) -> None:
    """Refuse ``path`` as an output before any work is done (the rules of the module docstring).

    Args:
        path: the output file as the user named it (named so in the message).
        inputs: what the command reads, by what to call it: ``{"the input file": Path(...)}``.
        kind: what the command writes there, for the message (``"a predictions file"``).
        same_kind: whether an existing file at ``path`` is such a file (it may then be replaced).
        overwrite: replace an existing file of another kind (never an input or a checkpoint).
        key: the argument that named ``path``.

    Raises:
        OutputError: one sentence naming ``path``, what it is, and what to do instead.
    """
    try:
        real = path.resolve()  # symlinks and .. resolved: x.csv, ./d/../x.csv and a link to it are one file
    except (OSError, RuntimeError) as exc:  # a loop of symlinks
        raise OutputError(f"{key}={path} cannot be resolved ({exc}); choose another {key}") from exc
    for what, source in inputs.items():
        if _same_file(real, Path(source)):
            raise OutputError(f"{key}={path} is {what} {source}; writing there would replace it: choose another {key}")
    if real.parent.name == CHECKPOINT_DIR:
        raise OutputError(
            f"{key}={path} is in a {CHECKPOINT_DIR}/ folder, which holds a run's checkpoints only (resume reads it); "
            f"write {kind} elsewhere"
        )
    if real.is_dir():
        raise OutputError(f"{key}={path} is a folder; expected the name of {kind}")
    if is_checkpoint(real):
        raise OutputError(
            f"{key}={path} is an mlptrain checkpoint, which an output never replaces; choose another {key}"
        )
    if real.exists() and real.stat().st_size and not overwrite and not same_kind(real):  # an empty file holds nothing
        raise OutputError(
            f"{key}={path} exists and is not {kind} (an earlier output of this command); choose another {key}, or "
            "pass overwrite=true to replace it"
        )


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is an mlptrain checkpoint: a zip with a ``meta`` entry and parameters (reads the names only)."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (OSError, zipfile.BadZipFile, ValueError):
        return False
    return "meta.npy" in names and any(n.startswith("param/") for n in names)


def _same_file(real: Path, source: Path) -> bool:
    if real == source.resolve():
        return True
    try:
        return os.path.samefile(real, source)  # hard links: another name, the same inode
    except OSError:  # one of them does not exist
        return False


def prepare(paths: Sequence[Path]) -> None:
    """Before writing ``paths``: remove the temp files that killed writes of them left (their writer is dead)."""
    for path in paths:
        remove_stale_temps(path)


def write_together(items: Sequence[tuple[Path, Content]]) -> None:
    """Write each ``(path, content)`` atomically, all of them or none: every temp file is complete before
    the first rename, and a signal waits until the last rename is done (then it acts as it would have).

    Raises:
        OSError: a file cannot be written; no rename was done then, and no temp file is left.
    """
    temps: list[Path] = []
    try:
        for path, content in items:
            temps.append(temp_name(path))
            write_temp(temps[-1], content)
        with held_signals():
            for tmp, (path, _) in zip(temps, items, strict=True):
                os.replace(tmp, path)
                written.append(path)
            for folder in dict.fromkeys(path.parent for path, _ in items):
                fsync_dir(folder)
    finally:
        for tmp in temps:
            with contextlib.suppress(OSError):  # renamed already, or a read-only folder: the first error wins
                tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def held_signals() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM for the block, then deliver them to the handlers they would have reached.

    A handler of Python's own runs between bytecodes, so it could otherwise raise between two renames.
    Outside the main thread (where signals are not delivered to Python) it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in _HELD}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)
