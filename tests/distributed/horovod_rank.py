"""Rank body of the Horovod tests: the communicator's collectives with codecs, and the
compression adapters inside hvd.DistributedOptimizer. Prints "horovod ok rank R/N".

Run under mpirun or horovodrun (any number of ranks >= 2).
"""

import sys

import horovod.torch as hvd
import torch

import commopt
from commopt import collectives
from commopt.codecs import QSGD, RngKey, get_codec
from commopt.integrations.horovod import CodecCompressor, Compression

comm = commopt.create_communicator("horovod")
r, n = comm.rank, comm.size
assert (r, n) == (hvd.rank(), hvd.size()), (r, n, hvd.rank(), hvd.size())
assert n >= 2, "run with at least 2 ranks"


# -- 1. the fp16 adapter in DistributedOptimizer: divide before the cast ---------------------------
def reduced_gradient(compression, op):
    """SGD with lr=1 from w=0 leaves -w equal to the reduced gradient of sum(w * x) = x."""
    model = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        named_parameters=model.named_parameters(),
        compression=compression,
        op=op,
    )
    x = torch.tensor([[60000.0, -3.0, 0.5, 1.0 + r]])
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    return -model.weight.detach()[0]


mean = torch.tensor([60000.0, -3.0, 0.5, 1.0 + (n - 1) / 2])
got = reduced_gradient(Compression.fp16, hvd.Average)
assert torch.allclose(got, mean, rtol=1e-3), f"fp16 adapter, Average: {got} != {mean}"
got = reduced_gradient(CodecCompressor("fp16"), hvd.Sum)
assert torch.allclose(got, mean * n, rtol=1e-3), f"fp16 adapter, Sum: {got} != {mean * n}"
# Horovod's own fp16 compression casts first: the 16-bit sum of n x 60000 overflows.
got = reduced_gradient(hvd.Compression.fp16, hvd.Average)
assert torch.isinf(got[0]) and torch.isfinite(got[1:]).all(), f"hvd fp16 did not overflow: {got}"

# bf16: Horovod 0.28 has no bfloat16 sum; the adapter says so instead of failing inside Horovod.
try:
    Compression.bf16.compress(torch.ones(2))
except ValueError as exc:
    assert "bfloat16" in str(exc) and "fp16" in str(exc), str(exc)
else:
    assert hvd.mpi_ops.mpi_lib is not None  # a Horovod with bf16 sums: nothing to report

# -- 2. commopt's collectives over the Horovod communicator ------------------------------------------
g = torch.Generator().manual_seed(1234 + r)
x = torch.randn(3001, generator=g) * (1 + r)
exact = x.double().clone()
comm.allreduce(exact)
exact = (exact / n).float()
scale = float(max(comm.allgather_obj(float(x.abs().max()))))

for name, algorithm, tol in (
    ("fp16", "auto", 2e-3 * scale),
    ("bf16", "auto", 1.6e-2 * scale),
    ("fp16", "scatter_reduce", 2e-3 * scale),
):
    out = x.clone()
    collectives.allreduce(comm, out, get_codec(name), algorithm=algorithm)
    err = float((out - exact).abs().max())
    assert err <= tol, f"{name}/{algorithm}: max error {err} > {tol}"

# QSGD (not linear): scatter-reduce over Horovod's alltoall and allgather.
out = x.clone()
work = collectives.allreduce(
    comm, out, QSGD(bits=4, bucket_size=128), async_op=True, rng=RngKey(seed=7, rank=r, reduction=0)
)
work.wait()
rows = torch.empty(n * out.numel())
comm.allgather(out, rows)
assert all(torch.equal(row, out) for row in rows.view(n, -1)), "QSGD results differ between ranks"
# Two quantisations (per-rank chunks scaled by 1/n, then the reduced chunk), each off by at
# most one step = bucket max / 7: at most M/7 + (M + M/7)/7 < 0.31 M for M = max |x|.
err = float((out - exact).abs().max())
assert err <= 0.31 * scale, f"qsgd4 max error {err} > {0.31 * scale}"
assert err > 0, "qsgd4 returned the exact mean: was it really quantised?"

comm.barrier()
# One write for the whole line: the ranks run unbuffered, where print() writes the text and
# its newline separately, and mpirun tags each piece it reads (a piece without its newline
# gets the next piece, maybe another rank's, glued on).
sys.stdout.write(f"horovod ok rank {r}/{n}\n")
sys.stdout.flush()
