"""Issue #47: nothing is written outside the run folder or over an input, and the data cache keeps its word.

A link planted in a run folder, a run folder that is a data folder or lies in the cache, a cache
entry left half-written or with swapped metadata, a FIFO or a device given as data: each is refused
with one line before anything is written, or found and rebuilt, never trained on or written through.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mlptrain.base import fs as files
from mlptrain.base.errors import OutputError
from mlptrain.config.schema import DatasetName
from mlptrain.data.files import cache
from mlptrain.run.metrics import MetricsWriter
from mlptrain.run.run import train
from tests.helpers import make_cfg
from tests.test_reliability import REPO, snapshot

DATA_ROWS = 60


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MLPTRAIN_DATA", str(tmp_path / "cache"))
    return tmp_path / "cache"


def write_csv(path: Path, n: int = DATA_ROWS, features: int = 3, seed: int = 0, names: tuple = ("cat", "dog")) -> Path:
    x = np.random.default_rng(seed).standard_normal((n, features))
    lines = [",".join([*(f"f{j}" for j in range(features)), "label"])]
    lines += [",".join([*(repr(v) for v in row), names[i % 3 == 0]]) for i, row in enumerate(x.tolist())]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_cli(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "HYDRA_MAIN_MODULE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "mlptrain", "device=cpu", "progress=false", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# --- 6. a FIFO or a device as data ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_fifo_or_a_device_as_data_is_one_line_and_the_process_exits(tmp_path: Path, kind: str) -> None:
    if kind == "fifo":
        path, what = tmp_path / "d.csv", "a FIFO"
        os.mkfifo(path)
    else:
        path, what = Path("/dev/zero"), "a character device"
    proc = run_cli("data=file", f"data.path={path}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = f"error: data.path={path} is {what}, not a regular file; set data.path to a data file"
    assert proc.stderr.startswith(line) and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "run").exists()


def test_the_cache_never_hashes_a_fifo_or_a_device(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "d.csv")
    # a reader thread on these would read forever: the hash refuses them before a byte is read
    assert cache.source_of(tmp_path / "d.csv") is None
    assert cache.source_of("/dev/zero") is None
    with pytest.raises(OSError, match="a character device, not a regular file"):
        cache.sha256_file(Path("/dev/zero"))


# --- 4. no partial cache entry is left behind --------------------------------------------------------


def temps(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in (cache_dir / "tables").glob("*.tmp"))


def test_a_cache_write_over_ulimit_f_leaves_no_temporary_entry(tmp_path: Path, cache_dir: Path) -> None:
    path = write_csv(tmp_path / "d.csv", n=3000, features=20)  # x: 480 kB, over the 64 kB limit
    code = (
        "import resource, sys\n"
        "from mlptrain.data.files import cache\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        f"table, _ = cache.read_cached({str(path)!r}, 'label')\n"
        "print(table.x.shape)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLPTRAIN_DATA": str(cache_dir)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "(3000, 20)\n", proc.stdout + proc.stderr
    assert "could not cache the parsed data file" in proc.stderr, proc.stderr  # EFBIG: Python ignores SIGXFSZ
    assert temps(cache_dir) == [] and list((cache_dir / "tables").iterdir()) == []


def test_a_failed_rename_leaves_no_temporary_entry(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mlptrain.data")
    path = write_csv(tmp_path / "d.csv")
    real_rename, real_replace = os.rename, os.replace

    def refuse(move):  # a rename of a temporary entry into place fails (EXDEV, EACCES, ENOSPC...)
        def rename(src, dst, *a, **k):
            if str(src).endswith(".tmp") and Path(src).parent == cache_dir / "tables":
                raise OSError(13, "Permission denied (test)")
            return move(src, dst, *a, **k)

        return rename

    monkeypatch.setattr(os, "rename", refuse(real_rename))
    monkeypatch.setattr(os, "replace", refuse(real_replace))
    table, _ = cache.read_cached(path, "label")
    assert table.x.shape == (DATA_ROWS, 3)
    assert "Permission denied (test)" in caplog.text
    assert temps(cache_dir) == [] and list((cache_dir / "tables").iterdir()) == []


def test_the_temporary_entries_of_dead_writers_are_swept_and_a_live_writers_kept(
    tmp_path: Path, cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mlptrain.data")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    tables = cache_dir / "tables"
    key = "0123456789abcdef01234567"
    left = {
        f"{key}.{dead_pid}.tmp": ["train_x.npy"],  # SIGKILL mid-write (the names of mlptrain before #47 too)
        f"{key}.{dead_pid}.deadbeef.tmp": ["train_x.npy", "meta.json"],
        f"{key}.{dead_pid}.feedf00d.old.tmp": ["train_y.npy"],  # killed between the two renames
        f"{key}.{os.getpid()}.cafebabe.tmp": ["train_x.npy"],  # a writer alive now
        f"{key}.{dead_pid}.0badf00d.tmp": ["train_x.npy", "notes.txt"],  # holds something the cache never writes
    }
    for name, names in left.items():
        (tables / name).mkdir(parents=True)
        for f in names:
            (tables / name / f).write_bytes(b"partial")
    old = tables / f"{key}.{os.getpid()}.0000beef.tmp"  # alive (a reused pid?) but older than the bound
    old.mkdir()
    os.utime(old, (0, 0))
    cache.read_cached(write_csv(tmp_path / "d.csv"), "label")
    assert temps(cache_dir) == sorted([f"{key}.{dead_pid}.0badf00d.tmp", f"{key}.{os.getpid()}.cafebabe.tmp"])
    assert sorted(p.name for p in (tables / f"{key}.{dead_pid}.0badf00d.tmp").iterdir()) == ["notes.txt"]
    assert caplog.text.count("left half-written by a writer that died") == 4, caplog.text


# --- 5. the metadata is under a checksum, and belongs to the file ------------------------------------


def test_swapped_feature_names_in_meta_json_are_found_and_the_entry_rebuilt(
    tmp_path: Path, cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mlptrain.data")
    path = write_csv(tmp_path / "d.csv")
    first, _ = cache.read_cached(path, "label")
    (folder,) = [p for p in (cache_dir / "tables").iterdir()]
    meta = json.loads((folder / "meta.json").read_text())
    meta["parts"]["train"]["features"] = ["f2", "f1", "f0"]
    (folder / "meta.json").write_text(json.dumps(meta))
    table, _ = cache.read_cached(path, "label")
    assert table.feature_names == ["f0", "f1", "f2"]
    np.testing.assert_array_equal(table.x, first.x)
    assert "meta.json fails its checksum" in caplog.text and "rebuilt" in caplog.text, caplog.text
    assert json.loads((folder / "meta.json").read_text())["parts"]["train"]["features"] == ["f0", "f1", "f2"]


def test_the_entry_of_another_target_in_its_place_is_not_trained_on(
    tmp_path: Path, cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mlptrain.data")
    path = write_csv(tmp_path / "d.csv", names=("1", "2"))  # numbers: the label column can be a feature too
    cache.read_cached(path, "label")
    (label_entry,) = [p for p in (cache_dir / "tables").iterdir()]
    f2, _ = cache.read_cached(path, "f2")  # the same file, another target: another entry
    (f2_entry,) = [p for p in (cache_dir / "tables").iterdir() if p != label_entry]
    for f in label_entry.iterdir():  # the label entry, whole and consistent, where f2's was
        shutil.copy(f, f2_entry / f.name)
    table, _ = cache.read_cached(path, "f2")
    assert table.target_names == ["f2"] and table.feature_names == ["f0", "f1", "label"]
    np.testing.assert_array_equal(table.y, f2.y)
    assert "meta.json fails its checksum" in caplog.text, caplog.text


# --- 3. a rebuild removes only what the cache wrote ----------------------------------------------------


def test_a_rebuild_never_deletes_a_folder_put_in_the_entry(
    tmp_path: Path, cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mlptrain.data")
    path = write_csv(tmp_path / "d.csv")
    cache.read_cached(path, "label")
    (folder,) = [p for p in (cache_dir / "tables").iterdir()]
    (folder / "run").mkdir()
    (folder / "run" / "metrics.jsonl").write_text('{"kind": "step"}\n')
    write_csv(path, seed=1)  # changed: the entry is stale and would be rebuilt
    table, _ = cache.read_cached(path, "label")
    np.testing.assert_array_equal(table.x, np.random.default_rng(1).standard_normal((DATA_ROWS, 3)))
    assert (folder / "run" / "metrics.jsonl").read_text() == '{"kind": "step"}\n'
    assert "holds run, which the cache did not write; the entry is left as it is" in caplog.text, caplog.text
    assert temps(cache_dir) == []


# --- 1. never through a link planted in the run folder -----------------------------------------------


@pytest.fixture
def finished(tmp_path: Path) -> Path:
    """A run of 1 epoch (digits), to resume with epochs=2."""
    run = tmp_path / "run"
    train(make_cfg(epochs=1), run)
    return run


LINKED = [
    "metrics.csv",
    "metrics.jsonl",
    "run.json",
    "mlptrain.log",
    "checkpoints",
    "checkpoints/last.npz",
    "tensorboard",
    ".hydra",
]


@pytest.mark.parametrize("name", LINKED)
def test_a_link_planted_in_the_run_folder_is_refused_before_anything_is_written(
    tmp_path: Path, finished: Path, name: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    planted = finished / name
    if name in ("checkpoints", "tensorboard", ".hydra"):
        target = outside / "folder"
        shutil.copytree(planted, target) if planted.exists() else target.mkdir()
    else:
        target = outside / "precious"
        target.write_bytes(planted.read_bytes() if planted.exists() else b"precious\n")
    shutil.rmtree(planted) if planted.is_dir() else planted.unlink(missing_ok=True)
    planted.symlink_to(target)
    before, outside_before = snapshot(finished), snapshot(outside)
    with pytest.raises(OutputError) as err:
        train(make_cfg(epochs=2, resume="last"), finished)
    assert str(err.value) == (
        f"output directory {finished}: {name} is a symbolic link (to {target}); a run writes only its own files "
        "there, never through a link: remove the link, or choose another out_dir (nothing was changed)"
    )
    assert snapshot(finished) == before and snapshot(outside) == outside_before


def test_the_cli_resume_never_appends_to_a_linked_mlptrain_log(tmp_path: Path, finished: Path) -> None:
    outside = tmp_path / "precious.txt"
    outside.write_text("precious\n")
    (finished / "mlptrain.log").symlink_to(outside)
    proc = run_cli("resume=last", "epochs=2", f"hydra.run.dir={finished}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"error: output directory {finished}: mlptrain.log is a symbolic link (to {outside}); a run writes only its "
        "own files there, never through a link: remove the link, or choose another hydra.run.dir (nothing was "
        "changed)"
    )
    assert "Traceback" not in proc.stderr and proc.stderr.count("error:") == 1, proc.stderr
    assert outside.read_text() == "precious\n" and not (finished / ".hydra").exists()


def test_the_appends_never_follow_a_link_whatever_was_checked_before(tmp_path: Path) -> None:
    outside = tmp_path / "precious.txt"
    outside.write_text("precious\n")
    (tmp_path / "metrics.jsonl").symlink_to(outside)
    with pytest.raises(OutputError, match="Too many levels of symbolic links"):
        MetricsWriter(tmp_path / "metrics.jsonl")
    (tmp_path / "mlptrain.log").symlink_to(outside)
    with pytest.raises(OSError) as err:
        files.log_file_handler(tmp_path / "mlptrain.log")
    assert err.value.errno == errno.ELOOP and outside.read_text() == "precious\n"
    from mlptrain.cli import main as cli
    from mlptrain.run import rundir

    assert cli.LOG_FILE == rundir.LOG_FILE


# --- 2. and 3. a run folder that is not the run's: a data folder, the cache ----------------------------


def test_a_run_folder_that_holds_its_data_file_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    path = write_csv(data / "d.csv")
    (data / "metrics.csv").write_text("id,score\n1,0.5\n")
    cfg = make_cfg(epochs=1)
    cfg.data.name, cfg.data.path = DatasetName.file, str(path)
    before = snapshot(data)
    with pytest.raises(OutputError) as err:
        train(cfg, data)
    assert str(err.value) == (
        f"output directory {data} holds the run's data file {path}; a run writes into a folder of its own, never "
        "beside (or over) its input: choose another out_dir (nothing was changed)"
    )
    assert snapshot(data) == before


def test_a_non_empty_folder_that_holds_no_run_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "metrics.csv").write_text("id,score\n1,0.5\n")
    (folder / "notes.txt").write_text("mine\n")
    before = snapshot(folder)
    with pytest.raises(OutputError) as err:
        train(make_cfg(epochs=1), folder)
    assert str(err.value) == (
        f"output directory {folder} is not empty (metrics.csv, notes.txt) and holds no mlptrain run; a run writes "
        "into an empty directory or its own run's, never over other files: choose another out_dir (nothing was "
        "changed)"
    )
    assert snapshot(folder) == before


def test_a_metrics_csv_that_is_not_mlptrains_is_never_overwritten(tmp_path: Path, finished: Path) -> None:
    (finished / "metrics.csv").write_text("id,score\n1,0.5\n")  # a file of the user's, under the run's name
    with pytest.raises(OutputError, match=r"holds metrics.csv, which is not mlptrain's; the run would overwrite it"):
        train(make_cfg(epochs=2, resume="last"), finished)
    assert (finished / "metrics.csv").read_text() == "id,score\n1,0.5\n"


def test_a_run_folder_with_files_of_the_users_resumes(tmp_path: Path, finished: Path) -> None:
    (finished / "notes.txt").write_text("mine\n")  # a plot, a note, predictions: the run never writes them
    summary = train(make_cfg(epochs=2, resume="last"), finished)
    assert summary["epochs"] == 2 and (finished / "notes.txt").read_text() == "mine\n"
    assert (finished / "metrics.csv").read_text().startswith("kind,epoch,step,train/loss")


def test_a_run_folder_inside_the_cache_is_refused(tmp_path: Path, cache_dir: Path) -> None:
    run = cache_dir / "tables" / "0123456789abcdef01234567" / "run"
    with pytest.raises(OutputError) as err:
        train(make_cfg(epochs=1), run)
    assert str(err.value) == (
        f"output directory {run} is inside mlptrain's cache {cache_dir} ($MLPTRAIN_DATA, $XDG_CACHE_HOME), whose "
        "entries are rebuilt and removed; choose another out_dir (nothing was changed)"
    )
    assert not run.exists()
