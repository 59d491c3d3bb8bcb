"""The run directory: who may write it, what it holds, and the files a run writes there.

A run directory holds ``run.json``, ``metrics.jsonl``, ``checkpoints/last.npz`` and ``best.npz``
(and, from the command line, Hydra's ``.hydra/`` and ``mlptrain.log``). The promises kept here:

* **One writer.** :meth:`RunDirectory.lock` takes an exclusive ``flock`` on the directory itself for the whole run: a
  second process (a second run, a resume of the same run) is refused at once, naming the process that holds it. The
  kernel drops the lock when its process dies, so a killed run never blocks its resume, and taking it writes nothing.
* **Nothing changes before a run is accepted.** Everything that inspects the directory
  (:meth:`holds_run`, :meth:`newer_last`, :meth:`temp_files`) only reads; the files are written
  by the run after every check passed (:func:`mlptrain.run.run.train`).
* **Nothing is written outside the folder or over a file that is not the run's** (:meth:`refuse_unsafe`, before
  anything is read or written): a folder inside mlptrain's cache (a rebuilt entry would take it), one that holds the
  run's own data file, a non-empty folder that holds no mlptrain run (a data folder: its ``metrics.csv`` would be
  overwritten), a ``metrics.csv`` or ``run.json`` that mlptrain did not write, and a symbolic link in place of any
  file or folder the run writes (``mlptrain.log``, ``metrics.csv``, ``checkpoints``...: the run would write through
  it, outside the folder) are each refused with one line; the appends open their files with ``O_NOFOLLOW``
  (:func:`mlptrain.base.fs.open_append`) all the same, and every rewrite renames a new file over the old name, which
  replaces a link, never follows it.
* **A stray temp file** left by a writer that was killed mid-write is removed, and reported, at
  the next start (:meth:`remove_temp_files`).
* **Messages name the settings of whoever started the run** (:class:`FrontEnd`): ``hydra.run.dir``
  and a command to paste from the CLI, ``out_dir`` and ``cfg.resume`` from Python.
* **The other ranks' runs** (data parallel: every rank trains, rank 0 writes the run) go into
  private folders in the temp directory, removed when the rank ends; those of ranks that were
  killed are removed by the next rank that starts on the host (:func:`follower_dir`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlptrain.base.errors import CheckpointError, OutputError
from mlptrain.base.fs import TEMP_GLOB, atomic_write, cache_root
from mlptrain.config import shell
from mlptrain.run import checkpoint
from mlptrain.run.checkpoint import CHECKPOINT_DIR, Position

log = logging.getLogger(__name__)

METRICS = "metrics.jsonl"
RUN_RECORD = "run.json"
CSV_NAME = "metrics.csv"  # mlptrain.run.sinks
TENSORBOARD_DIR = "tensorboard"  # mlptrain.run.sinks
LOG_FILE = "mlptrain.log"  # written by the CLI (mlptrain.cli.main) and the launcher's ranks
HYDRA_DIR = ".hydra"
CORRUPT = METRICS + ".corrupt"  # mlptrain.run.metrics: damaged lines set aside on resume
MEMBERS_TABLE, FOLDS_REPORT, OOF_PREDICTIONS = "members.md", "folds.json", "oof_predictions.csv"  # run.ensemble, folds
REPORTS = (MEMBERS_TABLE, FOLDS_REPORT, OOF_PREDICTIONS)  # an ensemble's reports, written when its run ends
# every name the run writes in its folder (and in checkpoints/): none may be a symbolic link
WRITTEN = (METRICS, RUN_RECORD, CSV_NAME, TENSORBOARD_DIR, LOG_FILE, HYDRA_DIR, CORRUPT, CHECKPOINT_DIR, *REPORTS)
CHECKPOINTS_WRITTEN = ("last.npz", "best.npz")
FOLLOWER_PREFIX = "mlptrain-rank"  # <temp dir>/mlptrain-rank<rank>-pid<pid>-<random>/


@dataclass(frozen=True)
class FrontEnd:
    """Who started the run, so that a message names the settings the user has: the CLI's or Python's.

    ``launch``: from the CLI, the overrides that say how this process runs (``device=cpu``), which a
    command to continue the run repeats (the run's own settings come from its checkpoint).
    """

    cli: bool = False
    launch: tuple[str, ...] = ()

    @property
    def dir_arg(self) -> str:
        """The setting that chooses the run directory."""
        return "hydra.run.dir" if self.cli else "out_dir"

    def resume_command(self, out_dir: Path | None, resume: str = "last") -> str:
        """How to continue from ``resume`` into ``out_dir`` (None: a new directory, for the user to name):
        a command to paste (CLI), or the call (Python)."""
        if self.cli:
            where = shell.override("hydra.run.dir", str(out_dir)) if out_dir else "hydra.run.dir=<new directory>"
            return shell.command(["python -m mlptrain", where, shell.override("resume", resume)], self.launch)
        return f"train(cfg, out_dir={str(out_dir) if out_dir else '<new directory>'!r}) with cfg.resume={resume!r}"


class RunDirectory:
    """The folder of one run (``hydra.run.dir``; ``out_dir`` of :func:`mlptrain.run.run.train`)."""

    def __init__(self, path: Path, front: FrontEnd | None = None) -> None:
        self.path = Path(path)
        self.front = front or FrontEnd()
        self.checkpoints = self.path / CHECKPOINT_DIR
        self.metrics = self.path / METRICS
        self._lock_fd: int | None = None

    def checkpoint(self, name: str) -> Path:
        return self.checkpoints / f"{name}.npz"

    # --- one writer -------------------------------------------------------------------------

    def create(self) -> bool:
        """Create the folder if it does not exist; returns whether this call created it.

        Raises:
            OutputError: it cannot be created (read-only, below a regular file, disk full).
        """
        if self.path.is_dir():
            return False
        try:
            self.path.mkdir(parents=True)
        except OSError as exc:
            raise OutputError(
                f"cannot create the output directory {self.path} ({type(exc).__name__}: {exc}); choose a "
                f"writable {self.front.dir_arg}"
            ) from exc
        return True

    @contextlib.contextmanager
    def lock(self) -> Iterator[RunDirectory]:
        """Hold the directory's exclusive lock for the ``with`` block.

        Raises:
            OutputError: another process holds it (its pid is named where Linux tells it).
        """
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError as exc:
            raise OutputError(
                f"cannot open the output directory {self.path} ({exc}); choose another {self.front.dir_arg}"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise OutputError(f"cannot lock the output directory {self.path} ({exc})") from exc
            holder = _lock_holder(self.path)
            raise OutputError(
                f"output directory {self.path} is in use by another mlptrain process"
                f"{f' (pid {holder})' if holder else ''}; wait for it to finish or stop it, or choose another "
                f"{self.front.dir_arg} (nothing was changed)"
            ) from None
        self._lock_fd = fd
        try:
            yield self
        finally:
            self._lock_fd = None
            os.close(fd)  # closing the last descriptor drops the lock

    def remove_if_empty(self) -> bool:
        """Remove the folder if it is empty and no run holds it (a refused run that created it)."""
        try:
            with self.lock():
                if any(self.path.iterdir()):
                    return False
                self.path.rmdir()
                return True
        except OSError:
            return False

    # --- what the directory holds (read only) -----------------------------------------------

    def holds_run(self) -> list[str]:
        """What a fresh run here would overwrite: ``metrics.jsonl`` (non-empty) and checkpoints."""
        found = [METRICS] if self.metrics.is_file() and self.metrics.stat().st_size > 0 else []
        return found + [f"{CHECKPOINT_DIR}/{p.name}" for p in sorted(self.checkpoints.glob("*.npz"))]

    def refuse_overwrite(self, resume: str = "last") -> None:
        """Raise OutputError if the directory holds a run's metrics or checkpoints; the message says how to
        continue from ``resume`` (here, or into a new directory from another run's checkpoint)."""
        found = self.holds_run()
        if found:
            where = "continue it" if resume == "last" else f"continue {resume} in a new {self.front.dir_arg}"
            raise OutputError(
                f"output directory {self.path} already holds a run ({', '.join(found)}) and nothing was changed; "
                f"choose a new {self.front.dir_arg}, or {where} with: {self.front.resume_command(self.path, resume)}"
            )

    def newer_last(self, path: Path, pos: Position) -> None:
        """Raise CheckpointError if resuming from ``path`` would overwrite a newer ``last.npz`` beside it."""
        last = Path(path).parent / "last.npz"
        if Path(path).resolve() == last.resolve() or not last.is_file():
            return
        try:
            newer = checkpoint.load(last).position.step
        except CheckpointError:
            return  # an unreadable last.npz holds nothing to protect
        if newer > pos.step:
            raise CheckpointError(
                f"resuming from {path} (step {pos.step}) in its own run directory would overwrite {last} (step "
                f"{newer}) and the metrics after step {pos.step}; resume into a new directory instead: "
                f"{self.front.resume_command(None, str(path))}"
            )

    def refuse_unsafe(self, inputs: list[Path] | tuple[Path, ...] = ()) -> None:
        """Raise OutputError if the run would write outside the folder or over a file that is not its own.

        ``inputs``: the run's data files. Reads only; called before anything is written (and before the
        data is read). What is refused is listed in the module's docstring.
        """
        here = self.path.resolve()
        fix = f"choose another {self.front.dir_arg} (nothing was changed)"
        cache = cache_root().expanduser().resolve()
        if here == cache or cache in here.parents:
            raise OutputError(
                f"output directory {self.path} is inside mlptrain's cache {cache} ($MLPTRAIN_DATA, $XDG_CACHE_HOME), "
                f"whose entries are rebuilt and removed; {fix}"
            )
        for data in inputs:
            resolved = Path(data).expanduser().resolve()
            if here in resolved.parents:
                raise OutputError(
                    f"output directory {self.path} holds the run's data file {data}; a run writes into a folder of its "
                    f"own, never beside (or over) its input: {fix}"
                )
        for rel in self._links():
            raise OutputError(
                f"output directory {self.path}: {rel} is a symbolic link (to {os.readlink(self.path / rel)}); a run "
                f"writes only its own files there, never through a link: remove the link, or {fix}"
            )
        names = sorted(p.name for p in self.path.iterdir()) if self.path.is_dir() else []
        if names and not self.is_run():
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            raise OutputError(
                f"output directory {self.path} is not empty ({shown}) and holds no mlptrain run; a run writes into an "
                f"empty directory or its own run's, never over other files: {fix}"
            )
        for name, own in ((CSV_NAME, _own_csv), (RUN_RECORD, _own_record)):
            if (self.path / name).exists() and not own(self.path / name):
                raise OutputError(
                    f"output directory {self.path} holds {name}, which is not mlptrain's; the run would overwrite "
                    f"it: move it away, or {fix}"
                )

    def _links(self) -> list[str]:
        """The names the run writes (:data:`WRITTEN`, :data:`CHECKPOINTS_WRITTEN`) that are symbolic links."""
        found = [name for name in WRITTEN if (self.path / name).is_symlink()]
        if CHECKPOINT_DIR not in found:
            found += [f"{CHECKPOINT_DIR}/{n}" for n in CHECKPOINTS_WRITTEN if (self.checkpoints / n).is_symlink()]
        return found

    def is_run(self) -> bool:
        """Whether the folder holds an mlptrain run (or the start of one): its metrics, checkpoints, run record
        or the CLI's ``.hydra/``."""
        return any((self.path / n).exists() for n in (METRICS, CHECKPOINT_DIR, HYDRA_DIR)) or _own_record(
            self.path / RUN_RECORD
        )

    def temp_files(self) -> list[Path]:
        """Temporary files of writers that died mid-write (``*.tmp``), in the run and its checkpoints."""
        return sorted([*self.path.glob(TEMP_GLOB), *self.checkpoints.glob(TEMP_GLOB)])

    # --- writing (after the run was accepted) -----------------------------------------------

    def remove_temp_files(self) -> None:
        """Remove the temp files a killed writer left behind, saying so."""
        for tmp in self.temp_files():
            try:
                tmp.unlink()
                log.warning("removed %s, the temporary file of a write that was interrupted", tmp)
            except OSError as exc:
                log.warning("could not remove the stray temporary file %s (%s)", tmp, exc)

    def make_checkpoint_dir(self) -> None:
        try:
            self.checkpoints.mkdir(exist_ok=True)
        except OSError as exc:
            raise OutputError(
                f"cannot create {self.checkpoints} ({type(exc).__name__}: {exc}); choose a writable "
                f"{self.front.dir_arg}"
            ) from exc

    def write_json(self, name: str, record: dict[str, Any]) -> None:
        """Write ``record`` to ``name`` in the run directory, atomically."""
        path = self.path / name
        try:
            atomic_write(path, json.dumps(record, indent=2) + "\n")
        except OSError as exc:
            raise OutputError(
                f"cannot write {path} ({type(exc).__name__}: {exc}); choose a writable {self.front.dir_arg}"
            ) from exc


def _own_csv(path: Path) -> bool:
    """Whether ``path`` is a ``metrics.csv`` of mlptrain's (its header: ``kind,epoch,step,train/loss``), or empty."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            head = f.readline()
    except OSError:
        return False
    return head == "" or head.startswith("kind,epoch,step,train/loss")


def _own_record(path: Path) -> bool:
    """Whether ``path`` is a ``run.json`` of mlptrain's (a JSON object naming the mlptrain version)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and "mlptrain" in record


def _lock_holder(path: Path) -> int | None:
    """The pid holding a ``flock`` on ``path``, from ``/proc/locks`` (Linux), or None."""
    try:
        inode = os.stat(path).st_ino
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()  # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"
            if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
                return int(fields[4])
    except (OSError, ValueError):
        pass
    return None


def follower_dir(rank: int, tmp: Path | None = None) -> Path:
    """A new private folder for rank ``rank``'s copy of the run (a rank other than 0), named by host and process.

    Checkpoints of a large model go there, gigabytes each. A rank removes its folder when it ends;
    one that was killed (SIGKILL by the launcher, or by a scheduler) cannot, so first the folders it
    left are removed (:func:`remove_stale_follower_dirs`).
    """
    import tempfile

    tmp = Path(tmp or tempfile.gettempdir())
    remove_stale_follower_dirs(tmp)
    return Path(tempfile.mkdtemp(prefix=f"{FOLLOWER_PREFIX}{rank}-{_host()}-pid{os.getpid()}-", dir=tmp))


def remove_stale_follower_dirs(tmp: Path) -> list[Path]:
    """Remove the follower folders in ``tmp`` that a killed rank left; returns them.

    A folder goes only if all of these hold: its name is a follower folder's of this host (a temp
    directory shared between hosts or containers holds others' too), it is a real folder (not a
    link) of this user, the process named in it no longer exists, and no process holds the lock of
    the run inside it (every rank holds its run's lock while it trains). A reused pid keeps a folder,
    never loses one.
    """
    import re
    import shutil
    import stat

    removed = []
    for path in tmp.glob(f"{FOLLOWER_PREFIX}*-pid*-*"):
        m = re.fullmatch(rf"{FOLLOWER_PREFIX}\d+-([A-Za-z0-9._]+)-pid(\d+)-\w+", path.name)
        try:
            st = path.lstat()
            if (
                not m
                or m.group(1) != _host()
                or not stat.S_ISDIR(st.st_mode)
                or st.st_uid != os.getuid()
                or _alive(int(m.group(2)))
                or _locked(path / "run")
            ):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            log.info("removed %s, left by a rank that was killed", path)
            removed.append(path)
    return removed


def _host() -> str:
    """This host's name as it goes into a folder name (no dashes: they separate the fields)."""
    import re
    import socket

    return re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname()) or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _locked(run: Path) -> bool:
    """Whether a process holds ``run``'s directory lock (:meth:`RunDirectory.lock`); False if there is no ``run``."""
    try:
        fd = os.open(run, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # (releases the lock if it was taken)
    return False
