"""One vocabulary: a JSON configuration serves `commopt simulate --config` and
create_multi_node_optimizer(**cfg) alike, under the same names."""

import inspect
import json
from pathlib import Path

import pytest
import torch

import commopt
from commopt.cli import main
from commopt.sim.configuration import CONFIG_KEYS, Configuration

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "optimizer-config.json"


def _optimizer_parameters() -> set[str]:
    return set(inspect.signature(commopt.create_multi_node_optimizer).parameters)


def test_every_key_the_simulator_reads_is_an_optimizer_parameter():
    assert set(CONFIG_KEYS) <= _optimizer_parameters(), set(CONFIG_KEYS) - _optimizer_parameters()


def test_the_documented_configuration_runs_in_both(capsys):
    cfg = json.loads(EXAMPLE.read_text())
    assert set(cfg) <= _optimizer_parameters(), set(cfg) - _optimizer_parameters()

    assert main(["simulate", "--config", str(EXAMPLE), "--gpus", "16", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["compression"] == "qsgd4" and plan["double_buffering"] is True
    assert plan["bucket_cap_mb"] == cfg["bucket_cap_mb"]

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = commopt.create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        commopt.create_communicator("local"),
        model=model,
        **cfg,
    )
    before = model.weight.detach().clone()
    for _ in range(3):  # double buffering applies step t's average at step t + 1
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).sum().backward()
        opt.step()
    opt.flush()
    assert not torch.equal(model.weight, before)


def test_flags_override_the_configuration(tmp_path, capsys):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"compression": "qsgd4", "double_buffering": True, "seed": 3}))
    args = ["simulate", "--config", str(path), "--gpus", "16", "--json"]
    assert main([*args, "--compression", "fp16", "--no-overlap"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert (plan["compression"], plan["overlap"], plan["double_buffering"]) == ("fp16", False, True)
    path.write_text(json.dumps({"allreduce_grad_dtype": "bfloat16"}))
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["compression"] == "bf16"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--algorithm", "sra"], "'scatter_reduce'"),
        (["--algorithm", "nccl"], "'native'"),
        (["--bucket-mb", "50"], "--bucket-cap-mb"),
        (["--codec", "fp16"], "--compression"),
        (["--overlap", "double-buffering"], "--double-buffering"),
        (["--overlap", "none"], "--no-overlap"),
    ],
)
def test_earlier_spellings_fail_naming_the_new_one(argv, message, capsys):
    assert main(["simulate", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_configuration_with_an_unknown_or_renamed_key_fails_clearly(tmp_path, capsys):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"bucket_mb": 50}))
    assert main(["simulate", "--config", str(path)]) == 2
    assert "'bucket_cap_mb'" in capsys.readouterr().err
    path.write_text(json.dumps({"piece_mb": 1}))
    assert main(["simulate", "--config", str(path)]) == 2
    assert "not an option of create_multi_node_optimizer" in capsys.readouterr().err
    path.write_text("[1, 2]")
    assert main(["simulate", "--config", str(path)]) == 2
    assert "JSON object" in capsys.readouterr().err
    with pytest.raises(TypeError, match="'bucket_cap_mb'"):
        Configuration(bucket_mb=50)
    with pytest.raises(ValueError, match="double_buffering=True"):
        Configuration(overlap="double-buffering")
