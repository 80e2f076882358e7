"""The recipes' shared commopt options (recipes/common.py): parsing and the run label."""

import argparse

import pytest

from recipes import common


def parse(*argv):
    parser = argparse.ArgumentParser()
    common.add_commopt_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "mode", "label"),
    [
        ((), False, "fp32"),
        (("--double-buffering",), True, "fp32+comp"),
        (("--double-buffering", "stale"), "stale", "fp32+stale"),
        (("--double-buffering", "compensated"), "compensated", "fp32+comp"),
        (
            ("--double-buffering", "compensated", "--no-synchronous-embeddings"),
            "compensated",
            "fp32+comp+stale-embeddings",
        ),
        (
            ("--double-buffering", "compensated", "--no-synchronous-vectors"),
            "compensated",
            "fp32+comp+stale-vectors",
        ),
        (("--compression", "qsgd4+ef", "--double-buffering"), True, "qsgd4+ef+comp"),
    ],
)
def test_double_buffering_modes(argv, mode, label):
    args = parse(*argv)
    assert args.double_buffering == mode
    assert common.config_label(args) == label


def test_unknown_double_buffering_mode_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse("--double-buffering", "sometimes")
    assert "takes no value, 'compensated' or 'stale'" in capsys.readouterr().err
