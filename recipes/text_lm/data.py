"""The corpus: Python's help topics as characters, split once into train and valid.

>>> from recipes.text_lm.data import char_corpus
>>> c = char_corpus()
>>> c.vocab_size, len(c.valid) > 40_000, len(c.train) > 9 * len(c.valid) - 10
(98, True, True)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: tab, newline and printable ASCII; every other character maps to one "unknown" id.
ALPHABET = "\t\n" + "".join(chr(c) for c in range(32, 127))
VALID_FRACTION = 0.1


@dataclass(frozen=True)
class CharCorpus:
    train: torch.Tensor  # int64 ids
    valid: torch.Tensor
    vocab_size: int


def char_corpus(valid_fraction: float = VALID_FRACTION) -> CharCorpus:
    """Topics sorted by name, joined; the last ``valid_fraction`` of characters is valid."""
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # some distributions strip pydoc_data
        raise ImportError(
            "the text task needs CPython's pydoc_data module (part of the standard "
            "library; install your distribution's full python3 package)"
        ) from exc
    text = "\n".join(topics[k] for k in sorted(topics))
    index = {ch: i for i, ch in enumerate(ALPHABET)}
    unknown = len(ALPHABET)
    ids = torch.tensor([index.get(ch, unknown) for ch in text], dtype=torch.long)
    cut = int(len(ids) * (1 - valid_fraction))
    return CharCorpus(train=ids[:cut], valid=ids[cut:], vocab_size=len(ALPHABET) + 1)


def train_batch(ids: torch.Tensor, batch: int, context: int, generator: torch.Generator):
    """(inputs, targets), each (batch, context): random windows, targets shifted by one."""
    starts = torch.randint(0, len(ids) - context - 1, (batch,), generator=generator)
    offsets = torch.arange(context + 1)
    windows = ids[starts[:, None] + offsets]
    return windows[:, :-1], windows[:, 1:]


def valid_batches(ids: torch.Tensor, context: int, count: int):
    """``count`` fixed, evenly spaced windows of the valid split (the same every call)."""
    step = (len(ids) - context - 1) // count
    starts = torch.arange(count) * step
    windows = ids[starts[:, None] + torch.arange(context + 1)]
    return windows[:, :-1], windows[:, 1:]
