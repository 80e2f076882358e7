"""Command lines for the recipes' tests: ResNet-50 runs small enough for a test."""

from __future__ import annotations


def cli_args(**options: object) -> list[str]:
    """``--name value`` pairs in the order given (``a_b`` becomes ``--a-b``).

    >>> cli_args(image_size=32, progress="none")
    ['--image-size', '32', '--progress', 'none']
    """
    argv: list[str] = []
    for name, value in options.items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


def tiny_resnet(
    *, preset: str | None = "smoke", train_size: int = 16, val_size: int = 8, **more: object
) -> list[str]:
    """The ResNet-50 recipe on 32-pixel images in batches of 4, no progress bar, then ``more``.

    >>> tiny_resnet(train_size=8, val_size=4, max_steps=1)[-6:]
    ['--val-size', '4', '--progress', 'none', '--max-steps', '1']
    """
    head = cli_args(preset=preset) if preset else []
    return head + cli_args(
        image_size=32,
        batch_size=4,
        train_size=train_size,
        val_size=val_size,
        progress="none",
        **more,
    )
