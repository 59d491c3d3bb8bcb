"""Datasets on the host: loading, verifying, splitting and normalising, in NumPy only.

================ ==================================================================
module           what it owns
================ ==================================================================
``dataset``      :class:`Dataset`: the splits as host arrays
``sources``      the built-in datasets: ``digits`` (bundled, SHA-256 checked), ``mnist1d``
                 (generated offline), ``mnist`` and ``fashion_mnist`` (downloaded), ``synthetic``
``idx``          the IDX format and the verifying downloader of MNIST and Fashion-MNIST
``prepare``      :func:`load_dataset`: a name to a :class:`Dataset`, split and :func:`preprocess`-ed
                 (normalised; a regression's targets standardised): the one path of every dataset
``files``        ``data=file``: :func:`read_table` of CSV/TSV, NPZ and Parquet into a :class:`Table`
``csv_reader``   CSV and TSV by NumPy: the header and row checks (shared with Arrow)
``arrow_reader`` CSV by Arrow's multi-threaded parser, and Parquet
``npz_reader``   NPZ files: ``x``, ``y``, the test split, the feature names
``labels``       target cells as every reader normalises them: stripped, missing, numbers typed
``files_source`` a file's table as the data of a run: labels or regression targets, checked
``cache``        a parsed file as NumPy arrays, keyed by its content, checked on every read
``cache_entry``  an entry's folder: renamed into place, removed file by file, stale temporaries swept
``chunks``       passes over a table in row chunks on every core: finiteness, gather and normalise,
                 the phases' timing in the log
``stats``        per-column mean, variance, min and max in one chunked pass (Chan et al.'s merge)
================ ==================================================================

Nothing here imports CuPy: :mod:`mlptrain.loader` moves the arrays to the device.
"""

from mlptrain.data.dataset import Dataset, Normalization
from mlptrain.data.idx import CHECKSUMS, IDX_FILES, MIRRORS, FileSpec, read_idx, write_idx
from mlptrain.data.prepare import DATASETS, load_dataset, preprocess, stratified_split

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
    "stratified_split",
    "write_idx",
]
