"""Datasets on the host: loading, verifying, splitting and normalising, in NumPy only.

=============== ==================================================================
module          what it owns
=============== ==================================================================
``dataset``     :class:`Dataset`: the splits as host arrays
``sources``     the built-in datasets: ``digits`` (bundled, SHA-256 checked), ``mnist1d``
                (generated offline), ``mnist`` and ``fashion_mnist`` (downloaded), ``synthetic``
``idx``         the IDX format and the verifying downloader of MNIST and Fashion-MNIST
``prepare``     :func:`load_dataset`: a name to a :class:`Dataset`, split and :func:`preprocess`-ed
                (normalised; a regression's targets standardised): the one path of every dataset
=============== ==================================================================

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
