"""The real tasks of `commopt bench to_accuracy`: data, model and batches, all offline.

Both are communication-bound on a 1 Gbit/s link between 2 ranks: tens of millions of
parameters, most in one ``hidden x hidden`` matrix, for little compute per sample.

- ``text``: the wide character MLP of ``recipes/text_lm/wide.py`` (16 characters of context,
  embedded and concatenated, two hidden layers; 21.4M parameters at hidden 4096) predicting
  the next character of Python's help topics (``pydoc_data.topics``, fixed train/valid split).
- ``digits``: scikit-learn's ``load_digits`` (1797 real 8x8 hand-written digits shipped with
  the package; the stratified 1437/360 split of ``recipes/digits_parity.py``) learned by a
  wide MLP (64 pixels, two hidden layers, 10 classes; 17.1M parameters at hidden 4096); each
  training batch is drawn with replacement and shifted by up to one pixel (the same shift for
  the whole batch), so the curve keeps falling for hundreds of steps instead of memorising.

Runs from a checkout (the data loaders live in ``recipes/``).

    >>> sorted(TASKS)
    ['digits', 'text']
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn


class TextTask:
    """Next character of Python's help topics, the wide character MLP."""

    name = "text"
    unit = "nats/char"

    def __init__(self, args) -> None:
        from recipes.text_lm.data import char_corpus
        from recipes.text_lm.wide import next_char_valid

        self.args = args
        self.corpus = char_corpus()
        self.valid = next_char_valid(self.corpus.valid, args.context, args.valid_windows)

    @staticmethod
    def describe(args) -> str:
        return (
            f"wide char MLP (context {args.context}, hidden {args.hidden}) on Python's help topics"
        )

    def build(self) -> nn.Module:
        from recipes.text_lm.wide import WideCharMLP

        return WideCharMLP(
            self.corpus.vocab_size, context=self.args.context, hidden=self.args.hidden
        )

    def batch(self, gen: torch.Generator):
        from recipes.text_lm.wide import next_char_batch

        return next_char_batch(self.corpus.train, self.args.batch, self.args.context, gen)


class DigitsTask:
    """scikit-learn's digits, a wide MLP, batches shifted by up to one pixel."""

    name = "digits"
    unit = "nats"

    def __init__(self, args) -> None:
        self.args = args
        x_train, y_train, x_test, y_test = digits_split()
        self.train = (x_train, y_train)
        self.valid = (x_test, y_test)

    @staticmethod
    def describe(args) -> str:
        return f"wide MLP (64-{args.hidden}-{args.hidden}-10) on scikit-learn's digits"

    def build(self) -> nn.Module:
        from torch import nn

        hidden = self.args.hidden
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(64, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 10),
        )

    def batch(self, gen: torch.Generator):
        import torch
        import torch.nn.functional as F

        x, y = self.train
        idx = torch.randint(0, len(y), (self.args.batch,), generator=gen)
        dx, dy = torch.randint(0, 3, (2,), generator=gen).tolist()
        shifted = F.pad(x[idx], (1, 1, 1, 1))[:, :, dy : dy + 8, dx : dx + 8]
        return shifted, y[idx]


def digits_split():
    """(x_train, y_train, x_test, y_test) of scikit-learn's digits: images (N, 1, 8, 8) in
    [0, 1], the stratified 80/20 split with ``random_state=0`` (recipes/digits_data.py)."""
    from recipes.digits_data import load_digits_split

    return load_digits_split()


TASKS: dict[str, Any] = {"text": TextTask, "digits": DigitsTask}
