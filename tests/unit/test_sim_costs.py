"""The simulator's cost model: textbook formulas, their composition on machines, overlap bounds."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commopt.sim import Plan, allreduce_time, get_machine, load_profile, simulate
from commopt.sim.codec_costs import get_codec
from commopt.sim.comm_model import hierarchical_time, ring_time, sra_time, tree_time
from commopt.sim.costs import (GBIT, Link, hierarchical_allreduce_time, ring_allreduce_time,
                               ring_reduce_scatter_time, scatter_reduce_allgather_time, tree_allreduce_time)
from commopt.sim.machines import Machine

US = 1e-6


def uniform_machine(gpus_per_node=8, intra=Link(5 * US, 20e9), inter=Link(30 * US, 2.5e9)) -> Machine:
    return Machine(name="uniform", description="test", gpu="v100", gpus_per_node=gpus_per_node,
                   intra=intra, inter=inter, inter_gbps=20.0, inter_efficiency=1.0, memory_GBps=900.0)


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
    assert allreduce_time(get_machine("v100-nvlink-25g"), 1, numel=1e8, grad_bytes=4, algorithm="ring").total_s == 0.0


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
    assert hierarchical_time(m, 1, g, S, S, linear=True) == pytest.approx(ring_allreduce_time(g, S, m.intra))


def test_hierarchical_beats_flat_ring_when_the_nic_is_slow_and_latency_counts():
    m = uniform_machine()
    S = 1e6   # latency-bound: the flat ring pays 2(n-1) inter-node latencies
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
    floor = 2 * (nodes - 1) / nodes * S / m.inter.bandwidth_Bps   # what each NIC must move
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
    assert sra_time(m, 128, 1, 0.0) == pytest.approx(2 * (m.inter.latency_s + 127 * m.message_overhead_s))


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
        Plan(algorithm="tree", codec="qsgd8")


def test_fp16_cast_of_fp16_gradients_costs_nothing():
    fp16 = get_codec("fp16")
    assert fp16.is_identity(grad_bytes=2) and not fp16.is_identity(grad_bytes=4)
    assert fp16.encode_s(1e9, 900, grad_bytes=2) == 0.0


def test_qsgd_sizes_match_commopts_codec():
    codecs = pytest.importorskip("commopt.codecs")
    for bits, bucket in [(2, 128), (4, 128), (8, 128), (4, 1024)]:
        ours = get_codec(f"qsgd{bits}b{bucket}").wire_bytes(1 << 20, grad_bytes=4)
        theirs = codecs.QSGD(bits=bits, bucket_size=bucket).encoded_nbytes(1 << 20)
        assert ours == pytest.approx(theirs, abs=4)   # theirs pads to 4 bytes


# --- overlap --------------------------------------------------------------------------------

_machines = st.sampled_from(["v100-nvlink-25g", "rtx3090-pcie", "p100-10gbe", "p3dn-efa"])
_models = st.sampled_from(["resnet50", "bert-large", "transformer-xl-base"])


@settings(max_examples=60, deadline=None)
@given(machine=_machines, model=_models, gpus=st.sampled_from([2, 8, 16, 128, 1024]),
       codec=st.sampled_from(["none", "fp16", "qsgd4"]), bucket=st.sampled_from([1.0, 25.0, 400.0]),
       gbps=st.sampled_from([None, 1.0, 400.0]))
def test_overlap_is_never_faster_than_the_larger_of_compute_and_communication(
        machine, model, gpus, codec, bucket, gbps):
    m = get_machine(machine).with_overrides(inter_gbps=gbps)
    profile = load_profile(model)
    if m.gpu not in profile.throughput:
        profile = profile.with_overrides(gpu=m.gpu, step_time=0.2)
    steps = {}
    for overlap in ("none", "backward", "double-buffering"):
        p = simulate(profile, m, Plan("auto", codec, bucket, overlap), gpus)
        assert p.step_s >= max(p.compute_s, p.comm_s) * (1 - 1e-12)
        assert 0 < p.efficiency <= 1 + 1e-12
        steps[overlap] = p
    assert steps["none"].step_s == pytest.approx(steps["none"].compute_s + steps["none"].comm_s)
    assert steps["double-buffering"].step_s == pytest.approx(
        max(steps["double-buffering"].compute_s, steps["double-buffering"].comm_s))
    assert steps["backward"].step_s <= steps["none"].step_s * (1 + 1e-12)


def test_backward_overlap_hides_early_buckets_but_not_the_last():
    profile = load_profile("resnet50")
    m = get_machine("v100-nvlink-25g")
    p = simulate(profile, m, Plan("ring", "none", 25.0, "backward"), 8)
    none = simulate(profile, m, Plan("ring", "none", 25.0, "none"), 8)
    assert 0 < p.exposed_comm_s < none.exposed_comm_s
    assert p.buckets >= 4


def test_one_gpu_runs_at_the_profile_speed():
    p = simulate("resnet50", "v100-nvlink-25g", Plan(), 1)
    assert p.throughput == pytest.approx(1226.0)
    assert p.efficiency == 1.0 and p.comm_s == 0.0


def test_auto_takes_the_fastest_algorithm_per_bucket():
    m = get_machine("v100-nvlink-25g")
    auto = simulate("bert-large", m, Plan("auto"), 1024)
    for algorithm in ("ring", "tree", "hierarchical"):
        fixed = simulate("bert-large", m, Plan(algorithm), 1024)
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
    assert simulate("bert-large", fast, Plan(), 256).efficiency > simulate("bert-large", m, Plan(), 256).efficiency
    with pytest.raises(ValueError, match="inter-gbps"):
        m.with_overrides(inter_gbps=0)
