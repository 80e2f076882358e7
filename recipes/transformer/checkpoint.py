"""Checkpoint files: atomic writes, numbered checkpoints kept N at a time, averaging.

A checkpoint is one ``torch.save`` dict (see ``train.py`` for its keys). Rank 0 writes
``checkpoint_{epoch}_{updates}.pt`` and copies it to ``checkpoint_last.pt``; writes go to
a temporary file first and are renamed, so a crash never leaves a torn checkpoint.

    >>> import torch
    >>> a = {"model": {"w": torch.tensor([1.0, 3.0])}}; b = {"model": {"w": torch.tensor([3.0, 5.0])}}
    >>> average_model_states([a["model"], b["model"]])["w"].tolist()
    [2.0, 4.0]
"""

from __future__ import annotations

import glob
import os
import re
import shutil

import torch

from recipes.common import atomic_save

LAST = "checkpoint_last.pt"
_NUMBERED = re.compile(r"checkpoint_(\d+)_(\d+)\.pt$")


def numbered_checkpoints(save_dir: str) -> list[str]:
    """``checkpoint_{epoch}_{updates}.pt`` files of ``save_dir``, oldest first."""
    found = []
    for path in glob.glob(os.path.join(save_dir, "checkpoint_*_*.pt")):
        m = _NUMBERED.search(os.path.basename(path))
        if m:
            found.append((int(m.group(2)), int(m.group(1)), path))
    return [p for _, _, p in sorted(found)]


def save_checkpoint(
    state: dict, save_dir: str, *, epoch: int, num_updates: int, keep_last: int
) -> str:
    """Write the numbered checkpoint and checkpoint_last.pt; prune older numbered ones."""
    path = os.path.join(save_dir, f"checkpoint_{epoch}_{num_updates}.pt")
    atomic_save(state, path)
    tmp = os.path.join(save_dir, f"{LAST}.tmp{os.getpid()}")
    shutil.copyfile(path, tmp)
    os.replace(tmp, os.path.join(save_dir, LAST))
    if keep_last > 0:
        for old in numbered_checkpoints(save_dir)[:-keep_last]:
            os.remove(old)
            for rank_file in glob.glob(glob.escape(old) + ".rank*"):
                os.remove(rank_file)  # the ranks' own parts of that checkpoint
    return path


def load_checkpoint(path: str, map_location="cpu") -> dict:
    # Plain values (option dict, tokenizer bytes, RNG tuples) and tensors: no pickled code.
    return torch.load(path, map_location=map_location, weights_only=True)


def average_model_states(states: list[dict]) -> dict:
    """Element-wise mean of model state dicts (floating tensors; others from the last)."""
    if not states:
        raise ValueError("no checkpoints to average")
    keys = list(states[-1].keys())
    for i, s in enumerate(states):
        if list(s.keys()) != keys:
            raise ValueError(
                f"checkpoint {i} has different parameters from the others; "
                f"average checkpoints of one training run only"
            )
    averaged = {}
    for k in keys:
        last = states[-1][k]
        if torch.is_floating_point(last):
            total = torch.zeros_like(last, dtype=torch.float64)
            for s in states:
                total += s[k].to(torch.float64)
            averaged[k] = (total / len(states)).to(last.dtype)
        else:
            averaged[k] = last.clone()
    return averaged


def average_checkpoints(paths: list[str]) -> dict:
    """The last checkpoint of ``paths`` with its model replaced by the mean of all of them.

    Loads one file at a time (a big model's checkpoints do not fit in memory together);
    the optimizer state is dropped from the result.
    """
    if not paths:
        raise ValueError("no checkpoints to average")
    total, keys, last = None, None, None
    for path in paths:
        last = load_checkpoint(path)
        model = last["model"]
        if total is None:
            keys = list(model.keys())
            total = {
                k: torch.zeros_like(v, dtype=torch.float64)
                for k, v in model.items()
                if torch.is_floating_point(v)
            }
        elif list(model.keys()) != keys:
            raise ValueError(
                f"{path} has different parameters from {paths[0]}; "
                f"average checkpoints of one training run only"
            )
        for k in total:
            total[k] += model[k].to(torch.float64)
    result = {k: v for k, v in last.items() if k not in ("optimizer", "rank_states")}
    result["model"] = {
        k: (total[k] / len(paths)).to(v.dtype) if k in total else v
        for k, v in last["model"].items()
    }
    result["averaged_from"] = [os.path.basename(p) for p in paths]
    return result
