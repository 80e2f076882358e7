"""scikit-learn's ``load_digits`` as tensors, split once for every user of the digits task
(``recipes/digits_parity.py``, the accuracy studies, ``commopt bench to_accuracy --task digits``).

It imports only torch (and scikit-learn when called), so a loader can use it without the
recipes' other modules.
"""

from __future__ import annotations

import torch


def load_digits_split(test_fraction: float = 0.2, split_seed: int = 0):
    """(x_train, y_train, x_test, y_test): images as (N, 1, 8, 8) float in [0, 1], stratified."""
    try:
        from sklearn.datasets import load_digits  # type: ignore[import-untyped]
        from sklearn.model_selection import train_test_split  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ImportError(
            "the digits task needs scikit-learn (its data ship with it): pip install scikit-learn"
        ) from exc
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    idx_train, idx_test = train_test_split(
        range(len(y)), test_size=test_fraction, random_state=split_seed, stratify=digits.target
    )
    return x[idx_train], y[idx_train], x[idx_test], y[idx_test]
