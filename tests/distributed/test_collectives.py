"""commopt.collectives on real ranks: every algorithm against the exact mean.

One run per configuration checks every codec and algorithm (runs cost seconds to start):
fp32 bit-exact where the summation order is ours, fp16/bf16 wire with fp32 accumulation
bit-exact against an emulation, QSGD within its analytic bound, async overlap in order.
"""

import pytest

from tests.multirank import FAKE_NODES, run_mpi, run_torch

pytestmark = pytest.mark.distributed

RANK_SCRIPT = (
    FAKE_NODES
    + r'''
import commopt
from commopt import collectives, driver
from commopt.codecs import get_codec, RngKey

comm = commopt.create_communicator(backend)
r, n = comm.rank, comm.size
nodes = [list(range(k, min(k + per_node, n))) for k in range(0, n, per_node)]


def inputs(numel, seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(numel, generator=g) * (q + 1) for q in range(n)]
    # one bucket with much larger values: bounds are per quantisation bucket
    if numel > 300:
        for x in xs:
            x[128:256] *= 100
    return xs


def reduce(xs, codec, algorithm, **kw):
    y = xs[r].clone()
    collectives.allreduce(comm, y, codec, algorithm=algorithm, **kw).wait()
    return y


def same_everywhere(y, what):
    everyone = comm.allgather_obj(y)
    for q, other in enumerate(everyone):
        assert torch.equal(other, y), f"{what}: rank {q} differs from rank {r}"


def emulate_cast(xs, dtype, algorithm, codec=None, piece_bytes=None):
    """Bit-exact result of the cast codecs: fp16/bf16 wire, fp32 accumulation in rank order.

    In scatter_reduce each chunk's owner starts from its own term, exact (it never
    travels), and adds the peers' in rank order.
    """
    numel = xs[0].numel()
    scaled = [x * (1.0 / n) for x in xs]
    wire = [s.to(dtype).float() for s in scaled]
    align = codec.alignment if codec is not None else 1
    out = torch.empty(numel)
    for piece in collectives.scatter_reduce_layout(
            numel, n, align, (piece_bytes or collectives.PIECE_BYTES) // 4):
        for owner, (lo, hi) in enumerate(piece):
            # the owner's own term (exact) first, then the peers' wire values in rank order
            terms = [scaled[owner][lo:hi]] + [wire[q][lo:hi] for q in range(n) if q != owner]
            acc = terms[0].clone()
            for t in terms[1:]:
                acc += t
            out[lo:hi] = acc
    return out.to(dtype).float() if dtype != torch.float32 else out


def qsgd_bound(xs, levels, bucket, algorithm):
    """Analytic bound of two quantisations: the peers' chunks, then the reduced chunk."""
    if algorithm == "hierarchical":
        contrib = [sum(xs[q] for q in node) for node in nodes]  # fp32 sums inside a node
    else:
        contrib = xs
    def blockmax(v):
        m = v.abs().view(-1, bucket).amax(1)
        return m.repeat_interleave(bucket)
    numel = xs[0].numel()
    pad = -numel % bucket
    padded = [torch.cat([c, torch.zeros(pad)]) for c in contrib]
    mean = sum(padded) / n
    first = sum(blockmax(c / n) for c in padded) / levels
    second = (blockmax(mean) + first.view(-1, bucket).amax(1).repeat_interleave(bucket)) / levels
    return ((first + second) * (1 + 1e-5) + 1e-6)[:numel], mean[:numel]


algorithms = ["native", "scatter_reduce", "auto"] + (["hierarchical"] if per_node > 1 else [])
checked = 0
for numel in (1, 5, 1000, 4099):
    xs = inputs(numel, seed=numel)
    exact = (sum(x.double() for x in xs) / n).float()
    # -- fp32: exact summation; bit-exact where commopt orders the sum -------------------
    for algorithm in algorithms:
        for codec in (None, get_codec("fp32")):
            y = reduce(xs, codec, algorithm)
            same_everywhere(y, f"fp32 {algorithm}")
            tol = 1e-6 * sum(x.abs() for x in xs) / n + 1e-30
            assert ((y - exact).abs() <= tol).all(), f"fp32 {algorithm} numel={numel}"
            if algorithm == "scatter_reduce":
                assert torch.equal(y, emulate_cast(xs, torch.float32, algorithm)), "fp32 scatter order"
            checked += 1
    # -- fp16 / bf16 wire, fp32 accumulation ----------------------------------------------------
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        codec = get_codec(name)
        for algorithm in algorithms:
            if algorithm == "native" and not comm.supports_sum(dtype):
                continue
            y = reduce(xs, codec, algorithm)
            same_everywhere(y, f"{name} {algorithm}")
            chosen = collectives.choose_algorithm(comm, codec) if algorithm == "auto" else algorithm
            if chosen == "scatter_reduce":
                assert torch.equal(y, emulate_cast(xs, dtype, algorithm, codec)), f"{name} scatter bit-exact"
            eps = 2.0 ** -11 if dtype == torch.float16 else 2.0 ** -8
            tol = (n + 1) * eps * (sum(x.abs() for x in xs) / n + exact.abs()) + 1e-6
            assert ((y - exact).abs() <= tol).all(), f"{name} {algorithm} numel={numel}: {(y-exact).abs().max()}"
            checked += 1
    # -- QSGD (non-linear): within the analytic bound, identical on every rank -------------------
    for spec in ("qsgd4", "qsgd8", "qsgd4+ef"):
        codec = get_codec(spec)
        inner = getattr(codec, "inner", codec)
        for algorithm in [a for a in algorithms if a != "native"]:
            y = reduce(xs, codec, algorithm, rng=RngKey(7, r, 0, 3), key=f"k{numel}{algorithm}")
            same_everywhere(y, f"{spec} {algorithm}")
            bound, mean = qsgd_bound(xs, inner.levels, inner.bucket_size, algorithm)
            err = (y - exact).abs()
            assert (err <= bound).all(), f"{spec} {algorithm} numel={numel}: worst {(err - bound).max()}"
            checked += 1

# -- stochastic rounding is keyed: same key, same result; other step, other draw ---------------------
xs = inputs(1000, seed=1)
codec = get_codec("qsgd4")
a = reduce(xs, codec, "scatter_reduce", rng=RngKey(1, r, 5, 0))
b = reduce(xs, codec, "scatter_reduce", rng=RngKey(1, r, 5, 0))
c = reduce(xs, codec, "scatter_reduce", rng=RngKey(1, r, 6, 0))
assert torch.equal(a, b) and not torch.equal(a, c), "RNG keys"

# -- error feedback: the errors of many steps cancel instead of adding up -----------------------------
codec = get_codec("qsgd4+ef")
plain = get_codec("qsgd4")
cum_ef = torch.zeros(1000); cum_plain = torch.zeros(1000); cum_exact = torch.zeros(1000, dtype=torch.float64)
for t in range(20):
    xs = inputs(1000, seed=100 + t)
    cum_exact += sum(x.double() for x in xs) / n
    cum_ef += reduce(xs, codec, "scatter_reduce", rng=RngKey(2, r, t, 0), key="ef")
    cum_plain += reduce(xs, plain, "scatter_reduce", rng=RngKey(2, r, t, 0))
err_ef = (cum_ef.double() - cum_exact).abs().mean()
err_plain = (cum_plain.double() - cum_exact).abs().mean()
assert err_ef < 0.5 * err_plain, f"error feedback does not cancel errors: {err_ef} vs {err_plain}"
peer = (r + 1) % n
assert codec.residual(f"ef/rs{peer}") is not None and codec.residual("ef/ag0") is not None
assert codec.residual(f"ef/rs{r}") is None, "the own chunk never travels, so it has no residual"

# -- the pipeline: many pieces give the same bits as the emulation, and stay in the bound ------------
xs = inputs(4099, seed=11)
for piece_bytes in (1536, 4096 * 4):
    codec = get_codec("fp16")
    y = reduce(xs, codec, "scatter_reduce", piece_bytes=piece_bytes)
    same_everywhere(y, f"fp16 pieces of {piece_bytes} B")
    assert torch.equal(y, emulate_cast(xs, torch.float16, "scatter_reduce", codec, piece_bytes)), \
        f"fp16 scatter in pieces of {piece_bytes} B: not the rank-order sum"
    codec = get_codec("qsgd4")
    y = reduce(xs, codec, "scatter_reduce", rng=RngKey(3, r, 0, 1), piece_bytes=piece_bytes)
    same_everywhere(y, f"qsgd4 pieces of {piece_bytes} B")
    bound, _ = qsgd_bound(xs, codec.levels, codec.bucket_size, "scatter_reduce")
    exact = (sum(x.double() for x in xs) / n).float()
    assert ((y - exact).abs() <= bound).all(), f"qsgd4 in pieces of {piece_bytes} B outside the bound"
    checked += 2

# -- the native plan of a cast codec in pieces: as one whole cast (the same bits with 2 ranks,
# where a sum has one order; with more, the transport may order a piece's sums otherwise) --------------
exact = (sum(x.double() for x in xs) / n).float()
for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
    if not comm.supports_sum(dtype):
        continue
    codec = get_codec(name)
    whole = reduce(xs, codec, "native", piece_bytes=0)
    eps = 2.0 ** -11 if dtype == torch.float16 else 2.0 ** -8
    tol = (n + 1) * eps * (sum(x.abs() for x in xs) / n + exact.abs()) + 1e-6
    for piece_bytes in (1536, 4096 * 4):
        y = reduce(xs, codec, "native", piece_bytes=piece_bytes)
        same_everywhere(y, f"{name} native pieces of {piece_bytes} B")
        if n == 2:
            assert torch.equal(y, whole), f"{name} native in pieces of {piece_bytes} B differs from whole"
        assert ((y - exact).abs() <= tol).all(), f"{name} native in pieces of {piece_bytes} B: off"
        checked += 1

# -- asynchronous: many buffers in flight, mixed codecs and algorithms, complete in order --------------
xs = inputs(4099, seed=9)
exact = (sum(x.double() for x in xs) / n).float()
scale_of = sum(x.abs() for x in xs) / n  # errors scale with the summands, not the sum
bufs, works = [], []
for i, (spec, alg) in enumerate([("fp32", "auto"), ("qsgd4", "auto"), ("fp16", "scatter_reduce"),
                                 ("fp32", "scatter_reduce"), ("qsgd4+ef", "auto")] * 3):
    y = xs[r].clone() * (i + 1)
    works.append(collectives.allreduce(comm, y, get_codec(spec), algorithm=alg, async_op=True,
                                       rng=RngKey(3, r, i, 0), key=f"async{i}",
                                       piece_bytes=2048 if i % 2 else None))
    bufs.append((spec, y, i))
for w in works:
    w.wait()
    assert w.is_completed()
# (the communicator's own collectives only once nothing is in flight)
for spec, y, i in bufs:
    tol = (i + 1) * (0.3 * scale_of.max() if spec.startswith("qsgd") else 1e-2 * scale_of + 1e-6)
    assert ((y - exact * (i + 1)).abs() <= tol).all(), f"async {i} {spec}"
    same_everywhere(y, f"async {i}")
driver.drain(comm)

# -- average=False sums; scale multiplies ---------------------------------------------------------------
y = torch.full((10,), float(r + 1))
collectives.allreduce(comm, y, None, average=False)
assert torch.equal(y, torch.full((10,), float(sum(range(1, n + 1))))), "sum"
y = torch.full((10,), 2.0)
collectives.allreduce(comm, y, get_codec("fp16"), algorithm="scatter_reduce", scale=0.5)
assert torch.equal(y, torch.ones(10)), "scale"

print(f"collectives ok {backend} rank {r}/{n} checks={checked}")
'''
)


def _expect(out, backend, n):
    assert len(out) == n
    for r, o in enumerate(out):
        assert o.strip().startswith(f"collectives ok {backend} rank {r}/{n}"), o


@pytest.mark.parametrize("nprocs", [2, 4])
def test_mpi_collectives(nprocs):
    # 4 ranks as 2 fake nodes x 2 ranks: the hierarchical path runs too.
    per_node = 2 if nprocs == 4 else 1
    out = run_mpi(
        RANK_SCRIPT,
        nprocs,
        args=["mpi", str(per_node)],
        timeout=240,
        mpirun_args=["--mca", "mpi_yield_when_idle", "1"],
    )  # more ranks than cores
    _expect(out, "mpi", nprocs)


def test_torch_gloo_collectives_2x2_nodes():
    """gloo sums fp16 natively (the native fp16 path); 2x2 fake nodes: hierarchical."""
    out = run_torch(RANK_SCRIPT, 4, args=["torch", "2"], timeout=240)
    _expect(out, "torch", 4)
