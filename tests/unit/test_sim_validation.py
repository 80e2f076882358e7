"""The simulator against the published scaling rows and effects, and the testbed's physics."""
from __future__ import annotations

import pytest

from commopt.sim import Plan, get_machine, load_profile, simulate
from commopt.sim.validation import (TOLERANCE, Measurement, chainermn_effect, cgx_effect, compare_measured,
                                    physical_allreduce_s, published_comparison, predict_testbed_allreduce,
                                    compare_testbed_measurements)

ROWS = published_comparison()


def _id(r):
    source = "cgx" if r.row.source.startswith("CGX") else "nvidia-dle-b16"
    return f"{source}-{r.row.model}-{r.row.machine}-{r.row.gpus}"


@pytest.mark.parametrize("compared", ROWS, ids=_id)
def test_published_scaling_rows_within_15_percent(compared):
    if compared.row.gpus == 1:
        # The anchor: the published single-GPU speed is an input.
        assert compared.error == pytest.approx(0.0, abs=1e-9)
        return
    if compared.known_miss:
        # Stated, not tuned away; the row must really be missed, or the reason is stale.
        assert abs(compared.error) > TOLERANCE, f"{_id(compared)} is now within 15%: drop known_miss"
        pytest.xfail(compared.known_miss)
    assert abs(compared.error) <= TOLERANCE, (
        f"{_id(compared)}: predicted {compared.predicted:.0f}, published {compared.row.published:.0f}")


def test_only_one_published_row_is_a_known_miss():
    assert sum(r.known_miss is not None for r in ROWS) == 1


def test_assumption_dependent_rows_really_depend_on_the_assumption():
    """The BERT rows on the 3090 hinge on the unpublished batch: say so, and check it is true."""
    flagged = [r for r in ROWS if r.caveat]
    assert {(r.row.model, r.row.machine) for r in flagged} == {("bert-large", "rtx3090-pcie")}
    profile = load_profile("bert-large")
    for r in flagged:
        for seqs in (2, 8):
            other = simulate(profile.with_overrides(batch_per_gpu=seqs * 384), r.row.machine, r.row.plan, r.row.gpus)
            assert abs(other.throughput / r.row.published - 1) > 0.3
    # The V100 BERT rows are a real test: they hardly move with the batch.
    for r in ROWS:
        if (r.row.model, r.row.machine) == ("bert-large", "v100-nvlink-25g") and r.row.gpus > 1:
            for seqs in (2, 8):
                other = simulate(profile.with_overrides(batch_per_gpu=seqs * 384), r.row.machine, r.row.plan,
                                 r.row.gpus)
                assert abs(other.throughput / r.row.published - 1) <= TOLERANCE


def test_bert_on_the_3090_is_slower_on_2_gpus_than_on_1_as_published():
    one = simulate("bert-large", "rtx3090-pcie", Plan(), 1).throughput
    two = simulate("bert-large", "rtx3090-pcie", Plan(), 2).throughput
    four = simulate("bert-large", "rtx3090-pcie", Plan(), 4).throughput
    assert four < one and two < 1.1 * one


def test_chainermn_double_buffering_and_fp16_reach_the_published_efficiency():
    e = chainermn_effect()
    assert abs(e.error) <= TOLERANCE, f"predicted {e.predicted_value:.2f} vs published 0.96"
    # The features are what make it: without them the same run scales far worse.
    assert e.baseline_value < 0.75 * e.predicted_value


def test_chainermn_near_linear_on_10gbe_with_both_features():
    plan = Plan("ring", "fp16", 25, "double-buffering")
    base = simulate("resnet50", "p100-10gbe", plan, 8).throughput
    assert simulate("resnet50", "p100-10gbe", plan, 32).throughput / (4 * base) > 0.9
    plain = Plan("ring", "none", 25, "none")
    base = simulate("resnet50", "p100-10gbe", plain, 8).throughput
    assert simulate("resnet50", "p100-10gbe", plain, 32).throughput / (4 * base) < 0.8


def test_cgx_compression_brings_bert_on_the_3090_to_the_v100s_scaling():
    e = cgx_effect("bert-large")
    assert abs(e.error) <= TOLERANCE
    assert e.predicted_value > 3 * e.baseline_value


def test_cgx_compression_on_transformer_xl_direction_and_size():
    e = cgx_effect("transformer-xl-base")
    assert e.predicted_value > 1.8 * e.baseline_value        # published: 35% -> about 87%
    if abs(e.error) > TOLERANCE:
        pytest.xfail("Transformer-XL's tied embedding (71% of its gradient) is complete only at the end of "
                     "the backward pass, so even compressed its all-reduce stays exposed: predicted "
                     f"{e.predicted_value:.0%} vs about {e.published_value:.0%} published")


def test_testbed_allreduce_against_the_physical_limit():
    limit = physical_allreduce_s(64 * 2**20, 2, 1.0)
    assert limit == pytest.approx(64 * 2**20 / 125e6)      # 2(n-1)/n * bytes / rate, n = 2
    predicted = predict_testbed_allreduce(64 * 2**20, 2)
    assert limit < predicted < 1.10 * limit                  # TCP headers, 2 latencies
    assert predict_testbed_allreduce(64 * 2**20, 2, codec="fp16") < 0.6 * predicted


def test_testbed_measurements_can_be_compared():
    m = get_machine("testbed-1gbit")
    assert m.gpus_per_node == 1 and m.inter_gbps == 1.0
    out = compare_measured(measured_step_s=1.4, compute_s=0.5, grad_bytes=64 * 2**20)
    assert out["predicted_step_s"] == pytest.approx(0.5 + predict_testbed_allreduce(64 * 2**20), rel=0.01)
    rows = compare_testbed_measurements([Measurement("resnet50 fp32", "commopt bench ...", 2, 0.5, 64 * 2**20, 1.0)])
    assert rows[0]["error"] == pytest.approx(rows[0]["predicted_step_s"] - 1.0)
    with pytest.raises(ValueError, match="must be > 0"):
        compare_measured(measured_step_s=1.0, compute_s=0.0, grad_bytes=1)
