"""The simulator's inputs: built-in model profiles, machine presets, codec speeds, the profiler."""

from __future__ import annotations

import json

import pytest
import torch

from commopt.sim import (
    Configuration,
    ModelProfile,
    from_benchmark,
    get_codec_cost,
    get_machine,
    list_machines,
    list_profiles,
    load_profile,
    simulate,
)
from commopt.sim.machines import Machine
from commopt.sim.model_specs import BUILDERS
from commopt.sim.profiler import profile_module, profile_named_model
from commopt.sim.resnet import resnet50, torchvision_available


def test_builtin_profiles_are_the_ones_the_builders_make():
    assert set(list_profiles()) == set(BUILDERS)
    for name, build in BUILDERS.items():
        if name == "resnet50":
            continue  # needs a forward pass; checked below
        assert load_profile(name) == build(), (
            f"{name}.json is stale: run python -m commopt.sim.model_specs"
        )


def test_resnet50_profile_has_torchvisions_parameters():
    profile = load_profile("resnet50")
    assert profile.numel == 25_557_032
    ours = [(n, p.shape) for n, p in resnet50(prefer_torchvision=False).named_parameters()]
    if torchvision_available():  # the fallback must be the same network
        assert ours == [(n, p.shape) for n, p in resnet50().named_parameters()]
    by_layer = {lay.name: lay.numel for lay in profile.layers}
    assert by_layer["conv1"] == 64 * 3 * 7 * 7 and by_layer["fc"] == 2048 * 1000 + 1000
    assert profile.step_time("v100") == pytest.approx(64 / 1226)


@pytest.mark.parametrize(
    "name, params, grad_bytes",
    [
        ("transformer-xl-base", 191.95e6, 2),  # DLE base: 137M tied embedding + 16 x 3.41M layers
        ("bert-large", 334.1e6, 4),
        ("bert-base", 108.9e6, 4),
        ("transformer-big", 209.9e6, 2),  # published: about 210M
    ],
)
def test_transformer_profiles_have_the_published_sizes(name, params, grad_bytes):
    p = load_profile(name)
    assert p.numel == pytest.approx(params, rel=1e-3)
    assert p.grad_bytes_per_param == grad_bytes
    assert p.sources, f"{name} must say where its numbers come from"


def test_txl_tied_embedding_is_the_last_gradient():
    p = load_profile("transformer-xl-base")
    first = p.layers[0]
    assert "tied" in first.name and first.numel / p.numel > 0.7


def test_profile_json_round_trip_and_errors(tmp_path):
    p = load_profile("resnet50").with_overrides(batch_per_gpu=32, gpu="cpu", throughput=3.0)
    path = tmp_path / "p.json"
    p.save(str(path))
    q = load_profile(str(path))
    assert q == p and q.step_time("cpu") == pytest.approx(32 / 3.0)
    with pytest.raises(ValueError, match="no single-GPU throughput for 'h100'"):
        q.step_time("h100")
    with pytest.raises(ValueError, match="unknown model"):
        load_profile("resnet5000")
    with pytest.raises(FileNotFoundError):
        load_profile(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="lacks or mistypes"):
        load_profile(str(bad))


def test_every_preset_documents_its_links():
    for name in list_machines():
        m = get_machine(name)
        keys = " ".join(m.sources)
        assert "inter" in keys and "intra" in keys, f"{name}: undocumented links"
        assert all(len(v) > 10 for v in m.sources.values())
        assert Machine.from_dict(m.to_dict()) == m


def test_machine_files_and_errors(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(
        json.dumps(
            {
                "name": "mine",
                "gpu": "v100",
                "gpus_per_node": 4,
                "intra": {"latency_us": 2, "GBps": 40},
                "inter_gbps": 100,
            }
        )
    )
    m = get_machine(str(path))
    assert m.gpus_per_node == 4 and m.inter.bandwidth_Bps == pytest.approx(100e9 / 8 * 0.9)
    assert simulate("resnet50", m, Configuration(), 16).nodes == 4
    with pytest.raises(ValueError, match="unknown machine"):
        get_machine("dgx-9000")
    path.write_text(json.dumps({"name": "x", "gpu": "v100", "gpus_per_node": 4, "inter_gbps": 1}))
    with pytest.raises(ValueError, match="'intra'"):
        get_machine(str(path))


def test_codec_speeds_from_the_codec_benchmark(tmp_path):
    path = tmp_path / "codecs.json"
    path.write_text(
        json.dumps(
            {
                "results": [
                    {"codec": "fp16", "encode_GBps": 100, "decode_GBps": 100},
                    {"codec": "qsgd4", "bytes_ratio": 0.14, "encode_GBps": 2.0, "decode_GBps": 4.0},
                ]
            }
        )
    )
    c = from_benchmark(str(path), "qsgd4")
    assert c.wire_bytes(1000, grad_bytes=4) == pytest.approx(560)
    assert c.encode_s(5e8, memory_GBps=1, grad_bytes=4) == pytest.approx(1.0)  # 2 GB at 2 GB/s
    # Measured 2-4 GB/s is far slower than the memory-bound default on a V100: more comm time.
    measured = simulate("resnet50", "v100-nvlink-25g", Configuration(compression=c), 64)
    modelled = simulate("resnet50", "v100-nvlink-25g", Configuration(compression="qsgd4"), 64)
    assert measured.comm_s > modelled.comm_s > 0
    with pytest.raises(ValueError, match="no entry for codec 'qsgd8'"):
        from_benchmark(str(path), "qsgd8")
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec_cost("zip")


def test_profile_a_real_module_on_the_cpu():
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    prof = profile_module(net, lambda: (torch.randn(32, 64),), name="mlp", batch=32, iterations=2)
    assert [lay.name for lay in prof.layers] == ["0", "2", "4"]
    assert [lay.numel for lay in prof.layers] == [64 * 256 + 256, 256 * 256 + 256, 2570]
    assert all(lay.backward_weight > 0 for lay in prof.layers)
    assert 0 < prof.forward_fraction < 1 and prof.throughput["cpu"] > 0
    # The measured profile drives the simulator on the CPU testbed.
    assert simulate(prof, "testbed-1gbit", Configuration(), 2).comm_s > 0


def test_profile_named_model_refuses_what_it_cannot_run():
    # The real ResNet-50 run is in test_sim_cli.py (test_profile_model_on_this_cpu).
    with pytest.raises(ValueError, match="profilable"):
        profile_named_model("gpt5")
    with pytest.raises(ValueError, match="profile-image-size 64"):
        profile_named_model("resnet50", batch=1, image_size=32)


def test_profiles_validate_their_fields():
    with pytest.raises(ValueError, match="no layers"):
        ModelProfile("x", "s", 1, 4, 0.3, {"cpu": 1.0}, ())
    with pytest.raises(ValueError, match="grad_bytes_per_param"):
        load_profile("resnet50").with_overrides(grad_bytes_per_param=3)
