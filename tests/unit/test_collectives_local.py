"""commopt.collectives in one process (the "local" world of one): geometry, every algorithm's
code path, argument checks. The multi-rank behaviour is in tests/distributed/test_collectives.py.
"""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import commopt
from commopt import collectives, driver
from commopt.codecs import RngKey, get_codec
from commopt.comm import topology


@pytest.fixture(scope="module")
def comm():
    return commopt.create_communicator("local")


@settings(max_examples=200, deadline=None)
@given(
    numel=st.integers(0, 5000), parts=st.integers(1, 9), alignment=st.sampled_from([1, 2, 7, 128])
)
def test_chunk_bounds_cover_the_buffer_at_aligned_starts(numel, parts, alignment):
    bounds = collectives.chunk_bounds(numel, parts, alignment)
    assert len(bounds) == parts
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    for (lo, hi), (lo2, _) in itertools.pairwise(bounds):
        assert hi == lo2 and lo <= hi
    for lo, _ in bounds:
        assert lo % alignment == 0 or lo == numel
    # every chunk but the first is no longer than the first (the wire slot size)
    first = bounds[0][1] - bounds[0][0]
    assert all(hi - lo <= first for lo, hi in bounds)


def test_auto_is_the_identity_for_a_world_of_one(comm):
    x = torch.randn(1000)
    y = x.clone()
    work = collectives.allreduce(comm, y, get_codec("qsgd4"))
    assert work.is_completed() and torch.equal(x, y)
    assert collectives.choose_algorithm(comm, get_codec("qsgd4")) == "identity"


@pytest.mark.parametrize("algorithm", ["native", "scatter_reduce", "hierarchical"])
@pytest.mark.parametrize("spec", [None, "fp32", "fp16", "bf16", "qsgd4", "qsgd8+ef"])
def test_every_algorithm_round_trips_through_its_codec(comm, algorithm, spec):
    codec = None if spec is None else get_codec(spec)
    if algorithm == "native" and codec is not None and not codec.linear:
        pytest.skip("native needs a linear codec")
    torch.manual_seed(0)
    x = torch.randn(1031)
    y = x.clone()
    collectives.allreduce(comm, y, codec, algorithm=algorithm, rng=RngKey(0, 0, 0), key="k")
    if spec in (None, "fp32") or algorithm == "hierarchical":  # hierarchical of one node: exact
        assert torch.equal(y, x)
    elif spec in ("fp16", "bf16"):
        dtype = torch.float16 if spec == "fp16" else torch.bfloat16
        assert torch.equal(y, x.to(dtype).float()), "one rounding to the wire dtype"
    else:
        inner = getattr(codec, "inner", codec)
        # scatter_reduce quantises twice: the chunk, then the "reduced" chunk
        block = x.abs().view(-1)[:1024].view(-1, inner.bucket_size).amax(1).max()
        assert (y - x).abs().max() <= 2.01 * max(block, x[1024:].abs().max()) / inner.levels


def test_average_false_and_scale(comm):
    y = torch.ones(5)
    collectives.allreduce(comm, y, None, average=False, scale=3.0)
    assert torch.equal(y, torch.full((5,), 3.0))
    y = torch.ones(5)
    collectives.allreduce(comm, y, get_codec("fp16"), algorithm="scatter_reduce", scale=0.5)
    assert torch.equal(y, torch.full((5,), 0.5))


def test_async_returns_a_work_and_then_runs_in_order(comm):
    y = torch.ones(3)
    work = collectives.allreduce(comm, y, None, async_op=True)
    work.wait()
    assert work.is_completed()
    seen = []
    driver.then(comm, lambda: seen.append(1)).wait()
    driver.drain(comm)
    assert seen == [1]


def test_empty_buffer_is_a_no_op(comm):
    y = torch.empty(0)
    assert collectives.allreduce(
        comm, y, get_codec("qsgd4"), algorithm="scatter_reduce"
    ).is_completed()


def test_hierarchy_is_built_once(comm):
    a = topology.hierarchy(comm)
    b = topology.hierarchy(comm)
    assert a[0] is b[0] and a[1] is b[1]
    assert a[0].size == 1 and a[1].size == 1


@pytest.mark.parametrize(
    "bad, error, words",
    [
        (dict(flat=torch.ones(2, 2)), ValueError, "1-D"),
        (dict(flat=torch.ones(4)[::2]), ValueError, "contiguous"),
        (dict(algorithm="ring"), ValueError, "unknown algorithm"),
        (dict(codec="qsgd4", algorithm="native"), ValueError, "scatter_reduce"),
        (dict(flat=torch.ones(4, dtype=torch.float64), codec="fp16"), TypeError, "codec=None"),
        (dict(codec=object()), TypeError, "Codec"),
    ],
)
def test_bad_arguments_get_clear_errors(comm, bad, error, words):
    args = dict(flat=torch.ones(4), codec=None, algorithm="auto")
    args.update(bad)
    if isinstance(args["codec"], str):
        args["codec"] = get_codec(args["codec"])
    with pytest.raises(error, match=words):
        collectives.allreduce(comm, args["flat"], args["codec"], algorithm=args["algorithm"])
