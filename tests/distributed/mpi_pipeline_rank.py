"""Rank body for the pipelined MPI transfers (tests/distributed/test_mpi_pipeline.py).

Run under mpirun: python mpi_pipeline_rank.py. Forces the pipelined path with tiny segments
(many segments, ragged last ones) and checks it against exact sums, MPI's own collectives
and the other ranks, for every reducible dtype and sizes around the world size.
"""

import torch

from commopt.comm.mpi import MPICommunicator

SEGMENT = 24  # bytes: 3 to 12 elements per segment, so every size below cuts unevenly
comm = MPICommunicator(pipeline="on", segment_bytes=SEGMENT, pipeline_min_bytes=1)
native = MPICommunicator(pipeline="off")
r, n = comm.rank, comm.size
assert comm._path(4) == "pipelined" and native._path(1 << 30) == "blocking"
# Small buffers between "nodes" (each rank its own here) take MPI's nonblocking collectives,
# polled: the same results.
polled = MPICommunicator(pipeline="on", pipeline_min_bytes=1 << 30)
assert polled._path(1 << 20) == "polled"

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)
SIZES = (1, 2, n - 1, n + 1, 7, 31, 97, 1031, 4099)


def same_everywhere(t: torch.Tensor) -> bool:
    mine = t.view(
        torch.uint8
        if t.element_size() == 1
        else {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    )
    return all(torch.equal(x, mine) for x in comm.allgather_obj(mine))


for dtype in DTYPES:
    for numel in (s for s in SIZES if s > 0):
        # Small integers: every dtype (bf16 too) sums them exactly, so the result is known.
        vals = torch.arange(numel) % 7 + 1
        buf = (vals * (r + 1)).to(dtype)
        expected = sum(vals.double() * (q + 1) for q in range(n)).to(dtype)
        comm.allreduce(buf)
        assert torch.equal(buf, expected), f"ring allreduce {dtype} numel={numel}: {buf[:6]}"
        if dtype.is_floating_point:
            # Random values: rounding depends on the order of additions; every rank must still
            # hold the same bits, within rounding of the exact sum.
            g = torch.Generator().manual_seed(1000 * r + numel)
            x = torch.randn(numel, generator=g, dtype=torch.float64)
            exact = sum(
                torch.randn(
                    numel,
                    generator=torch.Generator().manual_seed(1000 * q + numel),
                    dtype=torch.float64,
                )
                for q in range(n)
            )
            y = x.to(dtype)
            comm.allreduce(y)
            assert same_everywhere(y), f"ring allreduce {dtype} numel={numel}: ranks differ"
            tol = {torch.float16: 1e-2, torch.bfloat16: 6e-2}.get(dtype, 1e-5) * n
            assert torch.allclose(y.double(), exact, atol=tol, rtol=tol), f"{dtype} {numel}"
            if n == 2 or dtype == torch.float64:
                # Two ranks add one pair (addition commutes): MPI's own sum is the same bits.
                z = x.to(dtype)
                native.allreduce(z)
                if n == 2:
                    assert torch.equal(y, z), f"ring vs MPI_Allreduce {dtype} numel={numel}"
                w = x.to(dtype)
                polled.allreduce(w)
                assert torch.equal(w, z), f"MPI_Iallreduce vs MPI_Allreduce {dtype} numel={numel}"

# async: several in flight complete in order, interleaved with native ones
bufs = [torch.full((1001,), float(r + i)) for i in range(3)]
works = [comm.allreduce(b, async_op=True) for b in bufs]
for i, (b, w) in enumerate(zip(bufs, works)):
    w.wait()
    assert torch.all(b == sum(q + i for q in range(n))), f"async ring allreduce {i}"

# alltoall and allgather: typed and raw bytes, chunks that do not divide into segments
for dtype in (torch.uint8, torch.float32, torch.bfloat16, torch.int64):
    for per_peer in (1, 5, 333):
        send = torch.empty(n * per_peer, dtype=dtype)
        for peer in range(n):
            send[peer * per_peer : (peer + 1) * per_peer] = (10 * r + peer) % 100
        for c in (comm, polled):
            recv = torch.zeros_like(send)
            c.alltoall(send, recv)
            for src in range(n):
                got = recv[src * per_peer : (src + 1) * per_peer]
                assert torch.all(got == (10 * src + r) % 100), (
                    f"alltoall {dtype} {per_peer} from {src}"
                )
            mine = torch.arange(per_peer).to(dtype) + r
            gathered = torch.zeros(n * per_peer, dtype=dtype)
            c.allgather(mine, gathered)
            for src in range(n):
                assert torch.equal(
                    gathered[src * per_peer : (src + 1) * per_peer],
                    torch.arange(per_peer).to(dtype) + src,
                ), f"allgather {dtype} {src}"

# sub-communicators keep the settings
sub = comm.split(color=r % 2)
assert (sub.pipeline, sub.segment_bytes, sub.pipeline_min_bytes) == ("on", SEGMENT, 1)
t = torch.arange(50, dtype=torch.float32) * (r + 1)
sub.allreduce(t)
members = [q for q in range(n) if q % 2 == r % 2]
assert torch.equal(t, torch.arange(50, dtype=torch.float32) * sum(q + 1 for q in members))

print(f"pipeline ok rank {r}/{n}")
