"""Parallel text -> token tensors -> batches by ``--max-tokens``, sharded over ranks.

A data folder holds ``{split}.{lang}`` text files, one sentence per line, with the
same number of lines in both languages (``train.en``/``train.de``, ``valid.*``,
``test.*``). Each split is encoded once with the tokenizer and kept as one flat int32
tensor plus offsets, cached next to the text (``.cache/``) so the next run and the
other ranks load it instead of encoding again.

Batching follows fairseq: sort the pairs by length, cut the sorted list into batches
whose padded size (sentences x longest side) stays within ``max_tokens``, shuffle
the batches every epoch with the seed, then deal them out: update ``u`` of the epoch is
made of batches ``[u*W*F, (u+1)*W*F)`` of which rank ``r`` takes ``F`` (``W`` ranks,
``F`` = ``--update-freq``). Every rank computes the same list, so no data moves over
the network; where the position in the epoch is saved, resuming is exact.

    >>> import torch
    >>> lengths = torch.tensor([3, 5, 4, 9, 2, 7])
    >>> batches = batches_by_size(lengths, lengths, max_tokens=12)
    >>> all(len(b) * int(lengths[b].max()) <= 12 for b in batches)
    True
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass

import torch

from recipes.common import atomic_save
from recipes.transformer.tokenizer import EOS, PAD


@dataclass
class TokenizedSplit:
    """One split: the sentences of each side as one flat tensor with offsets."""

    src_flat: torch.Tensor  # int32, every sentence followed by EOS
    src_offsets: torch.Tensor  # int64, len = n + 1
    tgt_flat: torch.Tensor
    tgt_offsets: torch.Tensor
    references: list[str]  # target text as written (BLEU is scored against it)
    sources: list[str]

    def __len__(self) -> int:
        return len(self.src_offsets) - 1

    @property
    def src_lengths(self) -> torch.Tensor:
        return self.src_offsets[1:] - self.src_offsets[:-1]

    @property
    def tgt_lengths(self) -> torch.Tensor:
        return self.tgt_offsets[1:] - self.tgt_offsets[:-1]

    def source(self, i: int) -> torch.Tensor:
        return self.src_flat[self.src_offsets[i] : self.src_offsets[i + 1]].long()

    def target(self, i: int) -> torch.Tensor:
        return self.tgt_flat[self.tgt_offsets[i] : self.tgt_offsets[i + 1]].long()


def split_paths(data_dir: str, split: str, src_lang: str, tgt_lang: str) -> tuple[str, str]:
    return (
        os.path.join(data_dir, f"{split}.{src_lang}"),
        os.path.join(data_dir, f"{split}.{tgt_lang}"),
    )


def _read_lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def _flatten(encoded: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(ids) + 1 for ids in encoded], dtype=torch.int64)
    offsets = torch.zeros(len(encoded) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    flat = torch.empty(int(offsets[-1]), dtype=torch.int32)
    for i, ids in enumerate(encoded):
        start, end = int(offsets[i]), int(offsets[i + 1])
        flat[start : end - 1] = torch.tensor(ids, dtype=torch.int32)
        flat[end - 1] = EOS
    return flat, offsets


def _cache_path(data_dir: str, split: str, src_path: str, tgt_path: str, tokenizer_key: str) -> str:
    h = hashlib.sha1(tokenizer_key.encode())
    for p in (src_path, tgt_path):
        st = os.stat(p)
        h.update(f"{p}:{st.st_size}:{st.st_mtime_ns}".encode())
    return os.path.join(data_dir, ".cache", f"{split}.{h.hexdigest()[:16]}.pt")


def load_split(
    data_dir: str,
    split: str,
    src_lang: str,
    tgt_lang: str,
    tokenizer,
    *,
    tokenizer_key: str,
    use_cache: bool = True,
) -> TokenizedSplit:
    """Encode (or load from the cache) one split of the parallel text."""
    src_path, tgt_path = split_paths(data_dir, split, src_lang, tgt_lang)
    for p in (src_path, tgt_path):
        if not os.path.isfile(p):
            raise FileNotFoundError(
                f"missing {p}: the data folder needs {split}.{src_lang} and {split}.{tgt_lang} "
                f"(one sentence per line)"
            )
    sources, references = _read_lines(src_path), _read_lines(tgt_path)
    if len(sources) != len(references):
        raise ValueError(
            f"{src_path} has {len(sources)} lines but {tgt_path} has {len(references)}; "
            f"parallel files must be line-aligned"
        )
    cache = _cache_path(data_dir, split, src_path, tgt_path, tokenizer_key) if use_cache else None
    if cache and os.path.isfile(cache):
        try:
            tensors = torch.load(cache, weights_only=True)
            return TokenizedSplit(**tensors, references=references, sources=sources)
        except Exception:  # a torn or stale cache is rebuilt, never trusted
            pass
    src_flat, src_offsets = _flatten(tokenizer.encode_many(sources))
    tgt_flat, tgt_offsets = _flatten(tokenizer.encode_many(references))
    tensors = dict(
        src_flat=src_flat, src_offsets=src_offsets, tgt_flat=tgt_flat, tgt_offsets=tgt_offsets
    )
    if cache:
        # a reader sees the old file or the whole new one; a read-only data folder: no cache
        with contextlib.suppress(OSError):
            atomic_save(tensors, cache)
    return TokenizedSplit(**tensors, references=references, sources=sources)


def batches_by_size(
    src_lengths: torch.Tensor,
    tgt_lengths: torch.Tensor,
    *,
    max_tokens: int | None = None,
    max_sentences: int | None = None,
    indices: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Cut ``indices`` (default: all) sorted by length into batches.

    A batch's cost is its padded size, ``len(batch) * max(longest source, longest
    target)``; it stays within ``max_tokens`` and holds at most ``max_sentences`` pairs.
    Sorting by (target length, source length) keeps the padding small.
    """
    if max_tokens is None and max_sentences is None:
        raise ValueError("give max_tokens or max_sentences")
    if indices is None:
        indices = torch.arange(len(src_lengths))
    # stable sort by source length, then by target length: ties keep index order
    order = indices[torch.argsort(src_lengths[indices], stable=True)]
    order = order[torch.argsort(tgt_lengths[order], stable=True)]
    sizes = torch.maximum(src_lengths[order], tgt_lengths[order]).tolist()
    batches, start, longest = [], 0, 0
    for i, size in enumerate(sizes):
        n = i - start
        new_longest = max(longest, size)
        full = (max_sentences is not None and n >= max_sentences) or (
            max_tokens is not None and (n + 1) * new_longest > max_tokens
        )
        if full and n > 0:
            batches.append(order[start:i])
            start, new_longest = i, size
        longest = new_longest
    if start < len(order):
        batches.append(order[start:])
    return batches


def collate(split: TokenizedSplit, indices, *, device=None) -> dict:
    """Pad a batch; the decoder input is the target shifted right with EOS in front (fairseq)."""
    srcs = [split.source(int(i)) for i in indices]
    tgts = [split.target(int(i)) for i in indices]
    n, src_len, tgt_len = len(srcs), max(len(s) for s in srcs), max(len(t) for t in tgts)
    src_tokens = torch.full((n, src_len), PAD, dtype=torch.long)
    target = torch.full((n, tgt_len), PAD, dtype=torch.long)
    prev_output = torch.full((n, tgt_len), PAD, dtype=torch.long)
    for j, (s, t) in enumerate(zip(srcs, tgts)):
        src_tokens[j, : len(s)] = s
        target[j, : len(t)] = t
        prev_output[j, 0] = EOS
        prev_output[j, 1 : len(t)] = t[:-1]
    batch = {
        "id": torch.as_tensor([int(i) for i in indices]),
        "src_tokens": src_tokens,
        "prev_output_tokens": prev_output,
        "target": target,
        "ntokens": int(sum(len(t) for t in tgts)),
        "nsentences": n,
    }
    if device is not None:
        for k in ("src_tokens", "prev_output_tokens", "target"):
            batch[k] = batch[k].to(device, non_blocking=True)
    return batch


class ShardedBatchIterator:
    """The updates of each epoch for one rank, with a position that can be saved.

    ``updates(epoch)`` yields, from the saved position on, lists of ``update_freq``
    batches (index tensors); ``state_dict()`` / ``load_state_dict()`` carry
    ``(epoch, updates done in it)``.
    """

    def __init__(
        self,
        split: TokenizedSplit,
        *,
        rank: int,
        world_size: int,
        update_freq: int,
        seed: int,
        max_tokens: int | None,
        max_sentences: int | None,
        max_positions: int,
    ):
        self.rank, self.world_size, self.update_freq, self.seed = (
            rank,
            world_size,
            update_freq,
            seed,
        )
        src_len, tgt_len = split.src_lengths, split.tgt_lengths
        keep = (src_len <= max_positions) & (tgt_len <= max_positions)
        self.skipped = int((~keep).sum())
        kept = torch.nonzero(keep).flatten()
        if len(kept) == 0:
            raise ValueError(f"every sentence pair is longer than --max-positions {max_positions}")
        if max_tokens is not None:
            longest = int(torch.maximum(src_len[kept], tgt_len[kept]).max())
            if max_tokens < longest:
                raise ValueError(
                    f"--max-tokens {max_tokens} is smaller than the longest sentence pair kept "
                    f"({longest} tokens); raise --max-tokens to at least {longest} or lower "
                    f"--max-positions (longer pairs are skipped)"
                )
        self.batches = batches_by_size(
            src_len, tgt_len, max_tokens=max_tokens, max_sentences=max_sentences, indices=kept
        )
        per_update = world_size * update_freq
        self.updates_per_epoch = len(self.batches) // per_update
        if self.updates_per_epoch == 0:
            raise ValueError(
                f"the training set makes {len(self.batches)} batches, fewer than one update needs "
                f"({world_size} ranks x --update-freq {update_freq}); lower --max-tokens/--batch-size "
                f"or --update-freq"
            )
        self.dropped_batches = len(self.batches) - self.updates_per_epoch * per_update
        self.epoch, self.updates_in_epoch = 1, 0

    def _epoch_order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.batches), generator=g).tolist()

    def updates(self):
        """Yield this rank's batches for each remaining update of the current epoch."""
        order = self._epoch_order(self.epoch)
        per_update = self.world_size * self.update_freq
        while self.updates_in_epoch < self.updates_per_epoch:
            u = self.updates_in_epoch
            mine = order[u * per_update + self.rank * self.update_freq :][: self.update_freq]
            self.updates_in_epoch += 1
            yield [self.batches[b] for b in mine]

    def next_epoch(self) -> None:
        self.epoch += 1
        self.updates_in_epoch = 0

    @property
    def end_of_epoch(self) -> bool:
        return self.updates_in_epoch >= self.updates_per_epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "updates_in_epoch": self.updates_in_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.updates_in_epoch = int(state["epoch"]), int(state["updates_in_epoch"])


def shard_for_rank(n: int, rank: int, world_size: int) -> range:
    """Contiguous share of ``n`` items for ``rank`` (evaluation: every item exactly once)."""
    per = (n + world_size - 1) // world_size
    return range(min(n, rank * per), min(n, (rank + 1) * per))
