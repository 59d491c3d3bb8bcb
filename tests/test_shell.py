"""Suggested commands are what a shell passes to Hydra unchanged (mlptrain.config.shell)."""

from __future__ import annotations

import shlex

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from mlptrain.config.shell import command, hydra_value, override


@pytest.mark.parametrize(
    "value",
    [
        [512, 512],
        [],
        True,
        False,
        None,
        0.001,
        5,
        "digits",
        "my data.csv",
        "it's",
        "a,b",
        "[x]",
        "true",
        "C:\\d",
        "end\\",
        "q\\'x",
    ],
)
def test_an_override_survives_the_shell_and_hydras_parser(value: object) -> None:
    word = override("k", value)
    (argv,) = [shlex.split(word)]  # what bash or zsh hands the program
    assert len(argv) == 1
    parsed = OverridesParser.create().parse_override(argv[0])
    assert parsed.key_or_group == "k"
    got = parsed.value()
    assert (list(got) if isinstance(value, list) else got) == value


def test_lists_are_written_without_spaces_and_quoted_for_the_shell() -> None:
    assert hydra_value([512, 512]) == "[512,512]"
    assert override("model.hidden", [512, 512]) == "'model.hidden=[512,512]'"
    assert override("epochs", 5) == "epochs=5"


def test_a_command_quotes_each_override_as_it_needs() -> None:
    line = command(["python", "-m", "mlptrain"], {"epochs": 5, "data.path": "my data.csv"})
    assert shlex.split(line) == ["python", "-m", "mlptrain", "epochs=5", "data.path='my data.csv'"]
    assert command(["python -m mlptrain"], ["model.hidden=[64,64]", "seed=1"]) == (
        "python -m mlptrain 'model.hidden=[64,64]' seed=1"
    )
