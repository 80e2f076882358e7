"""The ResNet-50 recipe in one process: model, presets, argument checks, data, a short run."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from recipes.common import RecipeError
from recipes.resnet50 import train as recipe
from recipes.resnet50.data import (
    DataError,
    EpochBatches,
    ImageFolderImages,
    SyntheticImages,
    eval_shard,
    make_datasets,
)
from recipes.resnet50.model import resnet50
from recipes.resnet50.presets import PRESETS
from tests.recipe_args import tiny_resnet

TINY = tiny_resnet(preset=None, communicator="local", log_every=1)


def resolve(*argv):
    return recipe.resolve(recipe.build_parser().parse_args(list(argv)))


def test_model_is_resnet50():
    model = resnet50(num_classes=1000, prefer_torchvision=False)
    assert sum(p.numel() for p in model.parameters()) == 25_557_032  # torchvision's count
    keys = model.state_dict().keys()
    for key in (
        "conv1.weight",
        "layer1.0.downsample.0.weight",
        "layer4.2.bn3.running_var",
        "fc.bias",
    ):
        assert key in keys
    small = resnet50(num_classes=10, zero_init_residual=True, prefer_torchvision=False)
    assert small(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert float(small.layer1[0].bn3.weight.detach().abs().sum()) == 0.0


def test_presets_resolve_to_the_published_settings():
    cfg = resolve("--preset", "imagenet-32gpu", "--synthetic")
    assert (cfg.global_batch, cfg.optimizer, cfg.epochs, cfg.momentum, cfg.weight_decay) == (
        2048,
        "sgd",
        90,
        0.9,
        1e-4,
    )
    assert cfg.lr == pytest.approx(0.8)  # 0.1 per 256 images
    assert cfg.batch_at(29) == 2048 and cfg.batch_at(30) == 4096  # 64 -> 128 per GPU at 30
    assert cfg.lr_at(30.0) == pytest.approx(0.8 * 0.2) and cfg.lr_at(85.0) == pytest.approx(
        0.8 * 0.002
    )
    lars = resolve("--preset", "imagenet-lars-32k", "--synthetic")
    assert (lars.optimizer, lars.lr, lars.warmup_epochs, lars.label_smoothing) == (
        "lars",
        31.2,
        25,
        0.1,
    )
    assert lars.lr_at(25.0) == pytest.approx(31.2) and lars.lr_at(90.0) == pytest.approx(1e-4)
    smaller = resolve("--preset", "imagenet-lars-32k", "--synthetic", "--batch-size", "8192")
    assert (smaller.lr, smaller.warmup_epochs) == (10.0, 5)
    half = resolve("--preset", "imagenet-32gpu", "--synthetic", "--batch-size", "1024")
    assert half.batch_at(30) == 2048 and half.lr == pytest.approx(0.4)
    assert set(PRESETS) == {"smoke", "imagenet-32gpu", "imagenet-lars-32k"}


def _main(capsys, *argv):
    code = recipe.main(list(argv))
    return code, capsys.readouterr().err


def test_unknown_preset_is_rejected_with_the_choices(capsys):
    code, err = _main(capsys, "--preset", "imagenet-64gpu")
    assert code == 2
    assert (
        "unknown preset 'imagenet-64gpu'" in err and "smoke" in err and "imagenet-lars-32k" in err
    )


def test_missing_data_folder_is_rejected_with_what_to_do(capsys, tmp_path):
    code, err = _main(capsys, "--preset", "imagenet-32gpu", "--data", str(tmp_path / "nope"))
    assert code == 2 and "folder not found" in err and "--synthetic" in err
    code, err = _main(capsys, "--preset", "imagenet-32gpu")
    assert code == 2 and "--data DIR" in err
    (tmp_path / "train").mkdir()
    code, err = _main(capsys, "--preset", "imagenet-32gpu", "--data", str(tmp_path))
    assert code == 2 and "no val/ sub-folder" in err


def test_batch_must_divide_over_the_ranks():
    cfg = resolve("--preset", "smoke", "--batch-size", "33")
    recipe.check_world(cfg, 1)
    with pytest.raises(
        RecipeError,
        match=r"--batch-size 33 .* divisible by the number of ranks \(2\): use 32 or 34",
    ):
        recipe.check_world(cfg, 2)
    big = resolve("--preset", "imagenet-32gpu", "--synthetic", "--batch-size", "96")
    recipe.check_world(big, 32)
    with pytest.raises(RecipeError, match="divisible"):
        recipe.check_world(big, 7)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--batch-size", "0"], "--batch-size must be > 0"),
        (["--image-size", "16"], "--image-size must be >= 32"),
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--compression", "qsgd3"], "--compression qsgd3"),
        (["--data", "x", "--synthetic"], "either --data DIR or --synthetic"),
    ],
)
def test_bad_arguments_have_clear_messages(argv, match):
    with pytest.raises((RecipeError, DataError), match=match):
        resolve("--preset", "smoke", *argv)


def test_synthetic_data_is_deterministic_and_learnable():
    a = SyntheticImages(20, 4, 32, seed=3)
    b = SyntheticImages(20, 4, 32, seed=3)
    assert torch.equal(a[7][0], b[7][0]) and a[7][1] == 3
    assert not torch.equal(a[7][0], SyntheticImages(20, 4, 32, seed=4)[7][0])
    train, val = make_datasets(
        "synthetic", data_dir=None, image_size=32, num_classes=4, train_size=16, val_size=8, seed=0
    )
    assert torch.equal(train.prototype(2), val.prototype(2)) and not torch.equal(
        train[0][0], val[0][0]
    )


def test_global_batches_do_not_depend_on_the_number_of_ranks():
    one = list(EpochBatches(50, 8, 0, 1, seed=1, epoch=2))
    for world in (2, 4):
        shards = [list(EpochBatches(50, 8, r, world, seed=1, epoch=2)) for r in range(world)]
        for k, batch in enumerate(one):
            assert list(itertools.chain.from_iterable(s[k] for s in shards)) == batch
    assert list(EpochBatches(50, 8, 0, 1, seed=1, epoch=2, start=4)) == one[4:]
    assert one != list(EpochBatches(50, 8, 0, 1, seed=1, epoch=3))
    assert sorted(
        itertools.chain.from_iterable(
            itertools.chain.from_iterable(eval_shard(11, r, 3, 2)) for r in range(3)
        )
    ) == list(range(11))
    with pytest.raises(ValueError, match="fewer than one global batch"):
        EpochBatches(5, 8, 0, 1, seed=0, epoch=0)


def _image_folder(root, classes=("cat", "dog"), per_class=3):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in classes:
            (root / split / c).mkdir(parents=True)
            for i in range(per_class):
                size = (40 + 7 * i, 36 + 5 * i)
                arr = rng.integers(0, 255, size=(size[1], size[0], 3), dtype=np.uint8)
                Image.fromarray(arr).save(root / split / c / f"{i}.png")
    return root


def test_image_folder_reads_imagenet_layout(tmp_path):
    root = _image_folder(tmp_path)
    train, val = make_datasets(
        "folder", data_dir=str(root), image_size=32, num_classes=0, train_size=0, val_size=0, seed=0
    )
    assert train.classes == ["cat", "dog"] and len(train) == 6 and len(val) == 6
    x, y = train[4]
    assert x.shape == (3, 32, 32) and y == 1 and x.dtype == torch.float32
    assert torch.equal(train[4][0], x)  # same (seed, epoch, index): same crop
    train.set_epoch(1)
    assert not torch.equal(train[4][0], x)  # a new epoch draws new crops
    assert torch.equal(val[2][0], val[2][0]) and val[2][0].shape == (3, 32, 32)


def test_image_folder_errors(tmp_path):
    with pytest.raises(DataError, match="no class sub-folders"):
        (tmp_path / "empty").mkdir()
        ImageFolderImages(tmp_path / "empty", 32, train=True)
    root = _image_folder(tmp_path / "ds")
    (root / "val" / "bird").mkdir()
    (root / "val" / "bird" / "0.png").write_bytes((root / "val" / "cat" / "0.png").read_bytes())
    with pytest.raises(DataError, match="same class folders"):
        make_datasets(
            "folder",
            data_dir=str(root),
            image_size=32,
            num_classes=0,
            train_size=0,
            val_size=0,
            seed=0,
        )


def test_smoke_run_logs_and_resumes_exactly_in_one_process(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    ck = tmp_path / "ck"
    argv = [
        "--preset",
        "smoke",
        *TINY,
        "--checkpoint-dir",
        str(ck),
        "--checkpoint-every",
        "1",
        "--optimizer",
        "lars",
    ]
    assert recipe.main(argv + ["--max-steps", "2", "--log-jsonl", str(log)]) == 0
    straight = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    records = [json.loads(line) for line in log.read_text().splitlines()]
    events = [r["event"] for r in records]
    assert events[0] == "config" and events.count("train") == 2 and events[-1] == "done"
    train_rec = next(r for r in records if r["event"] == "train")
    assert {"loss", "top1", "images_per_s", "lr"} <= set(train_rec)
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-00000001", "step-00000002"]
    assert recipe.main(argv + ["--max-steps", "2", "--resume", "step-00000001"]) == 0
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert resumed["steps"] == 1 and resumed["digest"] == straight["digest"]
    # a different setting is refused instead of silently resuming something else
    assert recipe.main(argv + ["--max-steps", "2", "--resume", "--lr", "0.5"]) == 2
    assert "settings differ" in capsys.readouterr().err


def test_scaling_script_commands_and_table(tmp_path, capsys):
    from recipes import scaling

    assert scaling.config_flags("fp32") == []
    assert scaling.config_flags("qsgd4+ef+db") == [
        "--compression",
        "qsgd4+ef",
        "--double-buffering",
    ]
    assert (
        scaling.main(
            [
                "--dry-run",
                "--launcher",
                "mpirun",
                "--ranks",
                "1,2",
                "--configs",
                "fp16",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith("mpirun --allow-run-as-root")
    assert (
        "-np 2" in lines[1]
        and "--batch-size 32" in lines[1]
        and "--allreduce-grad-dtype float16" in lines[1]
    )
    log = tmp_path / "run.jsonl"
    log.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"event": "eval", "step": 5, "top1": 0.3, "train_s": 4.0},
                {"event": "eval", "step": 10, "top1": 0.6, "train_s": 8.5},
                {"event": "done", "steps": 10, "images_per_s": 40.0, "top1": 0.6},
            ]
        )
    )
    run = scaling.read_run(log, target=0.5)
    assert (
        run["time_to_target_s"] == 8.5
        and run["step_at_target"] == 10
        and run["images_per_s"] == 40.0
    )
    results = [
        {"config": "fp32", "ranks": 1, "images_per_s": 50.0},
        {"config": "fp32", "ranks": 2, "images_per_s": 80.0, "time_to_target_s": None},
        {"config": "qsgd4", "ranks": 2, "images_per_s": 95.0, "time_to_target_s": 12.0},
    ]
    scaling.efficiency_table(results, [1, 2], ["fp32", "qsgd4"])
    assert [r["efficiency"] for r in results] == [1.0, 0.8, 0.95]  # e = t / (t0 * n)
    table = scaling.markdown(
        results,
        [1, 2],
        ["fp32", "qsgd4"],
        {"target": 0.5, "link_note": "x", "steps": 10, "per_rank_batch": 16, "preset": "smoke"},
    )
    assert "| fp32 | 50.0 (1.00) | 80.0 (0.80) | not reached |" in table
    assert "| qsgd4 | - | 95.0 (0.95) | 12.0 |" in table
    assert scaling.main(["--ranks", "one"]) == 2
