"""`commopt bench hsdp`'s table and options, from a saved report (no ranks started)."""

import pytest

from commopt.bench.hsdp import render
from commopt.bench.hsdp.worker import check_configs

SPEED = {
    "mode": "speed",
    "model": "wide MLP",
    "batch": 8,
    "params": 25_000_000,
    "world": 4,
    "link": "emulated hosts joined by 1gbit links",
    "rate_bits": 1e9,
    "nodes": 2,
    "ranks_per_node": 2,
    "cores": 2,
    "steps": 10,
    "rounds": 3,
    "configs": {
        "fsdp-node": {
            "step_s": 0.3,
            "rounds_s": [0.3],
            "wire_bytes_per_rank": 0,
            "final_loss": 2.0,
        },
        "hsdp-fp32": {
            "step_s": 1.2,
            "rounds_s": [1.2, 1.3],
            "wire_bytes_per_rank": 50_000_000,
            "final_loss": 2.0,
        },
        "commopt-qsgd4-ef": {
            "step_s": 0.4,
            "rounds_s": [0.4],
            "rank_cpu_s": 0.45,
            "wire_bytes_per_rank": 6_600_000,
            "final_loss": 2.0,
        },
    },
}


def test_speed_table_gives_the_floors_and_the_speed_up():
    text = render(SPEED, markdown=True)
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines()}
    # hsdp-fp32: 2 ranks x 50 MB per host cross a 1 Gbit/s link: 800 ms; node-only 300 ms
    assert "| 1200 (1200, 1300) | - | 95.4 | 800 | 300 | 800 | 1.50 | 1.00x |" in rows["hsdp-fp32"]
    assert "| 400 (400) | 450 | 12.6 | 106 | 300 | 300 | 1.33 | 3.00x |" in rows["commopt-qsgd4-ef"]
    assert "share this machine's 2 cores" in text


def test_accuracy_table_gives_the_gap_to_fp32():
    report = {
        "mode": "accuracy",
        "task": "digits",
        "budget": 150,
        "batch": 64,
        "nodes": 2,
        "ranks_per_node": 2,
        "link": "plain loopback",
        "configs": {
            "hsdp-fp32": [
                {"seed": 0, "valid_loss": 0.1, "replicas_equal": True, "skipped_steps": 0}
            ],
            "commopt-qsgd4-ef": [
                {"seed": 0, "valid_loss": 0.1005, "replicas_equal": True, "skipped_steps": 0}
            ],
        },
    }
    assert "| commopt-qsgd4-ef | 0 | 0.1005 | +0.50% | - | - | yes | 0 |" in render(
        report, markdown=True
    )


def test_unknown_configuration_is_refused_with_the_list():
    check_configs(["fsdp-node", "hsdp-bf16", "commopt-qsgd8-ef", "commopt-fp16"])
    with pytest.raises(SystemExit, match="commopt-<codec>"):
        check_configs(["commopt-qsgd5"])
    with pytest.raises(SystemExit, match="hsdp-fp32"):
        check_configs(["ddp-fp32"])
