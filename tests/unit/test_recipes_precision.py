"""The recipes' mixed precision runs one code path on CUDA and CPU: checked here with CPU
bf16 autocast (fp16 with GradScaler needs CUDA: tests/gpu/test_transformer_recipe.py)."""

import json

import pytest
import torch

import commopt
from recipes.precision import MixedPrecision
from tests.recipe_args import tiny_resnet

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "option, dtype",
    [
        ("auto", None),
        ("off", None),
        ("fp32", None),
        ("on", torch.bfloat16),
        ("bf16", torch.bfloat16),
    ],
)
def test_cpu_resolution(option, dtype):
    mp = MixedPrecision.resolve(option, CPU)
    assert mp.dtype == dtype and mp.scaler is None


def test_float16_on_the_cpu_says_what_to_use():
    with pytest.raises(ValueError, match="use bf16"):
        MixedPrecision.resolve("fp16", CPU)
    with pytest.raises(ValueError, match="choose one of"):
        MixedPrecision.resolve("fp8", CPU)


def test_transformer_bf16_steps_through_the_multi_node_optimizer():
    """A few updates of the recipe's model under the shared bf16 path: the forward runs in
    bf16, gradients and weights stay fp32, the loss goes down."""
    from recipes.transformer.model import Transformer, architecture, label_smoothed_nll_loss

    torch.manual_seed(0)
    cfg = architecture("transformer_tiny", encoder_layers=1, decoder_layers=1, dropout=0.0)
    model = Transformer(cfg, 40)
    comm = commopt.create_communicator("local")
    opt = commopt.create_multi_node_optimizer(
        torch.optim.Adam(model.parameters(), lr=3e-3), comm, model=model
    )
    mp = MixedPrecision.resolve("bf16", CPU)
    src = torch.randint(4, 40, (4, 7))
    prev = torch.randint(4, 40, (4, 6))
    target = torch.randint(4, 40, (4, 6))
    losses = []
    for _ in range(5):
        opt.zero_grad()
        with mp.autocast():
            logits = model(src, prev)
        assert logits.dtype == torch.bfloat16
        loss, _ = label_smoothed_nll_loss(logits, target, 0.1)
        mp.backward(loss / target.numel())
        assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)
        mp.step(opt)
        losses.append(float(loss))
    assert opt.applied_steps == 5 and losses[-1] < losses[0], losses


def test_resnet_recipe_runs_bf16_autocast_on_the_cpu(tmp_path, capsys):
    """The recipe's --amp bf16 on the CPU: the same training loop as fp16 on CUDA, logged as
    bf16; its losses differ from fp32's (autocast took effect) and are finite."""
    from recipes.resnet50 import train as recipe

    tiny = [
        *tiny_resnet(train_size=8, val_size=4, communicator="local", log_every=1, max_steps=2),
        "--no-eval",
    ]
    losses = {}
    for amp in ("bf16", "off"):
        log = tmp_path / f"{amp}.jsonl"
        assert recipe.main(tiny + ["--amp", amp, "--log-jsonl", str(log)]) == 0
        records = [json.loads(line) for line in log.read_text().splitlines()]
        assert records[0]["event"] == "config" and records[0]["amp"] == (
            "bf16" if amp == "bf16" else "fp32"
        )
        losses[amp] = [r["loss"] for r in records if r["event"] == "train"]
    capsys.readouterr()
    assert len(losses["bf16"]) == 2 and all(torch.isfinite(torch.tensor(losses["bf16"])))
    assert losses["bf16"] != losses["off"]
    assert recipe.main(tiny + ["--amp", "fp16"]) == 2
    assert "use bf16" in capsys.readouterr().err
