"""A data file read into a :class:`Table`: one reader per format, labels, the cache, chunked passes.

=================== ================================================================
module              what it owns
=================== ================================================================
``readers``         ``FORMATS`` (suffix -> kind) and :func:`read_table` of CSV/TSV, NPZ and Parquet
``csv_reader``      CSV and TSV by NumPy: the header and row checks (shared with Arrow)
``arrow_reader``    CSV by Arrow's multi-threaded parser, and Parquet
``npz_reader``      NPZ files: ``x``, ``y``, the test split, the feature names
``table``           :class:`Table`: one file's rows as a reader returns them
``labels``          target cells as every reader normalises them
``cache``           a parsed file as NumPy arrays, keyed by its content, checked on every read
``chunks``          passes over a table in row chunks on every core
``column_stats``    per-column mean, variance, min and max in one chunked pass
=================== ================================================================
"""
