"""The command line's first contact: a bare command, optimizer names."""

from __future__ import annotations

import pytest

from frugal_kernels.__main__ import build_parser, main


def test_a_bare_command_lists_the_commands(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert all(command in out for command in ("demo", "train", "sweep", "bench"))


@pytest.mark.parametrize("argv,suggested", [
    (["demo", "--optimizers", "adamw", "frugl"], "'frugal'"),
    (["train", "--optimizer", "adafrugall"], "'adafrugal'"),
    (["sweep", "--lrs", "1e-3", "--optimizers", "badm"], "'badam'"),
])
def test_a_wrong_optimizer_name_gets_a_suggestion(argv, suggested, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1
    assert "unknown optimizer" in err[0] and f"did you mean {suggested}" in err[0]


def test_optimizer_names_are_case_insensitive():
    parser = build_parser()
    args = parser.parse_args(["demo", "--optimizers", "AdamW", "FRUGAL", "AdaFRUGAL+Governor"])
    assert args.optimizers == ["adamw", "frugal", "adafrugal+governor"]
    assert parser.parse_args(["train", "--optimizer", "BAdam"]).optimizer == "badam"
