"""The low-rank codec on a GPU: the same results as on the CPU, and no host round trip.

``torch.cuda.set_sync_debug_mode("error")`` makes any operation that waits for the device
(a value read back, a synchronous copy) raise: the codec's steps after a bucket's first one
must not contain any.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import commopt
from commopt import collectives
from commopt.codecs import PowerSGD
from tests.unit.test_codecs_lowrank import reduce_once

SHAPES = [(0, (64, 48)), (3072, (48,)), (3120, (16, 8, 3, 3)), (4272, (1, 40))]
NUMEL = 4312


def _inputs(steps: int, ranks: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [[torch.randn(NUMEL, generator=g) for _ in range(ranks)] for _ in range(steps)]


def test_same_results_as_on_the_cpu_and_no_host_sync():
    steps = _inputs(4, 2)
    cpu = [PowerSGD(4) for _ in range(2)]
    gpu = [PowerSGD(4) for _ in range(2)]
    for t, xs in enumerate(steps):
        want = reduce_once(cpu, xs, SHAPES, step=t)
        dev = [x.cuda() for x in xs]
        if t == 0:
            got = reduce_once(gpu, dev, SHAPES, step=t)
        else:
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = reduce_once(gpu, dev, SHAPES, step=t)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for w, o in zip(want, got):
            assert o.device.type == "cuda"
            err = ((o.cpu() - w).abs().max() / w.abs().max()).item()
            assert err < 1e-4, f"step {t}: GPU differs from CPU by {err}"
        assert gpu[0].q("b0").device.type == "cuda"
        assert gpu[0].residual("b0").device.type == "cuda"


def test_allreduce_plan_on_cuda_tensors():
    comm = commopt.create_communicator("local")
    codec = PowerSGD(2, min_compression_rate=0.0)
    m = torch.outer(torch.arange(1.0, 9.0), torch.arange(1.0, 7.0)).reshape(-1).cuda()
    flat = m.clone()
    for step in range(3):
        flat.copy_(m)
        collectives.allreduce(
            comm,
            flat,
            codec,
            algorithm="lowrank",
            shapes=[(0, (8, 6))],
            key="k",
            rng=commopt.codecs.RngKey(0, 0, step),
        )
        torch.cuda.synchronize()
        assert torch.allclose(flat, m, atol=1e-3)
