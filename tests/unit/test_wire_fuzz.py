"""Bytes from the wire are untrusted: codec decodes, kernels, API arguments, object messages.

The fuzzing itself is benchmarks/fuzz_wire.py (10,000 examples per target there, a few dozen
here); these tests run each of its targets briefly and pin the behaviours it relies on: a
scale no encoder writes raises, a wire of the wrong size raises, and a NaN scale that a
damaged wire carries is caught by the step's NaN/Inf agreement on every rank, because the
codec's ``can_overflow`` makes the reduction re-check its result. The low-rank codec has no
flat wire: its decoding stages take the summed P's and Q's, size checked, and the same
re-check catches what a damaged sum spells.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

from commopt.codecs import QSGD, PowerSGD, get_codec
from commopt.codecs.exact import Exact
from commopt.comm.objects import decode, encode
from tests.multirank import run_torch
from tests.unit.bench_scripts import load_benchmark

fuzz = load_benchmark("fuzz_wire")

#: examples per target in CI; the benchmark runs 10,000.
CI_EXAMPLES = 25


@pytest.mark.parametrize("target", [t for t in fuzz.TARGETS if t != "kernels:triton"])
def test_fuzz_target_finds_nothing(target):
    result = fuzz.run_target(target, CI_EXAMPLES)
    if "skipped" in result:
        pytest.skip(result["skipped"])
    assert result["failure"] is None, f"{target}: {result['failure']}"
    assert result["examples"] >= CI_EXAMPLES, result


def test_fuzz_harness_reports_a_silent_nan():
    """The check the benchmark counts as a silent corruption does fire."""

    codec = QSGD(bits=4, bucket_size=128)
    codec.can_overflow = False  # as if reductions did not re-check QSGD's results
    wire = torch.zeros(codec.encoded_nbytes(10), dtype=torch.uint8)
    wire[:4] = torch.tensor([float("nan")]).view(torch.uint8)
    case = {"n": 10, "size": wire.numel(), "kind": "scale", "wire": wire, "offset": 0}
    case.update(accumulate=False, alpha=1.0, seed=0)
    with pytest.raises(fuzz.Finding, match="do not re-check"):
        fuzz.check_codec(codec, case)


def _qsgd_wire(codec, n=300):
    x = torch.linspace(-1, 1, n)
    wire = torch.empty(codec.encoded_nbytes(n), dtype=torch.uint8)
    codec.encode(x, wire)
    return wire


@pytest.mark.parametrize("value", [-1.0, float("-inf"), 1e38])
@pytest.mark.parametrize("impl", ["native", "reference"])
def test_qsgd_refuses_a_scale_no_encoder_writes(value, impl, monkeypatch):
    monkeypatch.setenv("COMMOPT_KERNELS", impl)
    codec = get_codec("qsgd4")  # 7 levels: 7 * 1e38 overflows float32
    wire = _qsgd_wire(codec)
    wire[4:8] = torch.tensor([value]).view(torch.uint8)  # bucket 1's scale
    out = torch.full((300,), 5.0)
    with pytest.raises(ValueError, match="qsgd4: corrupted wire: bucket 1 has scale"):
        codec.decode(wire, out, accumulate=True)
    assert bool((out == 5.0).all()), "decode wrote before it raised"


def test_qsgd_nan_scale_decodes_as_nan_and_is_rechecked():
    codec = get_codec("qsgd4")
    wire = _qsgd_wire(codec)
    wire[:4] = torch.tensor([float("nan")]).view(torch.uint8)
    out = torch.zeros(300)
    codec.decode(wire, out)
    assert bool(out[:128].isnan().all()) and bool(out[128:].isfinite().all())
    assert codec.can_overflow, "reductions through QSGD must re-check their result"


@pytest.mark.parametrize("name", ["none", "fp16", "bf16", "qsgd2", "qsgd8+ef"])
def test_every_codec_rechecks_its_reductions(name):
    assert get_codec(name).can_overflow


@pytest.mark.parametrize("nbytes", [0, 4, 36, 44])
def test_exact_refuses_a_wire_of_the_wrong_size(nbytes):
    codec = Exact(torch.float32)
    out = torch.zeros(10)
    with pytest.raises(ValueError, match="bytes but 10 elements need 40"):
        codec.decode(torch.zeros(nbytes, dtype=torch.uint8), out)
    with pytest.raises(TypeError, match=r"exact: out must be torch\.float32"):
        codec.decode(torch.zeros(20, dtype=torch.uint8), torch.zeros(10, dtype=torch.float16))


def _message(tree, blob=b""):
    header = json.dumps(tree).encode()
    return struct.pack("<Q", len(header)) + header + blob


@pytest.mark.parametrize(
    "message, says",
    [
        (struct.pack("<Q", 200000) + b"[" * 100000 + b"]" * 100000, "not JSON"),
        (_message({"$tuple": 5}), "\\$tuple needs a list"),
        (_message({"$dict": [[{"a": 1}, 2]]}), "a dict key is a dict"),
        (_message({"$tensor": ["float32", [3], "cpu", 0, 4]}, b"abcd"), "needs 12 bytes"),
        (_message({"$tensor": ["float32", [-1], "cpu", 0, 4]}, b"abcd"), "non-negative"),
        (_message({"$tensor": ["bool", [2], "cpu", 0, 2]}, b"\x07\x01"), "other than 0 and 1"),
        (_message({"$tensor": ["float32", [0], 5, 0, 0]}), "device must be a str"),
        (_message({"$bytes": None}), "\\$bytes needs a list of 2"),
        (_message({"$ndarray": ["bfloat16", [1], 0, 2]}, b"ab"), "NumPy has no dtype"),
        (struct.pack("<Q", 2) + b"\xff\xfe", "not JSON"),
    ],
)
def test_malformed_object_messages_raise_value_error(message, says):
    with pytest.raises(ValueError, match=says):
        decode(message)


def test_object_message_device_names_no_torch_attribute():
    """A peer's device string is not looked up on torch: the tensor stays on the CPU."""
    message = _message({"$tensor": ["float32", [1], "distributed", 0, 4]}, b"\0\0\x80?")
    t = decode(message)
    assert t.device.type == "cpu" and t.tolist() == [1.0]
    assert decode(encode(t)).tolist() == [1.0]


def _lowrank_job(codec, numel=12 * 40 + 7, reduction=1):
    shapes = [(0, (12, 40)), (480, (7,))]  # a compressed matrix, then values sent exactly
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(reduction))
    return flat, codec.start(flat, shapes, key="b", factor=1.0, size=1, reduction=reduction)


@pytest.mark.parametrize("stage", ["P", "Q"])
@pytest.mark.parametrize("delta", [-4, -1, 1, 4])
def test_lowrank_refuses_a_sum_of_the_wrong_size(stage, delta):
    codec = PowerSGD(rank=4)
    _, job = _lowrank_job(codec)
    need = 4 * (job.p.numel() if stage == "P" else job.q.numel())  # 4 * (12*4 + 7), 4 * 40*4
    wire = torch.zeros(need + delta, dtype=torch.uint8)
    with pytest.raises(
        ValueError,
        match=f"powersgd4: the summed {stage} of bucket 'b' is "
        f"{need + delta} bytes; this bucket's placement needs {need} bytes",
    ):
        if stage == "P":
            job.after_p_sum(wire)
        else:
            job.after_p_sum()
            job.after_q_sum(wire)
    assert codec.q("b") is None and codec.residual("b") is None, "state kept from a bad sum"
    with pytest.raises(TypeError, match=r"1-D uint8 \(bytes\) or float32"):
        job.after_p_sum(torch.zeros(job.p.numel(), dtype=torch.float64))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_lowrank_damaged_q_reaches_the_result_is_rechecked_and_undone(value):
    """A damaged Q sum spells NaN/Inf in the result: PowerSGD's
    ``can_overflow`` makes the reduction re-check it; its kept Q and residual stay finite
    and ``discard_step`` (the skipped step) puts back the previous ones bit for bit."""
    codec = PowerSGD(rank=4)
    flat, job = _lowrank_job(codec, reduction=0)
    job.after_p_sum()
    job.after_q_sum()
    q0, res0 = codec.q("b").clone(), codec.residual("b").clone()
    flat, job = _lowrank_job(codec, reduction=1)
    job.after_p_sum()
    wire = job.q.clone()
    wire[5] = value
    job.after_q_sum(wire.view(torch.uint8))
    assert not bool(torch.isfinite(flat).all())
    assert codec.can_overflow, "reductions through PowerSGD must re-check their result"
    assert bool(codec.q("b").isfinite().all()) and bool(codec.residual("b").isfinite().all())
    codec.discard_step()
    assert torch.equal(codec.q("b"), q0) and torch.equal(codec.residual("b"), res0)


def test_lowrank_nan_in_a_p_column_leaves_the_matrix_finite():
    """A NaN in a matrix's summed P: the orthogonalisation zeroes that column (no NaN
    reaches the matrix); a NaN among the values sent exactly reaches them (re-checked)."""
    codec = PowerSGD(rank=4)
    flat, job = _lowrank_job(codec)
    wire = job.p.clone()
    wire[0] = float("nan")  # row 0 of the matrix's P, column 0
    job.after_p_sum(wire)
    job.after_q_sum()
    assert bool(flat[:480].isfinite().all()) and bool(flat[480:].isfinite().all())
    flat, job = _lowrank_job(codec, reduction=2)
    wire = job.p.clone()
    wire[-1] = float("nan")  # the last value sent exactly
    job.after_p_sum(wire)
    job.after_q_sum()
    assert bool(flat[-1].isnan()) and bool(flat[:-1].isfinite().all())


def test_fuzz_harness_reports_a_silent_lowrank_nan(monkeypatch):
    """With the re-check off, the low-rank target counts a NaN in the result as silent."""
    monkeypatch.setattr(PowerSGD, "can_overflow", False)
    case = {"shapes": [(0, (12, 40))], "numel": 480, "ranks": 2, "warm": False, "stage": "Q"}
    case.update(size=4 * 160, kind="value", at=3, value=float("nan"), seed=0, offset=1)
    with pytest.raises(fuzz.Finding, match="do not re-check"):
        fuzz.check_lowrank("powersgd4", case)
    monkeypatch.undo()
    assert fuzz.check_lowrank("powersgd4", case) == "nan/inf, re-checked"


DAMAGED_PEER = r"""
import json, sys
import torch, commopt
from commopt.codecs import QSGD, PowerSGD

class DamagingQSGD(QSGD):
    # What arrives from a faulty peer or a damaged link: the first scale of each wire is NaN.
    damage = False

    def encode(self, x, out, **kw):
        super().encode(x, out, **kw)
        if self.damage and out.numel() >= 4:
            out[:4] = torch.tensor([float("nan")]).view(torch.uint8)

class DamagingPowerSGD(PowerSGD):
    # A faulty peer's contribution to the sum of the Q's: its first value is NaN.
    damage = False

    def start(self, *args, **kw):
        job = super().start(*args, **kw)
        if self.damage:
            form_q = job.after_p_sum

            def after_p_sum(summed=None):
                q = form_q(summed)
                q[:1] = float("nan")
                return q

            job.after_p_sum = after_p_sum
        return job

comm = commopt.create_communicator("torch")

def run(recheck):
    if sys.argv[1] == "qsgd":
        codec = DamagingQSGD(bits=4, bucket_size=128)
    else:
        codec = DamagingPowerSGD(rank=4)
    codec.can_overflow = recheck
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64, bias=False)
    opt = commopt.create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), comm, model=model, compression=codec
    )
    gen = torch.Generator().manual_seed(comm.rank)

    def step():
        opt.zero_grad()
        model(torch.randn(8, 64, generator=gen)).pow(2).sum().backward()
        opt.step()

    step()
    before = model.weight.detach().clone()
    codec.damage = comm.rank == 1  # only rank 1's wires are damaged; every input is finite
    step()
    codec.damage = False
    after = model.weight.detach().clone()
    step()
    end = model.weight.detach()
    opt.close()
    return {
        "skipped": opt.skipped_steps,
        "unchanged": torch.equal(before, after),
        "finite": bool(torch.isfinite(after).all()),
        "trains_on": bool(torch.isfinite(end).all()) and not torch.equal(after, end),
    }

print(json.dumps({"checked": run(True), "unchecked": run(False)}))
"""


@pytest.mark.parametrize("codec", ["qsgd", "powersgd"])
def test_damaged_scale_is_caught_by_the_nan_agreement_on_every_rank(codec):
    """A NaN scale from rank 1's wire, or a NaN in rank 1's share of the low-rank Q sum
    (finite inputs everywhere): the reduction's re-check flags it, every rank skips that
    step with its weights untouched, and training goes on. The same run with the re-check
    switched off writes NaN into a rank's weights, which is what ``can_overflow=True``
    prevents."""
    outs = run_torch(DAMAGED_PEER, 2, timeout=240, args=[codec])
    runs = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    for rank, r in enumerate(runs):
        want = {"skipped": 1, "unchanged": True, "finite": True, "trains_on": True}
        assert r["checked"] == want, f"rank {rank}: {r['checked']}"
    assert not all(r["unchecked"]["finite"] for r in runs), runs
