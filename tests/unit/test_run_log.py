"""recipes/run_log.py: the records both recipes write and what people see on each mode."""

import json

import pytest

from recipes.run_log import RunLog


def test_records_append_to_a_new_folder_in_one_format(tmp_path):
    path = tmp_path / "runs" / "log.jsonl"
    for run in (1, 2):  # a second run (a resume) appends
        with RunLog(rank=0, path=path, progress="none") as log:
            log.event("train", step=run, loss=1 / 3, top1=float("inf"), lrs=(0.1, 0.2))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    first = records[0]
    assert list(first)[:3] == ["event", "time", "wall"] and first["event"] == "train"
    assert first["loss"] == 0.333333 and first["top1"] is None and first["lrs"] == [0.1, 0.2]


def test_other_ranks_write_and_show_nothing(tmp_path, capsys):
    path = tmp_path / "log.jsonl"
    log = RunLog(rank=1, path=path, progress="text")
    log.event("config", echo=True, world_size=2)
    log.advance(1, "step 1")
    log.write("hello")
    log.close()
    assert not path.exists()
    assert capsys.readouterr() == ("", "")


def test_text_mode_prints_status_and_echoed_records_none_mode_prints_nothing(capsys):
    log = RunLog(rank=0, progress="text")
    log.event("train", step=1)  # a record only
    log.event("eval", echo=True, step=1, top1=0.5)
    log.advance(1, "epoch 0.50 loss 2.3")
    log.advance(1)  # no status: no line
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines[0].startswith("[eval] wall ") and lines[0].endswith("| step 1 | top1 0.5")
    assert lines[1:] == ["epoch 0.50 loss 2.3"]
    quiet = RunLog(rank=0, progress="none")
    quiet.event("eval", echo=True, step=1)
    quiet.advance(1, "status")
    quiet.write("hello")
    assert capsys.readouterr() == ("", "")


def test_bar_mode_draws_a_bar_and_lines_above_it(capsys):
    pytest.importorskip("tqdm")
    log = RunLog(rank=0, progress="bar", total=4, initial=1, unit="upd")
    assert log.bar_shown
    log.advance(3, "loss 1.5")
    log.write("eval: top1 0.5")
    log.close()
    out, err = capsys.readouterr()
    assert out == ""
    assert "4/4" in err and "loss 1.5" in err and "upd" in err and "eval: top1 0.5" in err


def test_a_bad_progress_mode_is_named():
    with pytest.raises(ValueError, match="auto, bar, text, none"):
        RunLog(rank=0, progress="fancy")
