"""Short accuracy-parity check on real data (load_digits): each codec stays near fp32, and the
check is able to fail: a faulty codec and plain double buffering at fp32's schedule are caught.

Data parallelism over 4 replicas is simulated in one process through the codecs' own
encode/decode (benchmarks/accuracy_sim.py); this is an accuracy test, not a transport test.
The full 3-seed tables are in docs/accuracy.md (benchmarks/accuracy_parity.py).
"""

from __future__ import annotations

import pytest
import torch

from commopt.codecs.cast import CastCodec
from tests.unit.bench_scripts import load_benchmark

pytest.importorskip("sklearn")
STEPS = 80  # about 3.5 epochs: far from converged, far from untrained
TOLERANCE = 0.10  # relative final validation loss; measured spread of sound codecs <= ~5%


class HalfDropped(CastCodec):
    """An fp32 wire that loses the second half of every buffer (an offset bug)."""

    def __init__(self):
        super().__init__(torch.float32)
        self.name = "half-dropped"

    def encode(self, x, out, *, scale=1.0, rng=None, key=None):
        super().encode(x, out, scale=scale, rng=rng, key=key)
        out.view(torch.float32)[x.numel() // 2 :] = 0


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_codecs_keep_fp32_accuracy_and_a_faulty_codec_is_caught():
    parity = load_benchmark("accuracy_parity")
    res = parity.check(
        "digits",
        "sgd",
        ["fp16", "bf16", "qsgd8", "qsgd4+ef"],
        steps=STEPS,
        tolerance=TOLERANCE,
        codec_factories={"half-dropped": HalfDropped},
    )
    bad = {k: round(v["relative"], 3) for k, v in res.items() if not v["ok"]}
    assert set(bad) == {"half-dropped"}, f"relative loss vs fp32 outside {TOLERANCE}: {bad}"
    assert res["half-dropped"]["relative"] > 3 * TOLERANCE


def test_compensated_double_buffering_keeps_accuracy_where_plain_does_not():
    parity = load_benchmark("accuracy_parity")
    res = parity.check("digits", "adam", ["comp", "db"], steps=STEPS, tolerance=TOLERANCE)
    assert res["comp"]["ok"], (
        f"compensated double buffering: {res['comp']['relative']:+.3f} vs fp32"
    )
    assert not res["db"]["ok"], (
        "plain double buffering should lose accuracy at fp32's schedule here"
    )
