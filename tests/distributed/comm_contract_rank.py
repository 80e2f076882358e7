"""Rank body of the communicator contract suite: every communicator must pass all of it.

Run as: python comm_contract_rank.py BACKEND   (under mpirun, torch.distributed env, or alone)
Each check asserts exact results for rank-dependent inputs and names itself on failure.
"""

import os
import sys

import torch

from commopt.comm.launcher import detect_launcher

backend = sys.argv[1]
info = detect_launcher()
# Fake two ranks per node so the topology attributes are exercised (rank 0,1 -> node-a ...).
os.environ["COMMOPT_NODE_NAME"] = f"node-{info.rank // 2}"

import commopt  # noqa: E402
from commopt.comm import CollectiveMismatchError  # noqa: E402

comm = commopt.create_communicator(backend)
r, n = comm.rank, comm.size
assert n == info.size and r == info.rank, (r, n, info)

# -- topology ----------------------------------------------------------------------------
assert comm.intra_rank == r % 2 and comm.intra_size == min(2, n - 2 * (r // 2)), vars(comm)
assert comm.inter_rank == r // 2 and comm.inter_size == (n + 1) // 2, vars(comm)


def pattern(numel, dtype, rank):
    vals = (torch.arange(numel) % 7 + 1) * (rank + 1)  # small integers: exact in bf16 too
    return vals.to(dtype)


# -- allreduce: every dtype, odd sizes, 0 and 1, sync and async -----------------------------------
for dtype in (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
):
    for numel in (0, 1, 7, 1031):
        expected = sum(pattern(numel, torch.float64, q) for q in range(n)).to(dtype)
        for async_op in (False, True):
            buf = pattern(numel, dtype, r)
            work = comm.allreduce(buf, async_op=async_op)
            if async_op:
                work.wait()
                assert work.is_completed()
            assert torch.equal(buf, expected), (
                f"allreduce {dtype} numel={numel} async={async_op}: {buf[:5]} != {expected[:5]}"
            )

# several async ops in flight at once complete in order with the right results
bufs = [pattern(513, torch.float32, r) * (i + 1) for i in range(4)]
works = [comm.allreduce(b, async_op=True) for b in bufs]
for i, (b, w) in enumerate(zip(bufs, works)):
    w.wait()
    assert torch.equal(b, sum(pattern(513, torch.float32, q) for q in range(n)) * (i + 1)), (
        f"in-flight allreduce {i}"
    )

# -- alltoall / allgather: bytes and typed -----------------------------------------------------------
for dtype in (torch.uint8, torch.float32, torch.bfloat16, torch.float16, torch.int64):
    for per_peer in (0, 1, 5):
        send = torch.empty(n * per_peer, dtype=dtype)
        for peer in range(n):
            send[peer * per_peer : (peer + 1) * per_peer] = 10 * r + peer
        recv = torch.full((n * per_peer,), 255, dtype=dtype)
        for async_op in (False, True):
            w = comm.alltoall(send, recv, async_op=async_op)
            if w is not None:
                w.wait()
            for src in range(n):
                got = recv[src * per_peer : (src + 1) * per_peer]
                assert torch.all(got == 10 * src + r), (
                    f"alltoall {dtype} per_peer={per_peer} from {src}: {got}"
                )

        mine = torch.full((per_peer,), r + 1, dtype=dtype)
        gathered = torch.zeros(n * per_peer, dtype=dtype)
        w = comm.allgather(mine, gathered, async_op=True)
        w.wait()
        for src in range(n):
            got = gathered[src * per_peer : (src + 1) * per_peer]
            assert torch.all(got == src + 1), (
                f"allgather {dtype} per_peer={per_peer} from {src}: {got}"
            )

# -- broadcast from every root ------------------------------------------------------------------------
for root in range(n):
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        buf = torch.full((9,), r, dtype=dtype)
        comm.broadcast(buf, root=root)
        assert torch.all(buf == root), f"broadcast {dtype} from root {root}: {buf}"

# -- objects and barrier -------------------------------------------------------------------------------
assert comm.bcast_obj({"from": r, "x": [1, 2]} if r == 0 else None) == {"from": 0, "x": [1, 2]}, (
    "bcast_obj"
)
assert comm.allgather_obj(("rank", r)) == [("rank", q) for q in range(n)], "allgather_obj"
comm.barrier()

# -- split: even and odd ranks, reversed order by key ---------------------------------------------------
sub = comm.split(color=r % 2, key=-r)
members = [q for q in range(n) if q % 2 == r % 2]
assert sub.size == len(members), f"split size {sub.size} != {len(members)}"
assert sub.rank == sorted(members, reverse=True).index(r), f"split rank {sub.rank}"
t = torch.tensor([float(r)])
sub.allreduce(t)
assert t.item() == float(sum(members)), f"allreduce in split: {t.item()} != {sum(members)}"

# -- errors ---------------------------------------------------------------------------------------------
for bad, what in (
    (lambda: comm.allreduce(torch.ones(4, 4).t()), "non-contiguous"),
    (lambda: comm.alltoall(torch.ones(n * 2), torch.ones(n * 2 + 1)), "alltoall size"),
    (lambda: comm.allgather(torch.ones(2), torch.ones(2 * n + 1)), "allgather size"),
    (lambda: comm.broadcast(torch.ones(2), root=n), "broadcast root"),
):
    try:
        bad()
    except (ValueError, TypeError):
        pass
    else:
        raise AssertionError(f"{what}: no error raised")

# -- debug checks: a size mismatch raises on every rank instead of hanging -------------------------------
if n > 1:
    comm.debug = True
    try:
        comm.allreduce(torch.ones(3 + (r == n - 1)))
    except CollectiveMismatchError as exc:
        assert f"ranks [{n - 1}]" in str(exc), str(exc)
    else:
        raise AssertionError("COMMOPT_DEBUG: mismatched allreduce sizes did not raise")
    comm.debug = False
    comm.barrier()

print(f"contract ok {backend} rank {r}/{n}")
