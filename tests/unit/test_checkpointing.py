"""Checkpoints that cannot lie, in one process: manifest checks, crash leftovers, `latest`.

What a killed save leaves behind is made by hand here (a staging folder, a checkpoint moved
aside); tests/distributed/test_kill_during_save.py kills real ranks at random moments.
"""

import json
import os

import pytest
import torch

import commopt
from commopt.checkpointing import CheckpointError, CheckpointManager, verify_checkpoint
from commopt.checkpointing.atomic import aside_path, save_parts, staging_path
from commopt.optim import create_multi_node_optimizer, load_checkpoint, save_checkpoint


def make(seed=0, **options):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        commopt.create_communicator("local"),
        model=model,
        **{"compression": "qsgd4+ef", **options},
    )
    return model, opt


def train(model, opt, steps):
    for step in steps:
        g = torch.Generator().manual_seed(step)
        opt.zero_grad()
        x, y = torch.randn(8, 64, generator=g), torch.randn(8, 4, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    opt.wait()


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture
def saved(tmp_path):
    """A checkpoint at tmp_path/ckpt after 2 steps, and the weights it holds."""
    model, opt = make()
    train(model, opt, range(2))
    save_checkpoint(tmp_path / "ckpt", model, opt, extra={"step": 2})
    return tmp_path / "ckpt", weights(model)


def a_file(path, part="rank0"):
    return max((p for p in (path / part).iterdir() if p.is_file()), key=lambda p: p.stat().st_size)


def test_manifest_lists_every_file_with_its_checksum(saved):
    path, _ = saved
    manifest = verify_checkpoint(path)
    assert manifest["world_size"] == 1
    assert sorted(manifest["parts"]) == ["rank0", "replicated"]
    for part, files in manifest["parts"].items():
        on_disk = sorted(p.name for p in (path / part).rglob("*") if p.is_file())
        assert sorted(files) == on_disk
        assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in files.values())
    assert not staging_path(path).exists() and not aside_path(path).exists()


@pytest.mark.parametrize("part", ["rank0", "replicated"])
def test_a_truncated_part_names_the_file_and_restores_nothing(saved, part):
    path, _ = saved
    victim = a_file(path, part)
    size = victim.stat().st_size
    os.truncate(victim, size // 2)
    model, opt = make(seed=7)
    before = weights(model)
    with pytest.raises(CheckpointError, match=rf"{victim.name} is truncated: {size // 2} bytes"):
        load_checkpoint(path, model, opt)
    assert_same(weights(model), before)  # nothing restored


def test_a_flipped_byte_is_found(saved):
    path, _ = saved
    victim = a_file(path, "replicated")
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{victim.name} is corrupted: its SHA-256"):
        load_checkpoint(path, *make())


def test_a_missing_file_or_a_damaged_manifest_is_named(saved):
    path, _ = saved
    manifest = path / "MANIFEST.json"
    body = json.loads(manifest.read_text())
    body["world_size"] = 3  # edited: the manifest's own checksum no longer matches
    manifest.write_text(json.dumps(body))
    with pytest.raises(CheckpointError, match=r"MANIFEST.json is corrupted"):
        load_checkpoint(path, *make())
    manifest.write_text(manifest.read_text()[:40])
    with pytest.raises(CheckpointError, match=r"MANIFEST.json is not valid JSON"):
        load_checkpoint(path, *make())


def test_a_missing_part_file_is_named(tmp_path, saved):
    path, _ = saved
    victim = a_file(path)
    victim.unlink()
    with pytest.raises(CheckpointError, match=rf"{victim.name} is missing"):
        load_checkpoint(path, *make())


def test_leftovers_of_a_killed_save_never_hide_the_previous_checkpoint(saved):
    path, want = saved
    # Killed while writing: a staging folder beside the checkpoint.
    staging = staging_path(path)
    (staging / "rank0").mkdir(parents=True)
    (staging / "rank0" / "half").write_bytes(b"xx")
    model, opt = make(seed=7)
    assert load_checkpoint(path, model, opt) == {"step": 2}
    assert_same(weights(model), want)
    # Killed between the two renames: the previous checkpoint moved aside, none in place.
    os.rename(path, aside_path(path))
    model, opt = make(seed=7)
    assert load_checkpoint(path, model, opt) == {"step": 2}
    assert_same(weights(model), want)
    # The next save completes and clears both.
    train(model, opt, range(2, 3))
    save_checkpoint(path, model, opt, extra={"step": 3})
    assert not staging.exists() and not aside_path(path).exists()
    assert load_checkpoint(path, *make(seed=7)) == {"step": 3}


def test_a_failed_save_leaves_the_previous_checkpoint(saved):
    path, want = saved
    comm = commopt.create_communicator("local")

    def write(staging):
        (staging / "rank0").mkdir()
        raise OSError(28, "No space left on device")

    with pytest.raises(CheckpointError, match=r"rank 0: OSError.*No space left.*untouched"):
        save_parts(path, comm, write)
    model, opt = make(seed=7)
    assert load_checkpoint(path, model, opt) == {"step": 2}
    assert_same(weights(model), want)


def test_saving_over_a_folder_that_is_not_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="is not a commopt checkpoint: save to a new path"):
        save_checkpoint(tmp_path / "mine", *make())
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_manager_points_latest_at_the_newest_and_keeps_the_last_k(tmp_path):
    model, opt = make()
    ckpts = CheckpointManager(tmp_path, keep=2)
    assert ckpts.load_latest(model, opt) is None
    kept = {}
    for step in range(1, 5):
        train(model, opt, range(step - 1, step))
        ckpts.save(step, model, opt, extra={"step": step})
        kept[step] = weights(model)
    assert ckpts.steps() == [3, 4]
    assert (tmp_path / "latest").read_text() == "step-00000004\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step-00000003",
        "step-00000004",
    ]
    model2, opt2 = make(seed=7)
    restored = ckpts.load_latest(model2, opt2)
    assert (restored.step, restored.extra) == (4, {"step": 4})
    assert_same(weights(model2), kept[4])
    # Resumed from 3 (as if 4 were damaged), the run's new step 4 replaces the old one.
    model3, opt3 = make(seed=7)
    ckpts.load(3, model3, opt3)
    train(model3, opt3, range(5, 6))  # other data: a step 4 that differs from the first
    ckpts.save(4, model3, opt3, extra={"step": 4, "again": True})
    assert ckpts.steps() == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step-00000003",
        "step-00000004",
    ]
    model4, opt4 = make(seed=9)
    assert ckpts.load_latest(model4, opt4).extra == {"step": 4, "again": True}
    assert_same(weights(model4), weights(model3))


def test_a_damaged_latest_pointer_is_an_error_not_a_fresh_start(tmp_path):
    model, opt = make()
    ckpts = CheckpointManager(tmp_path, keep=3)
    ckpts.save(1, model, opt)
    (tmp_path / "latest").write_text("step-000")
    with pytest.raises(
        CheckpointError, match=r"latest is damaged.*complete checkpoints here: \[1\]"
    ):
        ckpts.load_latest(model, opt)
    (tmp_path / "latest").write_text("step-00000009\n")
    with pytest.raises(CheckpointError, match=r"step-00000009 is missing.*\[1\]"):
        ckpts.load_latest(model, opt)


def test_bad_residuals_mode_is_refused(saved):
    path, _ = saved
    with pytest.raises(ValueError, match="residuals='sum': choose one of reshard, refuse, drop"):
        load_checkpoint(path, *make(), residuals="sum")


def test_a_checkpoint_written_before_manifests_still_loads(saved):
    path, want = saved
    (path / "MANIFEST.json").unlink()  # the layout older commopt wrote: parts, no manifest
    model, opt = make(seed=7)
    assert load_checkpoint(path, model, opt) == {"step": 2}
    assert_same(weights(model), want)


SCHEDULE_OPTIONS = {
    "synchronous": {},
    "stale": {"schedule": "stale"},
    "compensated": {"schedule": "compensated"},
    "local steps": {"schedule": "local_steps", "sync_every": 3},
    "streaming local steps": {
        "schedule": "local_steps",
        "sync_every": 4,
        "fragments": 2,
        "overlap_steps": 1,
    },
    "two local-steps parts": {
        "schedule": "local_steps",
        "sync_every": 3,
        "plans": [("0.*", {"compression": None})],
    },
}


@pytest.mark.parametrize("options", SCHEDULE_OPTIONS.values(), ids=SCHEDULE_OPTIONS.keys())
def test_every_schedule_resumes_exactly_from_a_file_saved_at_any_step_of_its_cycle(
    tmp_path, options
):
    # The files drop empty containers (a cycle with nothing in flight, a state not yet
    # built): whatever the step, loading must give back the run it saved.
    for at in range(1, 6):
        model, opt = make(**options)
        train(model, opt, range(at))
        save_checkpoint(tmp_path / f"at{at}", model, opt)
        train(model, opt, range(at, 8))
        resumed, opt2 = make(**options)
        load_checkpoint(tmp_path / f"at{at}", resumed, opt2)
        train(resumed, opt2, range(at, 8))
        same = all(torch.equal(x, y) for x, y in zip(weights(model), weights(resumed)))
        assert same, f"resumed from the file saved after step {at}: other weights"
