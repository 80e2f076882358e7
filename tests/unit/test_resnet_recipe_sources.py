"""The ResNet-50 recipe's two sources: torchvision's resnet50 and FakeData when torchvision
imports, the built-in network and synthetic images otherwise; the log says which was used."""

from __future__ import annotations

import json

import pytest
import torch

from recipes.resnet50 import model as model_mod
from recipes.resnet50 import train as recipe
from recipes.resnet50.data import FakeImages, SyntheticImages, data_source, make_datasets
from recipes.resnet50.model import (
    model_source,
    resnet50,
    torchvision_available,
    torchvision_import_error,
)
from tests.recipe_args import tiny_resnet

needs_torchvision = pytest.mark.skipif(
    not torchvision_available(),
    reason=f"torchvision does not import here ({torchvision_import_error()}); "
    "see scripts/setup_torchvision.sh for a CPU build",
)

TINY = tiny_resnet(train_size=8, val_size=4, communicator="local", max_steps=1)


def test_fallback_is_the_builtin_network_and_synthetic_images(monkeypatch):
    model = resnet50(num_classes=10, prefer_torchvision=False)
    assert isinstance(model, model_mod.ResNet)
    assert model_source(model).startswith("built-in ResNet-50")
    # where torchvision does not import, "fake" data falls back to the synthetic images
    monkeypatch.setattr(model_mod, "torchvision_available", lambda: False)
    train, val = make_datasets(
        "fake", data_dir=None, image_size=32, num_classes=4, train_size=8, val_size=4, seed=0
    )
    assert isinstance(train, SyntheticImages) and isinstance(val, SyntheticImages)
    assert data_source(train) == "built-in synthetic images (8)"


def test_model_source_names_why_torchvision_was_not_used():
    why = torchvision_import_error()
    if why is None:
        pytest.skip("torchvision imports here: there is no reason to report")
    assert why in model_source(resnet50(num_classes=10))


@needs_torchvision
def test_torchvision_branch_uses_its_resnet50_and_fakedata():
    model = resnet50(num_classes=1000)
    assert model_source(model).startswith("torchvision ")
    assert sum(p.numel() for p in model.parameters()) == 25_557_032
    train, val = make_datasets(
        "fake", data_dir=None, image_size=32, num_classes=4, train_size=8, val_size=4, seed=0
    )
    assert isinstance(train, FakeImages) and "FakeData" in data_source(train)
    x, y = train[3]
    assert x.shape == (3, 32, 32) and 0 <= y < 4
    assert torch.equal(x, FakeImages(8, 4, 32, seed=0)[3][0])  # a function of (seed, index)
    assert not torch.equal(x, val[3][0])  # validation: another seed
    built_in = resnet50(num_classes=1000, prefer_torchvision=False)
    assert built_in.state_dict().keys() == model.state_dict().keys()  # checkpoints load in either


@pytest.mark.slow
def test_the_training_log_says_which_model_and_data_were_used(tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    assert recipe.main([*TINY, "--fake-data", "--log-jsonl", str(log)]) == 0
    config = next(
        r for r in map(json.loads, log.read_text().splitlines()) if r.get("event") == "config"
    )
    if torchvision_available():
        assert (
            config["model_source"].startswith("torchvision ")
            and "FakeData" in config["data_source"]
        )
    else:
        assert config["model_source"].startswith("built-in ResNet-50")
        assert config["data_source"].startswith("built-in synthetic images")
    assert config["data_kind"] == "fake"
    assert recipe.main([*TINY, "--fake-data", "--synthetic"]) == 2
    assert "--fake-data" in capsys.readouterr().err
