"""Published effects, leave-one-out bounds and the held-out comparison (not transport tests:
the simulator's predictions against published numbers)."""

from __future__ import annotations

import os

import pytest

from commopt.sim.effects import (
    EFFECT_TOLERANCE,
    azure_relaxed_ordering_effect,
    chainermn_10gbe_effect,
    chainermn_network_comparison,
    ec2_socket_ratio,
    ec2_socket_threads_effect,
    gcp_fastsocket_effect,
    gcp_fastsocket_sensitivity,
)
from commopt.sim.loo import choice_alternatives, leave_one_out
from commopt.sim.validation import TOLERANCE, cgx_effect, chainermn_effect, load_measurements

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "sim-testbed-1gbit.json")


def _direction_and_size(e):
    assert (e.predicted_value > e.baseline_value) == (e.published_value > e.baseline_value), e.name
    assert abs(e.error) <= EFFECT_TOLERANCE, (
        f"{e.name}: predicted {e.predicted_value:.3g}, published {e.published_value:.3g}"
    )


def test_ec2_socket_threads_about_2x_above_1_mb():
    _direction_and_size(ec2_socket_threads_effect())
    small_default, small_tuned = ec2_socket_ratio(64e3)
    assert small_tuned == pytest.approx(small_default)  # one 64 KiB piece: one flow either way
    for size in (1e6, 16e6, 256e6):
        default, tuned = ec2_socket_ratio(size)
        assert abs(tuned / default / 2.0 - 1) <= EFFECT_TOLERANCE, size


def test_azure_relaxed_ordering_in_sample():
    _direction_and_size(azure_relaxed_ordering_effect())


def test_chainermn_features_on_aws_and_on_10gbe():
    aws = chainermn_effect()
    _direction_and_size(aws)
    assert aws.baseline_value < 0.75 * aws.predicted_value
    gbe = chainermn_10gbe_effect()
    assert (
        gbe.predicted_value > 0.9 and gbe.baseline_value < 0.8
    )  # published: near-linear with both


def test_cgx_4bit_on_the_3090_server():
    _direction_and_size(cgx_effect("bert-large"))
    txl = cgx_effect("transformer-xl-base")
    assert txl.predicted_value > 1.8 * txl.baseline_value
    if abs(txl.error) > EFFECT_TOLERANCE:
        pytest.xfail(
            "Transformer-XL's tied embedding (71% of its gradient) is ready only at the end of the "
            "backward pass; CGX's own pages bound this model's gain below the V100's scaling "
            "(docs/scaling.md)"
        )


@pytest.mark.xfail(
    strict=True,
    reason="the published run's baseline is not given: NCCL opens 1 thread x 1 "
    "socket on gVNIC before its gVNIC detection (model: 2.8x) and 4 x 1 after it, the same as Fast "
    "Socket's 4 sockets x 4 threads (model: 1.0x); +30% needs ~6 GB/s per connection, unsourced",
)
def test_gcp_fast_socket_size():
    _direction_and_size(gcp_fastsocket_effect())


def test_gcp_fast_socket_direction():
    e = gcp_fastsocket_effect()
    assert e.predicted_value > 1.0


def test_fast_socket_runs_its_defaults_four_sockets_four_threads():
    from commopt.sim.machines import get_machine
    from commopt.sim.transport import parse_nccl_env

    t = (
        get_machine("gcp-v100-100g")
        .with_overrides(nccl_env=parse_nccl_env("gcp-fastsocket"))
        .transport
    )
    assert (t.flows, t.nthreads, t.plugin) == (4, 4, "fastsocket")
    assert t.thread_GBps == 2.4  # zero-copy off by default: its threads copy as NCCL's do


def test_fast_socket_effect_brackets_the_published_30_percent():
    (_, old_nccl), (_, gvnic_nccl) = gcp_fastsocket_sensitivity()
    # Against NCCL with its gVNIC detection (4 x 1) the model has nothing for Fast Socket to add;
    # against 1 x 1 it over-predicts at the profile's batch: the published 1.30 lies between.
    assert all(r == pytest.approx(1.0) for r in gvnic_nccl.values())
    assert old_nccl[4] > 1.30 > gvnic_nccl[4]
    assert all(
        a >= b for a, b in zip(old_nccl.values(), list(old_nccl.values())[1:])
    )  # larger batch, less gain


def _loo_rows():
    ms = load_measurements(RESULTS) if os.path.exists(RESULTS) else []
    return leave_one_out(ms)


LOO = _loo_rows()


@pytest.mark.parametrize("row", LOO, ids=lambda r: r.row[:60])
def test_out_of_sample_within_15_percent(row):
    if row.note.startswith("in-sample only"):
        # Honest about it: out of sample the model has no source for the effect, and misses it.
        assert abs(row.out_of_sample_error) > TOLERANCE
        return
    if row.note.startswith("known miss"):
        assert abs(row.out_of_sample_error) > TOLERANCE, "the known miss is now within 15%: drop it"
        pytest.xfail(
            "Transformer-XL on the 3090, 4 GPUs: needs ~1.5x the measured staged bandwidth that every "
            "other row on that server fits; no placement or workload fact found moves it alone "
            "(docs/scaling.md)"
        )
    assert abs(row.out_of_sample_error) <= TOLERANCE, row


def test_loo_covers_every_row_that_informed_a_choice():
    informed = {r for _, _, _, _, errs in choice_alternatives() for r in errs}
    assert informed <= {r.row for r in LOO}
    assert sum(r.note.startswith("known miss") for r in LOO) == 1
    assert sum(r.note.startswith("in-sample only") for r in LOO) == 2  # Azure, EC2 baseline


def test_held_out_network_comparison():
    c = chainermn_network_comparison()
    assert c.slowdown > 1.6  # the earlier model: 1.33x; published: far larger


@pytest.mark.xfail(
    strict=True,
    reason="published: 10 GbE with double buffering + FP16 was slower than "
    "InfiniBand without them; with the cited socket transport (0.7 GB/s per connection) the "
    "FP16 all-reduce hides under FP32 compute; it would need < 0.3 GB/s per connection or > 38 ms "
    "of double-buffering cost per 295 ms step, and no source gives either (docs/scaling.md)",
)
def test_held_out_features_on_10gbe_slower_than_infiniband():
    assert chainermn_network_comparison().features_vs_ib > 1
