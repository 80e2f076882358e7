"""The simulator's cost model: textbook formulas, their composition on machines, overlap bounds."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commopt.sim import Configuration, allreduce_time, get_machine, load_profile, simulate
from commopt.sim.codec_costs import get_codec_cost
from commopt.sim.comm_model import hierarchical_time, ring_time, sra_time, tree_time
from commopt.sim.costs import (
    GBIT,
    Link,
    hierarchical_allreduce_time,
    ring_allreduce_time,
    ring_reduce_scatter_time,
    scatter_reduce_allgather_time,
    tree_allreduce_time,
)
from commopt.sim.machines import Machine

US = 1e-6
INTRA, INTER = Link(5 * US, 20e9), Link(30 * US, 2.5e9)


def uniform_machine(gpus_per_node=8, intra=INTRA, inter=INTER) -> Machine:
    return Machine(
        name="uniform",
        description="test",
        gpu="v100",
        gpus_per_node=gpus_per_node,
        intra=intra,
        inter=inter,
        inter_gbps=20.0,
        inter_efficiency=1.0,
        memory_GBps=900.0,
    )


@pytest.mark.parametrize("n", [2, 3, 8, 64, 4096])
@pytest.mark.parametrize("nbytes", [4.0, 1e6, 64 * 2**20])
def test_ring_allreduce_is_the_textbook_formula(n, nbytes):
    alpha, beta = 7 * US, 3e9
    expected = 2 * (n - 1) * (alpha + nbytes / (n * beta))
    assert ring_allreduce_time(n, nbytes, Link(alpha, beta)) == pytest.approx(expected, rel=1e-12)


def test_one_worker_communicates_nothing():
    link = Link(1e-3, 1e6)
    assert ring_allreduce_time(1, 1e9, link) == 0.0
    assert tree_allreduce_time(1, 1e9, link) == 0.0
    assert (
        allreduce_time(
            get_machine("v100-nvlink-25g"), 1, numel=1e8, grad_bytes=4, algorithm="ring"
        ).total_s
        == 0.0
    )


def test_bad_sizes_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="positive integer"):
        ring_allreduce_time(0, 1.0, Link(0, 1))
    with pytest.raises(ValueError, match=">= 0 bytes"):
        ring_allreduce_time(2, -1.0, Link(0, 1))
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        Link(0.0, 0.0)


def test_machine_ring_inside_a_node_is_the_textbook_ring():
    m = uniform_machine()
    for n in (2, 4, 8):
        assert ring_time(m, 1, n, 1e8) == pytest.approx(ring_allreduce_time(n, 1e8, m.intra))


def test_machine_ring_across_nodes_is_limited_by_the_nic():
    m = uniform_machine()
    # 4 nodes x 8 GPUs: each step's chunk S/32 crosses a NIC, the slowest hop.
    expected = 2 * 31 * (m.inter.latency_s + 1e8 / 32 / m.inter.bandwidth_Bps)
    assert ring_time(m, 4, 8, 1e8) == pytest.approx(expected)


def test_hierarchical_is_reduce_scatter_plus_inter_ring_plus_allgather():
    m = uniform_machine()
    g, nodes, S = 8, 16, 2e8
    rs = ring_reduce_scatter_time(g, S, m.intra)
    inter = 2 * (nodes - 1) * (m.inter.latency_s + S / (nodes * m.inter.bandwidth_Bps))
    expected = rs + inter + rs
    assert hierarchical_allreduce_time(g, nodes, S, m.intra, m.inter) == pytest.approx(expected)
    assert hierarchical_time(m, nodes, g, S, S, linear=True) == pytest.approx(expected)
    # One node: the hierarchy collapses to the intra-node ring.
    assert hierarchical_time(m, 1, g, S, S, linear=True) == pytest.approx(
        ring_allreduce_time(g, S, m.intra)
    )


def test_hierarchical_beats_flat_ring_when_the_nic_is_slow_and_latency_counts():
    m = uniform_machine()
    S = 1e6  # latency-bound: the flat ring pays 2(n-1) inter-node latencies
    assert hierarchical_time(m, 64, 8, S, S, linear=True) < ring_time(m, 64, 8, S)


def test_tree_latency_grows_with_log_of_nodes():
    m = uniform_machine(gpus_per_node=1)
    small = 1e3
    t256, t512 = tree_time(m, 256, 1, small), tree_time(m, 512, 1, small)
    assert t512 - t256 == pytest.approx(2 * m.inter.latency_s, rel=1e-3)
    assert tree_time(m, 1024, 1, small) < ring_time(m, 1024, 1, small) / 50


@pytest.mark.parametrize("algorithm", ["ring", "tree", "hierarchical"])
@pytest.mark.parametrize("gpus", [16, 64, 1024])
def test_no_algorithm_beats_the_nic_bandwidth_floor(algorithm, gpus):
    m = get_machine("v100-nvlink-25g")
    nodes = gpus // m.gpus_per_node
    S = 4e8
    floor = 2 * (nodes - 1) / nodes * S / m.inter.bandwidth_Bps  # what each NIC must move
    t = allreduce_time(m, gpus, numel=S / 4, grad_bytes=4, algorithm=algorithm).total_s
    assert t >= floor * (1 - 1e-9)


def test_no_p2p_staging_shares_the_switch_uplink():
    m = get_machine("rtx3090-pcie")
    S = 4e8
    # 4 GPUs behind one switch: every ring step moves 4 chunks of S/4 through the uplink.
    expected = 2 * 3 * (m.uplink.latency_s + 4 * (S / 4) / m.uplink.bandwidth_Bps)
    assert ring_time(m, 1, 4, S) == pytest.approx(expected)
    with_p2p = replace(m, p2p=True)
    assert ring_time(with_p2p, 1, 4, S) < expected / 2


def test_scatter_reduce_allgather_moves_the_ring_bytes():
    m = uniform_machine()
    S = 1e8
    lat_free = replace(m, intra=Link(0, m.intra.bandwidth_Bps), message_overhead_s=0.0)
    assert sra_time(lat_free, 1, 8, S) == pytest.approx(ring_time(lat_free, 1, 8, S))


def test_alltoall_latencies_overlap_send_overheads_add_up():
    link = Link(30 * US, 1e9)
    t = scatter_reduce_allgather_time(128, 0.0, link, 2 * US)
    assert t == pytest.approx(2 * (30 * US + 127 * 2 * US))
    m = uniform_machine(gpus_per_node=1)
    assert sra_time(m, 128, 1, 0.0) == pytest.approx(
        2 * (m.inter.latency_s + 127 * m.message_overhead_s)
    )


def test_codecs_shrink_the_wire_and_nonlinear_ones_need_sra():
    m = get_machine("v100-nvlink-25g")
    plain = allreduce_time(m, 64, numel=1e8, grad_bytes=4, algorithm="hierarchical")
    half = allreduce_time(m, 64, numel=1e8, grad_bytes=4, algorithm="hierarchical", codec="fp16")
    four = allreduce_time(m, 64, numel=1e8, grad_bytes=4, algorithm="hierarchical", codec="qsgd4")
    assert half.wire_bytes == plain.wire_bytes / 2
    assert four.wire_bytes == pytest.approx(plain.wire_bytes * 0.1328125)
    assert four.transfer_s < half.transfer_s < plain.transfer_s
    assert four.codec_s > 0 and plain.codec_s == 0
    with pytest.raises(ValueError, match="not linear"):
        allreduce_time(m, 64, numel=1e8, grad_bytes=4, algorithm="ring", codec="qsgd4")
    with pytest.raises(ValueError, match="not linear"):
        Configuration(algorithm="tree", compression="qsgd8")


def test_fp16_cast_of_fp16_gradients_costs_nothing():
    fp16 = get_codec_cost("fp16")
    assert fp16.is_identity(grad_bytes=2) and not fp16.is_identity(grad_bytes=4)
    assert fp16.encode_s(1e9, 900, grad_bytes=2) == 0.0


def test_qsgd_sizes_match_commopts_codec():
    codecs = pytest.importorskip("commopt.codecs")
    for bits, bucket in [(2, 128), (4, 128), (8, 128), (4, 1024)]:
        ours = get_codec_cost(f"qsgd{bits}b{bucket}").wire_bytes(1 << 20, grad_bytes=4)
        theirs = codecs.QSGD(bits=bits, bucket_size=bucket).encoded_nbytes(1 << 20)
        assert ours == pytest.approx(theirs, abs=4)  # theirs pads to 4 bytes


# --- overlap --------------------------------------------------------------------------------

_machines = st.sampled_from(["v100-nvlink-25g", "rtx3090-pcie", "p100-10gbe", "p3dn-efa"])
_models = st.sampled_from(["resnet50", "bert-large", "transformer-xl-base"])


@settings(max_examples=60, deadline=None)
@given(
    machine=_machines,
    model=_models,
    gpus=st.sampled_from([2, 8, 16, 128, 1024]),
    codec=st.sampled_from(["none", "fp16", "qsgd4"]),
    bucket=st.sampled_from([1.0, 25.0, 400.0]),
    gbps=st.sampled_from([None, 1.0, 400.0]),
)
def test_overlap_is_never_faster_than_the_larger_of_compute_and_communication(
    machine, model, gpus, codec, bucket, gbps
):
    m = get_machine(machine).with_overrides(inter_gbps=gbps)
    profile = load_profile(model)
    if m.gpu not in profile.throughput:
        profile = profile.with_overrides(gpu=m.gpu, step_time=0.2)
    steps = {}
    for overlap, db in ((False, False), (True, False), (True, True)):
        plan = Configuration("auto", codec, bucket, overlap, db)
        p = simulate(profile, m, plan, gpus)
        assert p.step_s >= max(p.compute_s, p.comm_s) * (1 - 1e-12)
        assert 0 < p.efficiency <= 1 + 1e-12
        steps[plan.schedule] = p
    assert steps["none"].step_s == pytest.approx(steps["none"].compute_s + steps["none"].comm_s)
    assert steps["double-buffering"].step_s == pytest.approx(
        max(steps["double-buffering"].compute_s, steps["double-buffering"].comm_s)
    )
    assert steps["backward"].step_s <= steps["none"].step_s * (1 + 1e-12)


def test_backward_overlap_hides_early_buckets_but_not_the_last():
    profile = load_profile("resnet50")
    m = get_machine("v100-nvlink-25g")
    p = simulate(profile, m, Configuration("ring", "none", 25.0, True), 8)
    none = simulate(profile, m, Configuration("ring", "none", 25.0, False), 8)
    assert 0 < p.exposed_comm_s < none.exposed_comm_s
    assert p.buckets >= 4


def test_one_gpu_runs_at_the_profile_speed():
    p = simulate("resnet50", "v100-nvlink-25g", Configuration(), 1)
    assert p.throughput == pytest.approx(1226.0)
    assert p.efficiency == 1.0 and p.comm_s == 0.0


def test_auto_takes_the_fastest_algorithm_per_bucket():
    m = get_machine("v100-nvlink-25g")
    auto = simulate("bert-large", m, Configuration("auto"), 1024)
    for algorithm in ("ring", "tree", "hierarchical"):
        fixed = simulate("bert-large", m, Configuration(algorithm), 1024)
        assert auto.comm_s <= fixed.comm_s * (1 + 1e-12)
    assert math.isfinite(auto.step_s)


def test_layouts_must_fill_whole_nodes():
    m = get_machine("v100-nvlink-25g")
    assert m.layout(4) == (1, 4) and m.layout(64) == (8, 8)
    with pytest.raises(ValueError, match="multiple of 8"):
        m.layout(12)
    assert get_machine("testbed-1gbit").layout(2) == (2, 1)


def test_link_overrides_keep_the_preset_efficiency():
    m = get_machine("v100-nvlink-25g")
    fast = m.with_overrides(inter_gbps=400)
    assert fast.inter.bandwidth_Bps == pytest.approx(400 * GBIT * m.inter_efficiency)
    assert (
        simulate("bert-large", fast, Configuration(), 256).efficiency
        > simulate("bert-large", m, Configuration(), 256).efficiency
    )
    with pytest.raises(ValueError, match="inter-gbps"):
        m.with_overrides(inter_gbps=0)


# --- the pipelined scatter-reduce/allgather ---------------------------------------------------

from commopt.sim.comm_model import SRA_PIECE_BYTES, hierarchical_pipelined, sra_codec_s  # noqa: E402
from commopt.sim.costs import pipeline_time  # noqa: E402

_seconds = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(wire=_seconds, codec=_seconds, pieces=st.integers(1, 4096), fixed=st.floats(0.0, 1e-3))
def test_pipeline_is_never_faster_than_the_wire_or_the_codec_and_never_slower_than_their_sum(
    wire, codec, pieces, fixed
):
    t = pipeline_time(wire, codec, pieces, fixed)
    assert t >= wire * (1 - 1e-12) and t >= codec * (1 - 1e-12)
    assert t >= max(wire, codec) + pieces * fixed - 1e-12  # every collective's latency is paid
    assert t <= wire + codec + pieces * fixed + 1e-12  # never worse than no overlap


def test_one_piece_is_the_unpipelined_sum_and_many_approach_the_larger_of_the_two():
    assert pipeline_time(0.075, 0.019, 1, 1e-4) == pytest.approx(0.075 + 0.019 + 1e-4)
    excess = [pipeline_time(0.075, 0.019, p) - 0.075 for p in (1, 4, 16, 256, 65536)]
    assert excess == sorted(excess, reverse=True)  # shrinks as pieces grow in number
    assert excess[-1] < 1e-6
    # Codec-bound: the same, with the roles swapped.
    assert pipeline_time(0.01, 0.05, 1000) == pytest.approx(0.05 + 0.01 / 1000)
    with pytest.raises(ValueError, match="positive integer"):
        pipeline_time(1.0, 1.0, 0)
    with pytest.raises(ValueError, match=">= 0"):
        pipeline_time(-1.0, 1.0, 2)


def test_the_simulated_piece_size_is_commopts():
    collectives = pytest.importorskip("commopt.collectives")
    assert SRA_PIECE_BYTES == collectives.PIECE_BYTES
    assert Configuration(compression="qsgd4").piece_mb * 2**20 == collectives.PIECE_BYTES


def test_scatter_reduce_codec_work_is_what_commopt_does():
    # encode: the n-1 peers' chunks and the own reduced chunk = S; decode: the n-1 received
    # chunks and all n gathered chunks = (2n-1)/n S.
    m = get_machine("testbed-1gbit")
    qsgd4 = replace(get_codec_cost("qsgd4"), encode_elems_per_s=1e9, decode_elems_per_s=2e9)
    for n in (2, 4, 64):
        expected = 1e8 / 1e9 + (2 * n - 1) / n * 1e8 / 2e9
        assert sra_codec_s(qsgd4, m, 1e8, n, grad_bytes=4) == pytest.approx(expected)


def test_testbed_codec_speeds_come_from_the_codec_benchmark():
    m = get_machine("testbed-1gbit")
    assert m.codec_speed("qsgd4") == (6.74, 11.3) and m.codec_speed("fp16") is None
    assert "codec_perf.py" in m.sources["codec_GBps"]
    t = allreduce_time(
        m, 2, numel=16 * 2**20, grad_bytes=4, algorithm="scatter_reduce", codec="qsgd4"
    )
    assert t.codec_s == pytest.approx(64 * 2**20 / 6.74e9 + 1.5 * 64 * 2**20 / 11.3e9)
    # A codec with its own measured speeds keeps them.
    own = replace(get_codec_cost("qsgd4"), encode_elems_per_s=1e8, decode_elems_per_s=1e8)
    t_own = allreduce_time(
        m, 2, numel=16 * 2**20, grad_bytes=4, algorithm="scatter_reduce", codec=own
    )
    assert t_own.codec_s == pytest.approx(2.5 * 16 * 2**20 / 1e8)


@settings(max_examples=60, deadline=None)
@given(
    mib=st.sampled_from([0.5, 4, 16, 64, 400]),
    codec=st.sampled_from(["qsgd2", "qsgd4", "qsgd8"]),
    machine=st.sampled_from(
        ["testbed-1gbit", "testbed-1gbit-gloo", "v100-nvlink-25g", "rtx3090-pcie"]
    ),
    gpus=st.sampled_from([2, 8, 64]),
    piece_mib=st.sampled_from([0, 1, 4, 32]),
)
def test_pipelined_sra_is_bounded_by_its_wire_and_codec_time(mib, codec, machine, gpus, piece_mib):
    m = get_machine(machine)
    nodes, per_node = m.layout(gpus)
    numel = mib * 2**20 / 4
    t = allreduce_time(
        m,
        gpus,
        numel=numel,
        grad_bytes=4,
        algorithm="scatter_reduce",
        codec=codec,
        piece_bytes=piece_mib * 2**20,
    )
    wire_floor = sra_time(
        replace(
            m,
            message_overhead_s=0.0,
            intra=Link(0, m.intra.bandwidth_Bps),
            inter=Link(0, m.inter.bandwidth_Bps),
            uplink=m.uplink and Link(0, m.uplink.bandwidth_Bps),
            cross_group=m.cross_group and Link(0, m.cross_group.bandwidth_Bps),
        ),
        nodes,
        per_node,
        t.wire_bytes,
    )
    assert t.total_s >= wire_floor * (1 - 1e-9)  # never faster than the wire
    assert t.total_s >= t.codec_s * (1 - 1e-9)  # never faster than the codec
    assert t.total_s <= t.transfer_s + t.codec_s + 1e-12  # overlap only ever helps
    if piece_mib == 0:
        assert t.pieces == 1 and t.hidden_s == 0.0
        assert t.total_s == pytest.approx(sra_time(m, nodes, per_node, t.wire_bytes) + t.codec_s)


def test_pipelined_testbed_qsgd4_is_wire_bound_plus_one_piece_of_codec_work():
    m = get_machine("testbed-1gbit")
    t = allreduce_time(
        m, 2, numel=16 * 2**20, grad_bytes=4, algorithm="scatter_reduce", codec="qsgd4"
    )
    assert t.pieces == 16
    wire = 2 * (1 / 2) * t.wire_bytes / m.inter.bandwidth_Bps  # two phases, half the bytes each
    latencies = 16 * 2 * (m.inter.latency_s + m.message_overhead_s)
    assert t.total_s == pytest.approx(wire + t.codec_s / 16 + latencies)
    # The wire time at the line rate is the physical limit the issue states: 71 ms.
    assert 2 * (1 / 2) * t.wire_bytes / 125e6 == pytest.approx(0.0713, abs=1e-4)
    unpipelined = allreduce_time(
        m,
        2,
        numel=16 * 2**20,
        grad_bytes=4,
        algorithm="scatter_reduce",
        codec="qsgd4",
        piece_bytes=0,
    )
    assert unpipelined.total_s - t.total_s > 0.8 * t.codec_s  # most codec work is hidden


def test_pieces_follow_the_piece_size_and_growing_pieces_expose_codec_work():
    m = get_machine("testbed-1gbit")
    times = []
    for piece_mib in (1, 4, 16, 64):
        t = allreduce_time(
            m,
            2,
            numel=16 * 2**20,
            grad_bytes=4,
            algorithm="scatter_reduce",
            codec="qsgd8",
            piece_bytes=piece_mib * 2**20,
        )
        assert t.pieces == 64 // piece_mib
        times.append(t.total_s)
    # 1 MiB pieces pay 64 pieces of latency; 64 MiB is one piece: the codec is not hidden at all.
    assert times[-1] == max(times)


def test_hierarchical_with_a_nonlinear_codec_pipelines_each_shard_between_nodes():
    m = get_machine("v100-nvlink-25g")
    numel = 1e8
    t = hierarchical_pipelined(m, 8, 8, numel, 4, get_codec_cost("qsgd4"))
    intra = 2 * ring_reduce_scatter_time(8, numel * 4, m.intra)  # fp32 inside the node
    inter_wire = 2 * 7 / 8 * t.wire_bytes / m.inter.bandwidth_Bps  # the node's shards share its NIC
    assert t.total_s >= intra + max(inter_wire, t.codec_s) - 1e-12
    assert t.pieces == math.ceil(numel * 4 / 8 / SRA_PIECE_BYTES)  # pieces of one GPU's shard
    one_piece = hierarchical_pipelined(m, 8, 8, numel, 4, get_codec_cost("qsgd4"), piece_bytes=0)
    assert one_piece.total_s == pytest.approx(
        hierarchical_time(m, 8, 8, numel * 4, t.wire_bytes, linear=False) + t.codec_s
    )
    assert allreduce_time(
        m, 64, numel=numel, grad_bytes=4, algorithm="hierarchical", codec="qsgd4"
    ).total_s == pytest.approx(t.total_s)
    # The pipeline hides codec work and pays a latency per piece: with the V100's fast codec it
    # hides less than it pays, with a codec as slow as the link it hides a lot.
    slow = replace(get_codec_cost("qsgd4"), encode_elems_per_s=2e8, decode_elems_per_s=4e8)
    piped = hierarchical_pipelined(m, 8, 8, numel, 4, slow)
    flat = hierarchical_pipelined(m, 8, 8, numel, 4, slow, piece_bytes=0)
    assert flat.total_s - piped.total_s > 0.5 * min(piped.codec_s, inter_wire)


def test_transports_of_the_testbed_differ_in_collective_latency_only():
    mpi, gloo = get_machine("testbed-1gbit"), get_machine("testbed-1gbit-gloo")
    assert gloo.inter.bandwidth_Bps == mpi.inter.bandwidth_Bps and gloo.codec_GBps == mpi.codec_GBps
    assert gloo.inter.latency_s > mpi.inter.latency_s
    q = dict(numel=16 * 2**20, grad_bytes=4, algorithm="scatter_reduce", codec="qsgd4")
    diff = allreduce_time(gloo, 2, **q).total_s - allreduce_time(mpi, 2, **q).total_s
    assert diff == pytest.approx(32 * (gloo.inter.latency_s - mpi.inter.latency_s))  # 16 pieces x 2
    # The gloo figure reproduces the quiet 96 MiB row it was read from (122 ms).
    t96 = allreduce_time(
        gloo, 2, numel=24 * 2**20, grad_bytes=4, algorithm="scatter_reduce", codec="qsgd4"
    ).total_s
    assert t96 == pytest.approx(0.122, rel=0.01)


def test_plan_piece_size_reaches_the_step_and_is_validated():
    m = get_machine("testbed-1gbit")
    from commopt.sim.validation import synthetic_profile

    prof = synthetic_profile(0.1, 64 * 2**20)
    piped = simulate(prof, m, Configuration("scatter_reduce", "qsgd4", 64, False), 2)
    flat = simulate(prof, m, Configuration("scatter_reduce", "qsgd4", 64, False, piece_mb=0), 2)
    assert piped.comm_s < flat.comm_s
    assert Configuration(compression="qsgd4").with_(piece_mb=0).piece_mb == 0.0
    with pytest.raises(ValueError, match="piece size"):
        Configuration(piece_mb=-1)
    with pytest.raises(TypeError, match="no field"):
        Configuration().with_(pieces=3)
