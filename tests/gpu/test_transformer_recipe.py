"""The Transformer recipe on a GPU: fp16 with dynamic loss scaling and bf16, a few updates."""

from __future__ import annotations

import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip(
        "no CUDA device: the recipe's fp16/bf16 paths run on GPUs only "
        "(CPU paths: tests/unit and tests/distributed test_transformer_recipe.py)",
        allow_module_level=True,
    )
pytest.importorskip(
    "sentencepiece", reason="the Transformer recipe needs sentencepiece (commopt[recipes])"
)
pytest.importorskip("sacrebleu", reason="the Transformer recipe needs sacrebleu (commopt[recipes])")


@pytest.mark.parametrize(
    "precision,extra",
    [
        ("fp16", []),
        ("fp16", ["--double-buffering"]),
        ("fp16", ["--clip-norm", "1.0"]),
        ("bf16", []),
    ],
)
def test_mixed_precision_updates_learn(tmp_path, precision, extra):
    from recipes.transformer import train
    from recipes.transformer.smoke_corpus import write_smoke_corpus

    write_smoke_corpus(str(tmp_path / "data"), sizes={"train": 2000, "valid": 40, "test": 40})
    trainer = train.run(
        [
            "--preset",
            "smoke",
            "--data",
            str(tmp_path / "data"),
            "--save-dir",
            str(tmp_path / "run"),
            "--precision",
            precision,
            "--device",
            "cuda",
            "--max-update",
            "30",
            "--no-progress-bar",
            "--final-eval",
            "none",
            "--vocab-size",
            "300",
            *extra,
        ]
    )
    assert trainer.device.type == "cuda" and trainer.num_updates == 30
    assert next(trainer.model.parameters()).is_cuda
    assert math.isfinite(trainer.best_valid_loss) and trainer.best_valid_loss < 9.0
    if precision == "fp16":
        assert trainer.scaler is not None and trainer.scaler.get_scale() > 0
