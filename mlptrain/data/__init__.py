"""Datasets and their loaders: loading, verifying, splitting and normalising, in NumPy only.

======================== ==================================================================
module                   what it owns
======================== ==================================================================
``dataset``              :class:`Dataset`: the splits as host arrays
``sources``              the built-in datasets: ``digits`` (bundled, SHA-256 checked), ``mnist1d``
                         (generated offline), ``mnist`` and ``fashion_mnist`` (downloaded), ``synthetic``
``idx``                  the IDX format and the verifying downloader of MNIST and Fashion-MNIST
``prepare``              :func:`load_dataset`: a name to a :class:`Dataset`, split and :func:`preprocess`-ed
                         (normalised; a regression's targets standardised): the one path of every dataset
``files.readers``        ``data=file``: :func:`read_table` of CSV/TSV, NPZ and Parquet into a :class:`Table`
``files.csv_reader``     CSV and TSV by NumPy: the header and row checks (shared with Arrow)
``files.arrow_reader``   CSV by Arrow's multi-threaded parser, and Parquet
``files.npz_reader``     NPZ files: ``x``, ``y``, the test split, the feature names
``files.labels``         target cells as every reader normalises them: stripped, missing, numbers typed
``user_source``          a file's table as the data of a run: labels or regression targets, checked
``files.cache``          a parsed file as NumPy arrays, keyed by its content, checked on every read
``cache_entry``          an entry's folder: renamed into place, removed file by file, stale temporaries swept
``files.chunks``         passes over a table in row chunks on every core: finiteness, gather and normalise,
                         the phases' timing in the log
``files.column_stats``   per-column mean, variance, min and max in one chunked pass (Chan et al.'s merge)
``rows``                 a split streamed from its table, normalised per batch (``data.residency=stream``)
``loader``               ``DataLoader``: a split on the device, batches gathered there
``host_loader``          ``HostLoader`` (``data.residency=host``): a split in host memory
``prefetch``             ``Pipe``: a producer thread and a ring of slots (``host_loader``'s)
``cuda/``                the loaders' GPU half: ``gather``, ``upload``, ``host_loader``
======================== ==================================================================

The datasets are host arrays, in NumPy only; the loaders move their batches to the device, their
CuPy half in ``cuda/``.
"""

from mlptrain.data.dataset import Dataset, Normalization
from mlptrain.data.idx import CHECKSUMS, IDX_FILES, MIRRORS, FileSpec, read_idx, write_idx
from mlptrain.data.prepare import DATASETS, load_dataset, preprocess, stratified_folds, stratified_split

__all__ = [
    "CHECKSUMS",
    "DATASETS",
    "IDX_FILES",
    "MIRRORS",
    "Dataset",
    "FileSpec",
    "Normalization",
    "load_dataset",
    "preprocess",
    "read_idx",
    "stratified_folds",
    "stratified_split",
    "write_idx",
]
