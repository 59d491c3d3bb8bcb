"""Composing conf/ with the typed schema: every group option, and the errors of bad input."""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from mlptrain.base.errors import ConfigError, MlptrainError
from mlptrain.cli.main import CONF_DIR, compose_config
from mlptrain.config.schema import DatasetName, Mode, Task, TrainConfig, flatten, to_plain
from mlptrain.step.checks import validate
from mlptrain.step.optim import OPTIMIZERS
from mlptrain.step.precision import PRECISIONS

GROUPS = ("model", "data", "optimizer", "execution", "precision")
GROUP_FILES = sorted(CONF_DIR.glob("*/*.yaml"))

# Groups whose options are the values of an enum or the names of a registry, and the key that selects it.
ENUM_GROUPS: dict[str, tuple[str, list[str]]] = {
    "data": ("name", [m.value for m in DatasetName]),
    "optimizer": ("name", list(OPTIMIZERS.names())),
    "execution": ("mode", [m.value for m in Mode]),
    "precision": ("name", list(PRECISIONS.names())),
}


def plain(v: object) -> object:
    """Enum members as their values, so composed values compare with the YAML."""
    if isinstance(v, Enum):
        return v.value
    if isinstance(v, list):
        return [plain(x) for x in v]
    return v


def test_conf_dir_holds_every_group() -> None:
    assert (CONF_DIR / "config.yaml").is_file()
    assert {p.parent.name for p in GROUP_FILES} == set(GROUPS)


def test_defaults() -> None:
    cfg = compose_config()
    assert isinstance(cfg, TrainConfig)
    assert cfg.model.hidden == [128, 128]
    assert cfg.data.name is DatasetName.digits
    assert cfg.optimizer.name == "sgd"
    assert (cfg.optimizer.lr, cfg.optimizer.momentum) == (0.05, 0.9)
    assert cfg.execution.mode is Mode.fused
    assert cfg.precision.name == "fp32"


def set_by(path: Path) -> dict[str, object]:
    """``dotted key -> value`` of what a group file sets: a ``# @package _global_`` file's keys from the config's
    root (conf/data/file.yaml sets epochs, early stopping), any other's under its group; its defaults list and
    interpolations (resolved when composed) left out."""
    loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    assert isinstance(loaded, dict) and loaded, f"{path} sets nothing"
    loaded.pop("defaults", None)
    rooted = path.read_text().startswith("# @package _global_")
    flat = flatten(loaded if rooted else {path.parent.name: loaded})
    return {k: v for k, v in flat.items() if not (isinstance(v, str) and v.startswith("${"))}


def dotted(cfg: object, key: str) -> object:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("path", GROUP_FILES, ids=lambda p: f"{p.parent.name}={p.stem}")
def test_every_group_option_composes(path: Path) -> None:
    group, option = path.parent.name, path.stem
    needs = {"data=file": ["data.path=train.csv"]}  # the settings an option cannot do without
    cfg = compose_config([f"{group}={option}", *needs.get(f"{group}={option}", [])])
    node = getattr(cfg, group)
    for key, value in set_by(path).items():
        assert plain(dotted(cfg, key)) == value, f"{group}={option}: {key}"
    if group in ENUM_GROUPS:
        name_key, _ = ENUM_GROUPS[group]
        assert plain(getattr(node, name_key)) == option, f"{path} must set {name_key}: {option}"


TABLE = ["data=file", "data.path=train.csv"]
# A table's recipe (conf/data/file.yaml), scikit-learn's MLPClassifier's: Adam at 1e-3, up to 200 epochs, early
# stopping on a 10% validation split with patience 10, batches of min(200, n) (the loader: one batch of all the
# rows where fewer), two hidden layers of 128 (the reference pipeline); early stopping on the validation
# loss and PyTorch's initialisation, as measured on benchmarks/bench_tables.py's tables.
TABLE_RECIPE = {
    "optimizer.name": "adam",
    "optimizer.lr": 0.001,
    "epochs": 200,
    "early_stopping.patience": 10,
    "early_stopping.metric": "val/loss",
    "model.init": "torch",
    "data.val_fraction": 0.1,
    "data.batch_size": 200,
    "model.hidden": [128, 128],
    "model.loss": "cross_entropy",
}


def test_data_file_composes_a_tables_recipe() -> None:
    cfg = flatten(to_plain(compose_config(TABLE)))
    assert {k: cfg[k] for k in TABLE_RECIPE} == TABLE_RECIPE
    assert compose_config([*TABLE, "data.task=regression"]).model.loss == "mse"  # the task's loss
    # no validation split: the training loss (val/loss would be refused before training)
    assert compose_config([*TABLE, "data.val_fraction=0"]).early_stopping.metric == "train/loss"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["optimizer=sgd"], {"optimizer.name": "sgd", "optimizer.lr": 0.05, "optimizer.momentum": 0.9}),
        (["optimizer.lr=0.01", "epochs=30"], {"optimizer.name": "adam", "optimizer.lr": 0.01, "epochs": 30}),
        (["early_stopping.patience=0", "data.batch_size=64"], {"early_stopping.patience": 0, "data.batch_size": 64}),
        (["model.init=he", "early_stopping.metric=val/acc"], {"model.init": "he", "early_stopping.metric": "val/acc"}),
        (["data.task=regression", "model.loss=cross_entropy"], {"model.loss": "cross_entropy"}),  # refused later
        (["data.task=classification", "model.loss=mse"], {"model.loss": "mse"}),
    ],
)
def test_the_command_line_wins_over_a_tables_recipe(overrides: list[str], expected: dict[str, object]) -> None:
    cfg = flatten(to_plain(compose_config([*TABLE, *overrides])))
    assert {k: cfg[k] for k in expected} == expected


def test_digits_keeps_its_recipe() -> None:
    """The default run (make run: data=digits) is the schema's defaults, key for key: SGD at 0.05 with momentum
    0.9, 20 epochs, no early stopping, batches of 64; data=file's recipe does not leak into it."""
    want = flatten(to_plain(TrainConfig()))
    assert want["optimizer.name"] == "sgd" and want["epochs"] == 20 and want["early_stopping.patience"] == 0
    for overrides in ([], ["data=digits"], ["data=digits", "optimizer=sgd"]):
        assert flatten(to_plain(compose_config(overrides))) == want, overrides


def test_help_shows_a_tables_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    from mlptrain.cli.help import settings_help

    lines = settings_help(values=OmegaConf.structured(compose_config([*TABLE, "data.task=regression"])))
    shown = {line.split(" = ")[0].strip(): line.split(" = ")[1].split()[0] for line in lines.splitlines()}
    assert shown["optimizer.name"] == "adam" and shown["epochs"] == "200" and shown["model.loss"] == "mse"
    assert shown["early_stopping.patience"] == "10" and shown["data.task"] == Task.regression.value


@pytest.mark.parametrize("group", sorted(ENUM_GROUPS))
def test_enum_groups_have_one_file_per_value(group: str) -> None:
    _, names = ENUM_GROUPS[group]
    assert {p.stem for p in (CONF_DIR / group).glob("*.yaml")} == set(names)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["execution=naive"], {"execution.mode": Mode.naive}),
        (["optimizer=adamw"], {"optimizer.name": "adamw", "optimizer.weight_decay": 0.01}),
        (["optimizer=adam", "optimizer.lr=0.01"], {"optimizer.lr": 0.01}),
        (["model=wide"], {"model.hidden": [4096, 4096, 4096]}),
        (["model.hidden=[32]", "data.batch_size=7"], {"model.hidden": [32], "data.batch_size": 7}),
        (["precision=bf16", "seed=3", "device=cpu"], {"precision.name": "bf16", "seed": 3}),
    ],
)
def test_overrides(overrides: list[str], expected: dict[str, object]) -> None:
    cfg = compose_config(overrides)
    for dotted, value in expected.items():
        obj: object = cfg
        for part in dotted.split("."):
            obj = getattr(obj, part)
        assert obj == value, dotted


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("foo=1", "Key 'foo' not in 'TrainConfig'"),
        ("optimizer.lr=abc", "could not be converted to Float"),
        ("data.batch_size=1.5", "could not be converted to Integer"),
        ("model.hidden=[128,x]", "could not be converted to Integer"),
        ("execution.mode=fast", "expected one of [fused, naive]"),
        ("optimizer.betas=1", "Key 'betas' not in 'OptimizerConfig'"),
    ],
)
def test_bad_value_fails_at_compose(override: str, message: str) -> None:
    with pytest.raises(ConfigCompositionException) as info:
        compose_config([override])
    text = f"{info.value} {info.value.__cause__}"
    assert message in text


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.activation=tanh", "model.activation='tanh' is unknown; expected one of relu, gelu, none"),
        ("model.loss=l1", "model.loss='l1' is unknown; expected one of cross_entropy, mse"),
        ("optimizer.name=lion", "optimizer.name='lion' is unknown; expected one of sgd, adam, adamw"),
        ("precision.name=fp4", "precision.name='fp4' is unknown; expected one of fp64, fp32, tf32, fp16, bf16, fp8"),
    ],
)
def test_a_name_no_registry_holds_fails_the_checks(override: str, message: str) -> None:
    """The settings that name a registered option are str in the schema: the checks refuse an unknown name."""
    with pytest.raises(ConfigError) as info:
        compose_config([override])
    assert message in str(info.value)


@pytest.mark.parametrize("group", ["execution", "data", "optimizer", "model", "precision"])
def test_unknown_group_option_lists_the_options(group: str) -> None:
    with pytest.raises(MissingConfigException) as info:
        compose_config([f"{group}=bogus"])
    text = str(info.value)
    assert f"Could not find '{group}/bogus'" in text
    for path in (CONF_DIR / group).glob("*.yaml"):
        assert path.stem in text


def test_typo_in_group_file_fails_at_compose(tmp_path: Path) -> None:
    # A user config folder added to the search path, holding a group file with a typo key.
    (tmp_path / "execution").mkdir()
    (tmp_path / "execution" / "typo.yaml").write_text("mod: naive\n")
    with pytest.raises(ConfigCompositionException) as info:
        compose_config([f"hydra.searchpath=[file://{tmp_path}]", "execution=typo"])
    assert "Key 'mod' not in 'ExecutionConfig'" in f"{info.value} {info.value.__cause__}"


def test_user_group_file_is_usable(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tiny.yaml").write_text("hidden: [8]\n")
    cfg = compose_config([f"hydra.searchpath=[file://{tmp_path}]", "model=tiny"])
    assert cfg.model.hidden == [8]


def test_validate_lists_every_problem() -> None:
    with pytest.raises(ConfigError) as info:
        compose_config(["optimizer.lr=-1", "data.batch_size=0"])
    text = str(info.value)
    assert "optimizer.lr=-1.0" in text
    assert "data.batch_size=0" in text
    assert isinstance(info.value, MlptrainError)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("optimizer.lr=0", "optimizer.lr"),
        ("optimizer.lr=-0.1", "optimizer.lr"),
        ("data.batch_size=0", "data.batch_size"),
        ("data.batch_size=-4", "data.batch_size"),
        ("model.hidden=[128,0]", "model.hidden[1]"),
        ("epochs=0", "epochs"),
    ],
)
def test_validate_rejects_non_positive(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"(^|\W){re.escape(key)}="):
        compose_config([override])


def test_validate_accepts_defaults_and_returns_its_argument() -> None:
    cfg = TrainConfig()
    assert validate(cfg) is cfg


# --- a configuration never ignores what was said ------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+optimizer.lrr=0.1"], "optimizer.lrr is not a setting; did you mean optimizer.lr=0.1?"),
        (["+model.hiden=[8]"], "model.hiden is not a setting; did you mean 'model.hidden=[8]'?"),
        (
            ["data.features=1024"],
            "data.features=1024 is not used with data=digits: it applies to data=synthetic (a count) and data=file "
            "(a list of columns)",
        ),
        (["optimizer=adam", "optimizer.momentum=0.5"], "optimizer.momentum=0.5 is not used with optimizer=adam"),
        (["optimizer.beta2=0.99"], "optimizer.beta2=0.99 is not used with optimizer=sgd: it applies to optimizer=adam"),
        (["execution=naive", "execution.bgrad=bgradb"], "execution.bgrad=bgradb is not used with execution=naive"),
        (["device=cpu", "execution.autotune=true"], "execution.autotune=true is not used with device=cpu"),
        (["device=cpu", "graph=true"], "graph=true is not used with device=cpu: it applies to the GPU"),
        (["precision.init_scale=1024"], "precision.init_scale=1024.0 is not used with precision=fp32"),
        (["precision.compute_copy=cast"], "precision.compute_copy=cast is not used with precision=fp32: it applies to"),
        (["optimizer.schedule=constant", "optimizer.min_lr_ratio=0.1"], "is not used with optimizer.schedule=constant"),
        (["data=mnist", "data.test_fraction=0.3"], "data.test_fraction=0.3 is not used with data=mnist, which has a"),
        (["data.path=x.csv"], "data.path=x.csv is not used with data=digits: it applies to data=file"),
        (["data=synthetic", "data.root=/tmp"], "data.root=/tmp is not used with data=synthetic"),
        (["data=file"], "data=file needs data.path=<the training file>"),
    ],
)
def test_a_setting_that_would_be_ignored_is_an_error(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose_config(overrides)
    assert message in str(info.value)


def test_settings_that_apply_are_accepted() -> None:
    compose_config(["data=synthetic", "data.features=1024"])
    compose_config(["optimizer=adam", "optimizer.beta2=0.99", "precision=fp16", "precision.init_scale=1024"])
    compose_config(["precision=bf16", "precision.compute_copy=cast"])
    compose_config(["data=file", "data.path=x.csv", "data.target=[a,b]", "data.test_fraction=0.3"])
    compose_config(["optimizer.momentum=0.9", "data.features=32"])  # the defaults: nothing was said


def test_an_attribute_set_from_python_is_checked_too() -> None:
    cfg = TrainConfig()
    cfg.optimizer.lrr = 0.1  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="optimizer.lrr is not a setting; did you mean optimizer.lr=0.1"):
        validate(cfg)


@pytest.mark.parametrize(
    ("key", "value", "fix"),
    [
        ("optimizer.learning_rate", 0.1, "; use optimizer.lr=0.1"),  # not optimizer.min_lr_ratio (#27.6)
        ("learning_rate", 0.1, "; use optimizer.lr=0.1"),
        ("optimizer.lr_rate", 0.1, "; use optimizer.lr=0.1"),
        ("n_epochs", 5, "; use epochs=5"),
        ("num_epochs", 5, "; use epochs=5"),
        ("trainer.max_epochs", 5, "; use epochs=5"),
        ("model.hidden_layers", [512, 512], "; use 'model.hidden=[512,512]'"),
        ("hidden_sizes", [64], "; use 'model.hidden=[64]'"),
        ("batch", 32, "; use data.batch_size=32"),
        ("batch_size", 32, "; use data.batch_size=32"),
        ("model.weight_decay", 0.01, "; use optimizer.weight_decay=0.01"),
        ("lr", 0.1, "; use optimizer.lr=0.1"),
        ("validation_split", 0.2, "; use data.val_fraction=0.2"),
        ("random_state", 3, "; use seed=3"),
        ("optimizer.lrr", 0.1, "; did you mean optimizer.lr=0.1?"),  # a guess from the spelling: asked
        ("bogus", 1, "; python -m mlptrain --help lists the settings"),
    ],
)
def test_an_unknown_key_is_answered_with_the_real_key_to_paste(key: str, value: object, fix: str) -> None:
    from mlptrain.config.keys import suggest

    assert suggest(key, value) == fix
