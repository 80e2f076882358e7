"""benchmarks/gpu_bench.py on a machine without a GPU: its arguments, its codec list and the
report it writes from a result file (the measurements themselves need CUDA: make gpu-check)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.bench_scripts import load_benchmark

gpu_bench = load_benchmark("gpu_bench")

SAMPLE = {
    "command": "python benchmarks/gpu_bench.py --json r.json",
    "device": "NVIDIA H100 80GB HBM3",
    "torch": "2.13.0+cu128",
    "cuda": "12.8",
    "triton": "3.7.1",
    "host": "h",
    "mib": 64.0,
    "numel": 16777216,
    "reps": 20,
    "codecs": {
        "copy_ms": 0.05,
        "copy_gbs": 1342.2,
        "rows": [
            {
                "codec": "qsgd4",
                "encode_ms": 0.08,
                "decode_ms": 0.06,
                "encode_gbs": 1000.0,
                "decode_gbs": 1100.0,
                "wire_ratio": 0.1328,
            },
            {
                "codec": "fp16",
                "encode_ms": 0.2,
                "decode_ms": 0.06,
                "encode_gbs": 335.5,
                "decode_gbs": 1100.0,
                "wire_ratio": 0.5,
            },
        ],
    },
    "allreduce": {
        "world_size": 1,
        "torch_nccl_ms": 0.30,
        "pure_nccl_ms": 0.25,
        "rows": [{"codec": "qsgd4", "ms": 0.9}],
    },
}


def test_arguments_and_their_errors():
    args = gpu_bench.parse_args([])
    assert args.mib == 64.0 and args.reps == 20 and args.from_json is None
    with pytest.raises(SystemExit):
        gpu_bench.parse_args(["--mib", "0"])
    with pytest.raises(SystemExit):
        gpu_bench.parse_args(["--from", "x.json"])  # nowhere to write the report


def test_every_benchmarked_codec_exists():
    for name in gpu_bench.CODECS:
        codec = gpu_bench.make_codec(name)
        assert codec.encoded_nbytes(1024) > 0, name


def test_report_from_a_result_file(tmp_path):
    src = tmp_path / "gpu.json"
    src.write_text(json.dumps(SAMPLE))
    out = tmp_path / "docs" / "benchmarks-gpu.md"
    assert gpu_bench.main(["--from", str(src), "--report", str(out)]) == 0
    text = out.read_text()
    assert "NVIDIA H100 80GB HBM3" in text and "1342.2 GB/s" in text
    # rows without the limit or the lone call (an older result) show dashes there
    assert "| - | qsgd4 | 0.133 | 1000.0 | 75% | - | - | 1100.0 | met |" in text
    assert "| - | fp16 | 0.500 | 335.5 | 25% | - | - | 1100.0 | missed |" in text
    assert (
        "same buffer: met" in text
        and "| collectives.allreduce, qsgd4 (scatter_reduce) | 0.900 |" in text
    )
    no_allreduce = dict(SAMPLE)
    del no_allreduce["allreduce"]
    assert "## Allreduce" not in gpu_bench.render(no_allreduce)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_measuring_without_a_gpu_says_so():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        gpu_bench.main(["--mib", "1"])


def test_the_table_gives_each_encode_its_limit_and_its_lone_call():
    size = {
        "mib": 256,
        "copy_gbs": 2000.0,
        "rows": [
            {
                "codec": "qsgd4+ef",
                "encode_gbs": 400.0,
                "encode_alone_gbs": 390.0,
                "decode_gbs": 1500.0,
                "wire_ratio": 0.1328,
                "limit": gpu_bench.encode_limit(0.1328, True),
            }
        ],
    }
    rows = gpu_bench.codec_table([size])
    assert "| 256 | copy | - | 2000.0 | 100% | - | - | - | - |" in rows
    assert "| 256 | qsgd4+ef | 0.133 | 400.0 | 20% | 64% | 390.0 | 1500.0 | missed |" in rows
    # error feedback reads and writes the residual: its limit is below the fp32 copy's
    assert gpu_bench.encode_limit(0.5, True) < 1 < gpu_bench.encode_limit(0.5, False)
