"""From a dataset name to a :class:`Dataset`: splits, normalisation and target scaling, in NumPy only.

:func:`preprocess` is the one preprocessing path: :func:`load_dataset` (``data=<name>``) and a
:class:`Dataset` built in Python (``mlptrain.train(cfg, out_dir, dataset=...)``) both go through it,
so both are normalised from their train split as ``data.normalize`` says, and a regression's
targets are standardised as ``data.target_scaling`` says, unless the dataset brings its own.

All randomness comes from a ``numpy.random.Generator`` seeded by ``data.split_seed``, so the
splits (and synthetic data) depend on nothing else: the run's ``seed`` changes the initial weights
and the data order, not the test set. This package never imports CuPy: :mod:`mlptrain.data.loader`
moves the arrays to the device.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from mlptrain.base.errors import ConfigError, DatasetError
from mlptrain.base.registry import joined
from mlptrain.config.schema import NORMALIZATIONS, DataConfig
from mlptrain.data.dataset import Dataset, Normalization, Raw
from mlptrain.data.files import chunks
from mlptrain.data.files.column_stats import QuantileMap, column_stats, robust
from mlptrain.data.files.plan import ColumnPlan, fit_plan, log_empty, log_suspects, suspect_columns
from mlptrain.data.files.weights import training_weights
from mlptrain.data.rows import NormalisedRows, StreamSource, host_memory_available, memory_mapped
from mlptrain.data.sources import SOURCES

log = logging.getLogger(__name__)

DATASETS = tuple(SOURCES)
# data.residency=auto or host streams the splits (mlptrain.data.rows) from a memory-mapped table whose
# normalised float32 splits would take more than this share of the host memory available.
STREAM_SHARE = 0.5


def stratified_split(y: np.ndarray, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Split indices of ``y`` into ``(keep, taken)`` with each class's share kept in both parts.

    ``round(N * fraction)`` indices are taken (at least one when ``fraction > 0``), shared among the
    classes in proportion to their counts by the largest-remainder rule.

    Args:
        y: ``(N,)`` integer labels (a regression passes one label for all: a plain random split).
        fraction: Share of samples to take, in ``[0, 1)``.
        rng: Source of the shuffles.

    Returns:
        Two int64 index arrays, each in random order, together a permutation of ``arange(N)``.
    """
    n = len(y)
    k = 0 if fraction <= 0 else max(1, round(n * fraction))
    if k >= n:
        raise ConfigError(f"a split fraction of {fraction} takes {k} of {n} samples and leaves none to train on")
    classes, counts = np.unique(y, return_counts=True)
    quota = counts * (k / n)  # (K,) ideal share per class
    take = np.floor(quota).astype(np.int64)
    take[np.argsort(take - quota, kind="stable")[: k - int(take.sum())]] += 1  # largest remainders first
    keep, taken = [], []
    for cls, t in zip(classes, take, strict=True):
        idx = rng.permutation(np.flatnonzero(y == cls))
        taken.append(idx[:t])
        keep.append(idx[t:])
    return rng.permutation(np.concatenate(keep)), rng.permutation(np.concatenate(taken))


def stratified_folds(y: np.ndarray, folds: int, rng: np.random.Generator) -> np.ndarray:
    """The fold ``(N,)`` int64 in ``[0, folds)`` of each row of ``y``, each class dealt over the folds in turn.

    Each class's rows, shuffled, go to the folds round-robin, starting where the last class stopped: every
    fold gets each class's count to within one row, and the fold sizes differ by at most one row. A regression
    passes one label for all (plain random folds).
    """
    if not 2 <= folds <= len(y):
        raise ConfigError(f"ensemble.folds={folds} needs 2 <= folds <= {len(y)} (the rows to split)")
    out = np.empty(len(y), dtype=np.int64)
    start = 0
    for cls in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == cls))
        out[idx] = (start + np.arange(len(idx))) % folds
        start = (start + len(idx)) % folds
    return out


def normalization(
    method: str,
    x: np.ndarray,
    rows: np.ndarray | None = None,
    where: str = "",
    *,
    seed: int = 0,
    binary: np.ndarray | None = None,
) -> Normalization:
    """The normalisation of ``method`` from the train split's statistics: ``x[rows]`` (``x (N, F)``;
    ``rows`` None: all of ``x``), in one chunked pass (:func:`mlptrain.data.files.column_stats.column_stats`);
    ``robust`` and ``quantile`` also take percentiles (:mod:`mlptrain.data.files.column_stats`, their samples
    seeded by ``seed``) of the columns that vary and are not ``binary`` (``(F,)`` bool: the column plan's
    0/1 columns, :meth:`ColumnPlan.binary`). In every mode the ``binary`` columns stay 0/1
    (:meth:`~mlptrain.data.files.column_stats.ColumnStats.shift_scale`).

    Raises:
        DatasetError: an inf or NaN among those rows (``where`` names them: ``dataset 'x' split train``).
    """
    f = x.shape[1]
    if method == "none":
        return Normalization.identity(f)
    if method not in NORMALIZATIONS:
        raise ConfigError(f"data.normalize={method!r} is not a normalisation; expected {joined(NORMALIZATIONS, 'or')}")
    st = column_stats(x, rows, extremes=True)  # (F,) each, float64
    if st.nonfinite is not None:
        row, col = st.nonfinite
        value = x[row if rows is None else rows[row], col]
        raise DatasetError(
            f"{where}: row {row}, column {col} holds {value}; features must be finite numbers (remove or fill the "
            "missing values)"
        )
    if method in ("standard", "minmax"):
        return Normalization(method, *st.shift_scale(method, binary), "train split")
    assert st.low is not None and st.high is not None  # asked for: extremes=True
    shift, scale = st.shift_scale("standard", binary)  # the constant and 0/1 columns keep these
    cols = np.flatnonzero((st.low != st.high) & ~(np.zeros(f, bool) if binary is None else binary))  # (K,)
    if method == "robust":
        shift[cols], scale[cols] = robust(x, rows, cols, st.std[cols], seed)
        return Normalization(method, shift, scale, "train split")
    shift[cols], scale[cols] = 0.0, 1.0  # the map's outputs are standard normal already
    mapping = QuantileMap.fit(x, rows, cols, seed) if len(cols) else None
    return Normalization(method, shift, scale, "train split", mapping)


def target_scaling(method: str, y_train: np.ndarray) -> Normalization:
    """A regression's targets standardised from the train split: ``(y - mean) / std`` per target, ``y_train (N, T)``.

    Each target on its own, in float64, whatever its spread (no floor, none relative to the others: a price
    and a rate are both scaled); a constant target is shifted to exactly 0 and not scaled.
    """
    if method == "none":
        return Normalization.identity(y_train.shape[1])
    if method != "standard":
        raise ConfigError(f"data.target_scaling={method!r} is not a target scaling; expected standard or none")
    return Normalization(method, *column_stats(y_train, extremes=True).shift_scale(method), "train split")


def task_for_loss(cfg: DataConfig, loss: str) -> DataConfig:
    """``cfg`` with the task that ``model.loss`` asks for: a file of ``data.task=auto`` trained with a regression loss
    (``mse``, any loss registered with ``regression=True``) is a regression, whatever its target holds (a column of
    whole numbers was taken for class labels: a 194-class classifier trained with ``mse``). Text targets are then
    refused, naming the way to one-hot classes (``data.task=classification``)."""
    from mlptrain.config.schema import Task
    from mlptrain.nn.losses import LOSSES

    name, task = (str(getattr(v, "value", v)) for v in (cfg.name, cfg.task))
    if name != "file" or task != "auto" or loss not in LOSSES or not LOSSES[loss].regression:
        return cfg
    log.info("data file %s: a regression (model.loss=%s, data.task=auto)", cfg.path, loss)
    return dataclasses.replace(cfg, task=Task.regression)


def _methods(cfg: DataConfig, name: str, task: str) -> tuple[str, str]:
    """``(data.normalize, data.target_scaling)`` as strings; a target scaling for a classification is refused."""
    method, scaling = (str(getattr(v, "value", v)) for v in (cfg.normalize, cfg.target_scaling))
    if task != "regression" and scaling != "standard":
        raise ConfigError(
            f"data.target_scaling={scaling}: dataset {name!r} is a classification; target scaling applies to "
            "regressions only (leave it at its default)"
        )
    return method, scaling


def preprocess(ds: Dataset, cfg: DataConfig) -> Dataset:
    """``ds`` normalised from its train split (``cfg.normalize``), and a regression's targets scaled
    (``cfg.target_scaling``), where it does not bring its own (:attr:`Dataset.normalization`,
    :attr:`Dataset.target_scaling`: then kept, and the log says so).

    Raises:
        ConfigError: ``data.target_scaling`` set for a classification, or an unknown method.
    """
    method, scaling = _methods(cfg, ds.name, ds.task)
    new: dict = {}
    if ds.normalization is None:
        with chunks.timed("statistics", ds.x_train.nbytes):
            norm = normalization(method, ds.x_train, where=f"dataset {ds.name!r} split train", seed=cfg.split_seed)
        splits = [getattr(ds, f"x_{s}") for s in ("train", "val", "test")]
        with chunks.timed("normalise", sum(4 * x.size for x in splits)):  # the float32 bytes written
            xs = [chunks.gather_normalised(x, None, norm.shift, norm.scale, mapped=norm.mapped) for x in splits]
        new.update(x_train=xs[0], x_val=xs[1], x_test=xs[2], normalization=norm)
    elif ds.normalization.origin == "dataset":  # the caller's own (a load_dataset result is preprocessed already)
        kept = ds.normalization.method
        log.info(
            "dataset %s: its own normalisation (%s) is kept; data.normalize=%s is not applied", ds.name, kept, method
        )
    if ds.task == "regression" and ds.target_scaling is None:
        ts = target_scaling(scaling, ds.y_train)
        new.update({f"y_{s}": ts.apply(getattr(ds, f"y_{s}")) for s in ("train", "val", "test")}, target_scaling=ts)
        how = "standardised" if ts.method == "standard" else "as given"
        shift, scale = (np.round(a, 4).tolist() for a in (ts.shift, ts.scale))
        log.info(
            "dataset %s: targets %s (shift %s, scale %s); outputs and losses in their units", ds.name, how, shift, scale
        )
    return dataclasses.replace(ds, **new) if new else ds


def load_dataset(cfg: DataConfig, seed: int | None = None) -> Dataset:
    """Load ``cfg.name``, split it with a generator seeded by ``cfg.split_seed`` and :func:`preprocess` it.

    Datasets without a test split of their own (digits, synthetic, a file without a test file)
    first lose a stratified ``test_fraction`` to the test split; then a stratified ``val_fraction`` of
    what remains becomes the validation split. Normalisation (and target scaling) statistics come
    from the train split only, and stay with the dataset (:attr:`Dataset.normalization`).

    Args:
        cfg: The data config; ``name`` and ``normalize`` may be enum members or plain strings.
        seed: Unused: the splits depend on ``cfg.split_seed`` alone (kept for old callers).

    Raises:
        DatasetError: unknown name, missing optional package, missing/corrupt/undownloadable files.
        ConfigError: fractions or normalisation out of range, too few samples to split.
    """
    name = str(getattr(cfg.name, "value", cfg.name))
    if name not in SOURCES:
        raise DatasetError(f"data.name={name!r} is not a dataset; expected one of {', '.join(DATASETS)}")
    if not (0.0 <= cfg.val_fraction < 1.0 and 0.0 < cfg.test_fraction < 1.0):
        raise ConfigError(
            f"data.val_fraction={cfg.val_fraction} and data.test_fraction={cfg.test_fraction}; "
            "expected [0, 1) and (0, 1)"
        )
    rng = np.random.default_rng([cfg.split_seed, 0xDA7A])  # a stream of its own, apart from init and data order
    raw = SOURCES[name](cfg, rng)
    method, _ = _methods(cfg, name, raw.task)
    with chunks.timed("split", raw.y.nbytes):
        parts = _split(name, cfg, raw, rng)  # [(x, rows, y)] of train, validation, test
    plan = None
    if raw.tables is not None:  # text cells: encoded by the column plan of the train split's rows
        plan, parts = encode_columns(raw, parts, cfg)
        raw = dataclasses.replace(raw, feature_names=plan.feature_names)
    rows = parts[0][1]
    norm = _train_columns(name, cfg, raw, parts[0][0], rows, plan, method)
    split_bytes = sum(4 * len(r if r is not None else xs) * xs.shape[1] for xs, r, _ in parts)  # as float32
    xs: list[Any]  # (n, F) float32 splits, made or streamed
    if _streams(cfg, name, parts, split_bytes):
        sources = {id(t): StreamSource.of(t) for t, _, _ in parts}  # one per file: its identity, one descriptor
        xs = [
            NormalisedRows(t, r, norm.shift, norm.scale, source=sources[id(t)], mapped=norm.mapped) for t, r, _ in parts
        ]
    else:
        with chunks.timed("normalise", split_bytes):
            xs = [chunks.gather_normalised(xs, r, norm.shift, norm.scale, mapped=norm.mapped) for xs, r, _ in parts]
    (_, _, y_tr), (_, _, y_val), (_, _, y_te) = parts
    split = Dataset(
        name,
        xs[0],
        y_tr,
        xs[1],
        y_val,
        xs[2],
        y_te,
        raw.num_classes,
        raw.class_names,
        raw.task,
        raw.feature_names,
        raw.target_names,
        normalization=norm,
        columns=None if plan is None else plan.to_meta(),
        w_train=None if raw.w is None else training_weights(raw.w, rows, str(cfg.weight), cfg.path),
    )  # normalised features, raw targets
    ds = preprocess(split, cfg)
    for write in raw.pending:  # the cache entry is complete when the dataset is returned
        write.result()
    log.info(
        "dataset %s: %d train, %d val, %d test, %d features, %d %s",
        name,
        len(ds.x_train),
        len(ds.x_val),
        len(ds.x_test),
        ds.num_features,
        raw.num_classes,
        "classes" if raw.task == "classification" else "targets",
    )
    return ds


def _train_columns(
    name: str, cfg: DataConfig, raw: Raw, x: np.ndarray, rows: np.ndarray, plan: ColumnPlan | None, method: str
) -> Normalization:
    """What the train split's columns say before training: for a user's file, a warning naming the columns that
    look like ids or free text (:func:`~mlptrain.data.files.plan.suspect_columns`); then the normalisation
    statistics (``method``) of the training ``rows`` of ``x (N, F)``, the file's rows in file order."""
    if name == "file" and raw.feature_names is not None:
        log_suspects(suspect_columns(x, raw.feature_names, plan, len(rows)), f"data file {cfg.path}")
    with chunks.timed("statistics", len(rows) * x.shape[1] * x.itemsize):
        binary = None if plan is None else plan.binary()  # (F,) the plan's 0/1 columns
        return normalization(method, x, rows, where=f"dataset {name!r} split train", seed=cfg.split_seed, binary=binary)


def encode_columns(raw: Raw, parts: list[tuple], cfg: DataConfig) -> tuple[ColumnPlan, list[tuple]]:
    """The column plan of ``raw.tables`` fitted on the train split's rows (``parts[0]``), and ``parts`` with each
    table's cells encoded by it (``(N, F)`` float64); the empty cells are counted in the log.

    Raises:
        ConfigError: ``data.residency=stream`` (:func:`_no_stream`).
    """
    assert raw.tables is not None
    train, test = raw.tables
    plan = fit_plan(train.cells, parts[0][1], list(cfg.categorical), int(cfg.min_frequency))
    if str(getattr(cfg.residency, "value", cfg.residency)) == "stream":
        raise _no_stream(cfg, [t for t in (train, test) if t is not None], len(plan.feature_names))
    encoded = {}
    for table in (t for t in (train, test) if t is not None):
        log_empty(table.cells, plan, f"data file {table.path}")
        encoded[id(table)], _ = plan.encode(table.cells, table.where, f"data file {table.path}")
    kinds = [c.kind for c in plan.columns]
    log.info(
        "data file %s: %d numeric and %d categorical columns -> %d features (the column plan, saved with the model)",
        cfg.path,
        kinds.count("numeric"),
        kinds.count("categorical"),
        len(plan.feature_names),
    )
    x, x_test = encoded[id(train)], encoded.get(id(test))
    return plan, [(x if xs is raw.x else x_test, rows, y) for xs, rows, y in parts]


def _no_stream(cfg: DataConfig, tables: list, features: int) -> ConfigError:
    """Why a table read through the column plan is not streamed (``data.residency=stream``), and what to do.

    Streaming keeps a table larger than host memory out of it; a table with a plan is read as text cells, whole,
    before the plan is fitted (:func:`mlptrain.data.files.cells.read_cells`): the text is in memory already, and
    it is larger than the float32 splits the plan makes (about 20x for 50,000 rows of 20 numbers of 17 digits
    and a category), so encoding each batch from it would save no memory. ``host`` holds the encoded splits.
    """
    text = sum(v.nbytes for t in tables for v in (t.cells or {}).values())
    encoded = 4 * features * sum(len(t.x) for t in tables)
    return ConfigError(
        f"data.residency=stream: data file {cfg.path} has columns encoded by the column plan (text, empty cells, "
        f"data.drop or data.features), which reads the table's cells into memory as text "
        f"({text / 2**20:.1f} MiB here, against {encoded / 2**20:.1f} MiB for the encoded float32 rows), so "
        "streaming its batches would save no memory; set data.residency=host (the encoded splits in host memory, "
        "each batch copied ahead of its step) or auto; a table larger than host memory streams once converted "
        "to numbers (an uncompressed NPZ of x, y and feature_names: docs/data.md, 'Data larger than the GPU')"
    )


def _streams(cfg: DataConfig, name: str, parts: list[tuple], split_bytes: int) -> bool:
    """Whether the splits are streamed from the table (:class:`NormalisedRows`) instead of made: asked for
    (``data.residency=stream``), or (``auto``, ``host``) a memory-mapped table whose normalised splits
    would take more than :data:`STREAM_SHARE` of the host memory available (logged)."""
    asked = str(getattr(cfg.residency, "value", cfg.residency))
    if asked == "stream":
        log.info("dataset %s: the splits are streamed from the table (data.residency=stream), not made", name)
        return True
    if asked not in ("auto", "host") or not all(memory_mapped(xs) for xs, _, _ in parts):
        return False
    available = host_memory_available()
    if split_bytes <= STREAM_SHARE * available:
        return False
    log.info(
        "dataset %s: its normalised splits (%.1f GB) would take more than %d%% of the host memory available "
        "(%.1f GB): streamed from the memory-mapped table as the batches need them (data.residency=stream)",
        name,
        split_bytes / 1e9,
        round(100 * STREAM_SHARE),
        available / 1e9,
    )
    return True


def _split(name: str, cfg: DataConfig, raw: Raw, rng: np.random.Generator) -> list[tuple]:
    """``[(x, rows, y)]`` of train, validation and test: each split is ``x[rows]`` (``rows`` None: all of
    ``x``), the test split stratified off (unless the source has one). No feature is copied here."""
    y = raw.y
    strata = y if raw.task == "classification" else np.zeros(len(y), np.int64)
    n, official_test = len(y), raw.x_test is not None
    try:
        keep = None
        if raw.x_test is None:
            keep, test = stratified_split(strata, cfg.test_fraction, rng)
            x_test, test_rows, y_test, strata = raw.x, test, y[test], strata[keep]
        else:
            x_test, test_rows, y_test = raw.x_test, None, raw.y_test
        train, val = stratified_split(strata, cfg.val_fraction, rng)
    except ConfigError as exc:
        raise ConfigError(
            f"dataset {name!r} has {n} samples for training, too few to split off data.val_fraction="
            f"{cfg.val_fraction}{'' if official_test else f' and data.test_fraction={cfg.test_fraction}'} "
            f"({exc}); {'raise data.samples or ' if name == 'synthetic' else ''}lower the fractions"
        ) from exc
    if keep is not None:
        train, val = keep[train], keep[val]  # rows of the table: x[keep][train] is x[keep[train]]
    y_dtype = np.int64 if raw.task == "classification" else np.float32
    return [(raw.x, train, y[train]), (raw.x, val, y[val]), (x_test, test_rows, np.asarray(y_test, y_dtype))]
