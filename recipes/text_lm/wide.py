"""A wide character MLP: tens of millions of parameters for little compute per step.

The last ``context`` characters, embedded and concatenated, go through two wide hidden layers
to the next character's logits. Most parameters sit in the ``hidden x hidden`` layer, so the
fp32 gradient (about 4 bytes x parameters) dominates a data-parallel step on a slow link while
the compute per sample stays small: the communication-bound task of
``commopt bench to_accuracy``.

    >>> import torch
    >>> from recipes.text_lm.wide import WideCharMLP
    >>> m = WideCharMLP(vocab_size=98, context=8, embed=16, hidden=64)
    >>> m(torch.zeros(3, 8, dtype=torch.long)).shape
    torch.Size([3, 98])
    >>> sum(p.numel() for p in WideCharMLP(98).parameters()) > 20_000_000
    True
"""

from __future__ import annotations

import torch
from torch import nn


class WideCharMLP(nn.Module):
    def __init__(self, vocab_size: int, context: int = 16, embed: int = 64, hidden: int = 4096):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocab_size, embed)
        self.net = nn.Sequential(
            nn.Linear(context * embed, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, vocab_size),
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits of the character after each window of ``context`` ids: (batch, vocab)."""
        return self.net(self.embed(ids).flatten(1))


def next_char_batch(ids: torch.Tensor, batch: int, context: int, generator: torch.Generator):
    """(windows (batch, context), next characters (batch,)) at random places of ``ids``."""
    starts = torch.randint(0, len(ids) - context - 1, (batch,), generator=generator)
    windows = ids[starts[:, None] + torch.arange(context + 1)]
    return windows[:, :-1], windows[:, -1]


def next_char_valid(ids: torch.Tensor, context: int, count: int):
    """``count`` fixed, evenly spaced (window, next character) pairs of the valid split."""
    step = (len(ids) - context - 1) // count
    windows = ids[(torch.arange(count) * step)[:, None] + torch.arange(context + 1)]
    return windows[:, :-1], windows[:, -1]
