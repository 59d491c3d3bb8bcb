"""The settings' dotted keys, and the real key for a key that is none (``learning_rate`` -> ``optimizer.lr``).

:func:`suggest` is what every "is not a setting" message ends with. It knows the names users bring
from Keras, PyTorch Lightning and scikit-learn (:data:`ALIASES`), a setting put in the wrong group
(``model.weight_decay`` is ``optimizer.weight_decay``) and, last, a near miss in spelling
(``optimizer.lrr``). With the value the user gave, the suggestion is the override to paste
(:func:`mlptrain.config.shell.override`)::

    >>> suggest("learning_rate", 0.1)
    '; use optimizer.lr=0.1'
    >>> suggest("model.hidden_layers", [64, 64])
    "; use 'model.hidden=[64,64]'"
"""

from __future__ import annotations

import difflib
from dataclasses import fields, is_dataclass
from typing import Any

from mlptrain.config.schema import TrainConfig
from mlptrain.config.shell import hydra_value, override

# Names of other frameworks (and plain English) for mlptrain's settings, by the key's last part.
ALIASES: dict[str, str] = {
    **dict.fromkeys(["learning_rate", "lr_rate", "learningrate", "eta", "lr0", "base_lr"], "optimizer.lr"),
    **dict.fromkeys(["n_epochs", "num_epochs", "max_epochs", "nb_epoch", "nb_epochs", "epoch", "n_epoch"], "epochs"),
    **dict.fromkeys(["hidden_layers", "hidden_sizes", "hidden_size", "hidden_dims", "hidden_dim"], "model.hidden"),
    **dict.fromkeys(["hidden_layer_sizes", "hidden_units", "layers", "units", "widths", "layer_sizes"], "model.hidden"),
    **dict.fromkeys(
        ["batch", "batchsize", "bs", "mini_batch_size", "minibatch_size", "train_batch_size"], "data.batch_size"
    ),
    **dict.fromkeys(["wd", "l2", "weightdecay", "decay", "weight_decay"], "optimizer.weight_decay"),
    "lr": "optimizer.lr",  # (ensemble.lr and ensemble.weight_decay are per-member lists: not what is meant)
    **dict.fromkeys(["scheduler", "lr_scheduler", "lr_schedule", "schedule"], "optimizer.schedule"),
    **dict.fromkeys(["warmup", "warmup_iters", "warmup_epochs"], "optimizer.warmup_steps"),
    **dict.fromkeys(["early_stopping_patience", "patience"], "early_stopping.patience"),
    **dict.fromkeys(["validation_split", "val_split", "validation_fraction", "val_size"], "data.val_fraction"),
    **dict.fromkeys(["test_split", "test_size"], "data.test_fraction"),
    **dict.fromkeys(["max_iters", "num_steps", "total_steps", "max_iterations", "steps"], "max_steps"),
    **dict.fromkeys(["random_state", "random_seed", "rng_seed"], "seed"),
    **dict.fromkeys(["label", "labels", "label_column", "target_column", "y", "targets"], "data.target"),
    **dict.fromkeys(["train_path", "train_file", "file", "csv", "dataset_path"], "data.path"),
    **dict.fromkeys(["test_file", "test_csv"], "data.test_path"),
    **dict.fromkeys(["accelerator", "devices_type"], "device"),
    **dict.fromkeys(["num_gpus", "n_gpus", "gpus", "devices"], "distributed.gpus"),
    **dict.fromkeys(["log_every_n_steps", "log_interval", "log_freq"], "log_every"),
    **dict.fromkeys(["ckpt_path", "resume_from_checkpoint", "checkpoint"], "resume"),
    **dict.fromkeys(["criterion", "loss_fn", "loss_function"], "model.loss"),
    **dict.fromkeys(["act", "activation_fn", "nonlinearity"], "model.activation"),
}


def all_keys(node: Any = None, prefix: str = "") -> list[str]:
    """Every setting of the schema, as dotted keys (``optimizer.lr``)."""
    node = TrainConfig if node is None else node
    out = []
    for f in fields(node):
        sub = f.default_factory() if callable(f.default_factory) else None  # type: ignore[misc]
        out += all_keys(sub, f"{prefix}{f.name}.") if is_dataclass(sub) else [f"{prefix}{f.name}"]
    return out


def real_key(key: str) -> tuple[str | None, bool]:
    """The setting meant by ``key``, which is none, and whether that is sure (an alias, the same name in
    another group) or a guess from the spelling; ``(None, False)`` when nothing is close."""
    keys = all_keys()
    leaf = key.rsplit(".", 1)[-1].lower().replace("-", "_")
    if leaf in ALIASES and ALIASES[leaf] != key:
        return ALIASES[leaf], True
    same_name = [k for k in keys if k.rsplit(".", 1)[-1] == leaf and k != key]
    if len(same_name) == 1:  # model.weight_decay, batch_size: the setting lives in another group
        return same_name[0], True
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    return (close[0], False) if close else (None, False)


_NO_VALUE = object()


def suggest(key: str, value: Any = _NO_VALUE) -> str:
    """What to write instead of ``key``, to end a message: ``; use optimizer.lr=0.1`` (sure),
    ``; did you mean optimizer.lr=0.1?`` (a near miss; without ``value``, or with one that Hydra reads only in
    quotes such as ``none``: ``; did you mean data.normalize?``), else where the settings are listed."""
    real, sure = real_key(key)
    if real is None:
        return "; python -m mlptrain --help lists the settings"
    # A value Hydra reads only in its own quotes ('none') would be quoted again for the shell ('"'"'): the key alone
    quoted = value is _NO_VALUE or hydra_value(value).startswith("'")
    fix = real if quoted else override(real, value)
    return f"; use {fix}" if sure else f"; did you mean {fix}?"
