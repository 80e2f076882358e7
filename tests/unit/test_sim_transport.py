"""The transport model (TCP flows, socket threads, NCCL variables), software presets, the
dominant term, and the simulate command's new options."""

from __future__ import annotations

import argparse
import math

import pytest

from commopt.sim import Configuration, get_machine, simulate
from commopt.sim.machines import PRESETS
from commopt.sim.software import SOFTWARE, software_plan
from commopt.sim.transport import SOCKET_MIN_CHUNK, TRANSPORTS, Transport, parse_nccl_env
from commopt.sim.validation import synthetic_profile

GBIT = 1e9 / 8
LINE = 25 * GBIT * 0.956


def test_one_flow_is_capped_by_ec2_and_sixteen_reach_the_nic():
    t = TRANSPORTS["nccl-2.4-sockets-ec2"]
    assert t.flows == 1 and t.cap_Bps(LINE, 2**26) == pytest.approx(10 * GBIT)
    tuned = t.with_env({"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"})
    assert tuned.flows == 16 and tuned.cap_Bps(LINE, 2**26) == pytest.approx(LINE)


def test_a_small_message_uses_one_flow_per_64_kib_piece():
    tuned = TRANSPORTS["nccl-2.4-sockets-ec2"].with_env(parse_nccl_env("aws-tcp"))
    assert tuned.flows_used(SOCKET_MIN_CHUNK) == 1
    assert tuned.flows_used(3 * SOCKET_MIN_CHUNK) == 3
    assert tuned.flows_used(2**30) == 16
    assert tuned.cap_Bps(LINE, SOCKET_MIN_CHUNK) == pytest.approx(10 * GBIT)
    # Two pieces ride two sockets of one thread: two flows' cap, or that thread's rate.
    assert tuned.cap_Bps(LINE, 2 * SOCKET_MIN_CHUNK) == pytest.approx(
        min(20 * GBIT, tuned.thread_GBps * 1e9)
    )


def test_the_socket_thread_is_the_limit_without_a_per_flow_cap():
    t = TRANSPORTS["nccl-sockets"]
    line100 = 100 * GBIT
    assert t.cap_Bps(line100, 2**26) == pytest.approx(t.thread_GBps * 1e9)
    two = t.with_env({"NCCL_SOCKET_NTHREADS": "2", "NCCL_NSOCKS_PERTHREAD": "2"})
    assert two.cap_Bps(line100, 2**26) == pytest.approx(2 * t.thread_GBps * 1e9)
    # Several connections (commopt's hierarchical ring: one per GPU) share the NIC.
    assert t.cap_Bps(line100, 2**26, connections=8) == pytest.approx(line100)


def test_nccl_reads_variables_only_from_its_version():
    old = TRANSPORTS["nccl-2.2-sockets"]
    assert old.with_env({"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"}) == old
    ib = TRANSPORTS["nccl-ib-gdr"]
    assert ib.with_env({"NCCL_SOCKET_NTHREADS": "4"}) == ib
    assert ib.with_env({"NCCL_IB_PCI_RELAXED_ORDERING": "0"}) == ib  # not a VM with the option
    azure = TRANSPORTS["nccl-2.12-ib-azure"]
    off = azure.with_env({"NCCL_IB_PCI_RELAXED_ORDERING": "0"})
    assert off.relaxed_ordering is False
    assert off.cap_Bps(100e9, 2**26) == pytest.approx(100e9 * 25 / 188)


@pytest.mark.parametrize(
    "env, match",
    [
        ({"NCCL_SOCKET_NTHREADS": "0"}, ">= 1"),
        ({"NCCL_SOCKET_NTHREADS": "four"}, "integer"),
        ({"NCCL_SOCKET_NTHREADS": "8", "NCCL_NSOCKS_PERTHREAD": "16"}, "at most 64"),
        ({"NCCL_NET_PLUGIN": "teleport"}, "unknown network plugin"),
    ],
)
def test_bad_nccl_values_are_errors(env, match):
    with pytest.raises(ValueError, match=match):
        TRANSPORTS["nccl-2.4-sockets-ec2"].with_env(env)


def test_parse_nccl_env_words_profiles_and_typos():
    assert parse_nccl_env("NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4") == {
        "NCCL_SOCKET_NTHREADS": "4",
        "NCCL_NSOCKS_PERTHREAD": "4",
    }
    assert parse_nccl_env("aws-tcp") == {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"}
    assert parse_nccl_env("NCCL_DEBUG=INFO") == {"NCCL_DEBUG": "INFO"}  # read by NCCL, not modelled
    with pytest.raises(ValueError, match="did you mean NCCL_SOCKET_NTHREADS"):
        parse_nccl_env("NCCL_SOCKET_NTHREAD=4")
    with pytest.raises(ValueError, match="unknown --nccl-env profile"):
        parse_nccl_env("aws")
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_nccl_env("=4")


def test_the_tuning_changes_a_multi_node_prediction_and_not_a_single_node_one():
    m = get_machine("v100-nvlink-25g")
    tuned = m.with_overrides(nccl_env=parse_nccl_env("aws-tcp"))
    plan = software_plan("pytorch-ddp")
    assert (
        simulate("bert-large", tuned, plan, 16).throughput
        > 1.5 * simulate("bert-large", m, plan, 16).throughput
    )
    assert simulate("bert-large", tuned, plan, 8).throughput == pytest.approx(
        simulate("bert-large", m, plan, 8).throughput
    )
    with pytest.raises(ValueError, match="no NCCL transport"):
        get_machine("testbed-1gbit").with_overrides(nccl_env={"NCCL_SOCKET_NTHREADS": "4"})
    with pytest.raises(ValueError, match="unknown transport"):
        m.with_overrides(transport="carrier-pigeon")


def test_every_gpu_preset_names_its_transport_and_cites_every_parameter():
    for name, m in PRESETS.items():
        keys = set(m.sources)
        assert any(k.startswith("inter") for k in keys), name
        assert "memory_GBps" in keys or m.gpu == "cpu", name
        if m.gpu != "cpu":
            assert isinstance(m.transport, Transport), name
            assert m.transport.sources.get("kind"), name
    for t in TRANSPORTS.values():
        for attr in ("per_flow_gbps", "thread_GBps"):
            if getattr(t, attr):
                assert attr in t.sources, (t.name, attr)


def test_software_presets_cite_what_they_set():
    for sw in SOFTWARE.values():
        p = sw.plan()
        assert p.overlap == sw.overlap and p.copy_passes == sw.copy_passes
        assert p.double_buffering == sw.double_buffering
        for f in (
            ("bucket_cap_mb", "copy_passes")
            if sw.name.startswith("chainermn")
            else ("copy_passes",)
        ):
            assert f in sw.sources, (sw.name, f)
        if sw.name.startswith("chainermn"):
            assert ("double_buffering" if sw.double_buffering else "overlap") in sw.sources
    cm = software_plan("chainermn-1.3-pure_nccl")
    assert cm.algorithm == "ring" and math.isinf(cm.bucket_cap_mb) and cm.schedule == "none"
    db = software_plan("chainermn-1.3-pure_nccl-db", compression="fp16")
    assert db.compression.name == "fp16" and db.schedule == "double-buffering"
    with pytest.raises(ValueError, match="unknown software"):
        software_plan("horovod-0.1")


def test_copies_cost_compute_time_and_one_buffer_waits_for_the_backward_pass():
    with_copies = simulate("resnet50", "p100-10gbe", Configuration(copy_passes=3), 16)
    without = simulate("resnet50", "p100-10gbe", Configuration(), 16)
    assert with_copies.compute_s > without.compute_s and with_copies.copy_s > 0
    assert simulate("resnet50", "p100-10gbe", Configuration(copy_passes=3), 1).copy_s == 0
    one = simulate("resnet50", "p100-10gbe", Configuration(bucket_cap_mb=math.inf), 16)
    assert one.buckets == 1
    with pytest.raises(ValueError, match="copy passes"):
        Configuration(copy_passes=-1)


def test_native_algorithm_choice_excludes_the_hierarchical_ring():
    assert Configuration(algorithm="native").candidates() == ("ring", "tree")
    with pytest.raises(ValueError, match="not linear"):
        Configuration(
            algorithm="native", compression="qsgd4"
        )  # as the optimizer: the transport sums
    assert simulate(
        "resnet50", "v100-nvlink-25g", Configuration(algorithm="native"), 64
    ).algorithm in (
        "ring",
        "tree",
        "ring+tree",
        "tree+ring",
    )


def test_the_dominant_term_of_each_kind():
    assert simulate("resnet50", "p3dn-efa", software_plan("pytorch-ddp"), 8).dominant == "compute"
    assert (
        simulate("bert-large", "v100-nvlink-25g", software_plan("pytorch-ddp"), 64).dominant
        == "exposed communication"
    )
    tiny = synthetic_profile(0.01, 4e5, device="v100")
    assert (
        simulate(
            tiny, "v100-nvlink-25g", Configuration("ring", bucket_cap_mb=0.001, overlap=False), 4096
        ).dominant
        == "latency"
    )
    big = synthetic_profile(0.001, 4e8, device="cpu")
    fast = get_machine("testbed-1gbit").with_overrides(inter_gbps=1000)
    assert (
        simulate(
            big, fast, Configuration("scatter_reduce", "qsgd4", overlap=False, piece_mb=0), 2
        ).dominant
        == "codec"
    )


def _parser():
    from commopt.commands import simulate as cmd

    ap = argparse.ArgumentParser()
    cmd.add_arguments(ap)
    return ap


def test_every_simulate_option_has_help():
    missing = [a.option_strings for a in _parser()._actions if a.option_strings and a.help is None]
    assert not missing, missing


def test_cli_nccl_env_and_software(capsys):
    from commopt.commands import simulate as cmd

    def run(*argv):
        assert cmd.run(_parser().parse_args(list(argv) + ["--json"])) == 0
        import json

        return json.loads(capsys.readouterr().out)

    bert_on_16 = ("--machine", "v100-nvlink-25g", "--gpus", "16", "--model", "bert-large")
    base = run(*bert_on_16, "--algorithm", "native")
    tuned = run(*bert_on_16, "--nccl-env", "NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4")
    assert tuned["rows"][0]["throughput"] > 1.5 * base["rows"][0]["throughput"]
    cm = run(
        "--machine",
        "p100-10gbe",
        "--gpus",
        "32",
        "--software",
        "chainermn-1.3-pure_nccl-db",
        "--compression",
        "fp16",
    )
    assert (
        cm["plan"]["double_buffering"] is True and cm["plan"]["copy_passes"] == 0
    )  # swaps gradient arrays (ChainerMN 1.3 code)
    assert cmd.run(_parser().parse_args(["--nccl-env", "NCCL_NSOCK_PERTHREAD=2"])) == 2
    assert "did you mean NCCL_NSOCKS_PERTHREAD" in capsys.readouterr().err


def test_a_machine_file_keeps_its_transport():
    import json

    from commopt.sim.machines import Machine

    for m in PRESETS.values():
        again = Machine.from_dict(json.loads(json.dumps(m.to_dict())))
        assert again.transport == m.transport and again.inter == m.inter, m.name
    d = PRESETS["p100-10gbe"].to_dict()
    d["transport"] = "nccl-ib-gdr"
    assert Machine.from_dict(d).transport.kind == "ib-verbs"
    d["transport"] = "smoke-signals"
    with pytest.raises(ValueError, match="unknown transport"):
        Machine.from_dict(d)
