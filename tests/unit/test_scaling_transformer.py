"""recipes/scaling.py with --recipe transformer: the plan (commands) and the parsing of its logs."""

import json

from recipes import scaling


def test_transformer_plan_covers_every_rank_count_and_configuration(tmp_path, capsys):
    assert (
        scaling.main(
            [
                "--recipe",
                "transformer",
                "--dry-run",
                "--launcher",
                "mpirun",
                "--ranks",
                "1,2,4",
                "--configs",
                "fp32,qsgd4+ef+db",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 6
    assert all("recipes.transformer.train" in ln and "--max-tokens 2000" in ln for ln in lines)
    assert ["-np 1" in ln for ln in lines[:3]] == [True, False, False]
    assert "--compression qsgd4+ef --double-buffering" in lines[-1] and "-np 4" in lines[-1]


def test_transformer_table_uses_tokens_and_loss(tmp_path):
    log = tmp_path / "run.jsonl"
    log.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"event": "train", "update": 1, "wps": 10.0, "train_time": 1.0},
                {"event": "train", "update": 2, "wps": 200.0, "train_time": 2.0},
                {"event": "valid", "update": 2, "loss": 7.0},
            ]
        )
    )
    run = scaling.read_transformer_run(log, target_loss=6.0)
    assert (
        run["throughput"] == 200.0 and run["time_to_target_s"] is None and run["valid_loss"] == 7.0
    )
    results = [
        {"config": "fp32", "ranks": 1, **run},
        {"config": "fp32", "ranks": 2, "throughput": 300.0},
    ]
    scaling.efficiency_table(results, [1, 2], ["fp32"])
    assert results[1]["efficiency"] == 0.75
    table = scaling.markdown(
        results,
        [1, 2],
        ["fp32"],
        {
            "target": 6.0,
            "link_note": "x",
            "steps": 2,
            "per_rank_batch": 2000,
            "preset": "smoke",
            "unit": "tokens/s",
            "target_name": "valid loss",
            "per_rank_unit": "tokens",
        },
    )
    assert "1 rank: tokens/s (e)" in table and "time to valid loss 6 at 2 ranks" in table
    assert "| fp32 | 200.0 (1.00) | 300.0 (0.75) | not reached |" in table
