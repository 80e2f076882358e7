"""`commopt doctor`: every finding on crafted machines, triggered and not triggered."""

from __future__ import annotations

import json
import os

import pytest

from commopt.network import nccl_vars, probe
from commopt.network.cloud_profiles import PROFILES, profile_env, render
from commopt.network.doctor import diagnose, nccl_ifname_matches


def itf(name, state="up", speed=None, loopback=False):
    return {"name": name, "state": state, "speed_mbps": speed, "loopback": loopback}


LO = itf("lo", "unknown", loopback=True)


def codes(snapshot):
    return [f.code for f in diagnose(snapshot)]


def only(snapshot, code):
    found = [f for f in diagnose(snapshot) if f.code == code]
    assert found, f"expected a {code} finding, got {codes(snapshot)}"
    return found


# -- several interfaces, NCCL_SOCKET_IFNAME unset ------------------------------------------------
def test_several_interfaces_without_ifname_suggests_the_fastest():
    snap = {"env": {}, "interfaces": [LO, itf("eth0", speed=1000), itf("ens5", speed=100000)]}
    (f,) = only(snap, "nccl-socket-ifname")
    assert f.severity == "warning"
    assert f.fix == "export NCCL_SOCKET_IFNAME=ens5"
    assert "eth0" in f.message and "ens5" in f.message


@pytest.mark.parametrize(
    "snap",
    [
        {"env": {}, "interfaces": [LO, itf("eth0")]},  # one interface
        {"env": {}, "interfaces": [LO, itf("eth0"), itf("docker0")]},  # NCCL skips docker
        {"env": {}, "interfaces": [LO, itf("eth0"), itf("eth1", state="down")]},  # second one down
        {"env": {"NCCL_SOCKET_IFNAME": "eth1"}, "interfaces": [LO, itf("eth0"), itf("eth1")]},
    ],
)
def test_ifname_not_flagged(snap):
    assert "nccl-socket-ifname" not in codes(snap)


def test_ifname_matching_no_interface_is_an_error():
    snap = {"env": {"NCCL_SOCKET_IFNAME": "ib"}, "interfaces": [LO, itf("eth0")]}
    (f,) = only(snap, "nccl-socket-ifname")
    assert f.severity == "error" and "matches none" in f.message


def test_nccl_ifname_syntax():
    names = ["lo", "eth0", "eth01", "docker0", "ib0"]
    assert nccl_ifname_matches("eth", names) == ["eth0", "eth01"]
    assert nccl_ifname_matches("=eth0", names) == ["eth0"]
    assert nccl_ifname_matches("^docker,lo", names) == ["eth0", "eth01", "ib0"]
    assert nccl_ifname_matches("^=eth0", names) == ["lo", "eth01", "docker0", "ib0"]


# -- Open MPI's TCP transport over lo / docker0 ---------------------------------------------------
OMPI = {"mpi": "Open MPI 4.1.4"}


def test_docker_bridge_not_excluded_from_open_mpi():
    snap = {"env": {}, "versions": OMPI, "interfaces": [LO, itf("eth0"), itf("docker0")]}
    (f,) = only(snap, "mpi-tcp-exclude")
    assert "docker0" in f.message
    assert f.fix == "export OMPI_MCA_btl_tcp_if_exclude=lo,docker0"


def test_user_exclude_dropping_loopback_is_flagged():
    # Setting btl_tcp_if_exclude replaces Open MPI's default, which was what excluded loopback.
    snap = {
        "env": {"OMPI_MCA_btl_tcp_if_exclude": "docker0"},
        "versions": OMPI,
        "interfaces": [LO, itf("eth0"), itf("docker0")],
    }
    (f,) = only(snap, "mpi-tcp-exclude")
    assert "lo" in f.message.split("exclude ", 1)[1]


def test_exclude_from_mca_param_file_counts():
    snap = {
        "env": {},
        "versions": OMPI,
        "mca_params": {"btl_tcp_if_exclude": "lo,docker0"},
        "interfaces": [LO, itf("eth0"), itf("docker0")],
    }
    assert "mpi-tcp-exclude" not in codes(snap)


def test_include_of_a_bridge_is_flagged():
    snap = {
        "env": {"OMPI_MCA_btl_tcp_if_include": "docker0"},
        "versions": OMPI,
        "interfaces": [LO, itf("eth0"), itf("docker0")],
    }
    assert only(snap, "mpi-tcp-exclude")


@pytest.mark.parametrize(
    "snap",
    [
        {
            "env": {},
            "versions": OMPI,
            "interfaces": [LO, itf("eth0")],
        },  # default excludes 127.0.0.1/8
        {
            "env": {"OMPI_MCA_btl_tcp_if_exclude": "lo,docker0"},
            "versions": OMPI,
            "interfaces": [LO, itf("eth0"), itf("docker0")],
        },
        {
            "env": {"OMPI_MCA_btl_tcp_if_include": "eth0"},
            "versions": OMPI,
            "interfaces": [LO, itf("eth0"), itf("docker0")],
        },
        {
            "env": {},
            "versions": {"mpi": "MPICH 4.1"},
            "interfaces": [LO, itf("eth0"), itf("docker0")],
        },
    ],
)
def test_mpi_tcp_not_flagged(snap):
    assert "mpi-tcp-exclude" not in codes(snap)


# -- NCCL socket threads x sockets per thread ------------------------------------------------------
def test_socket_product_above_64_is_flagged_with_the_capped_value():
    snap = {"env": {"NCCL_SOCKET_NTHREADS": "8", "NCCL_NSOCKS_PERTHREAD": "16"}}
    (f,) = only(snap, "nccl-socket-limit")
    assert "128" in f.message and f.fix == "export NCCL_NSOCKS_PERTHREAD=8"


def test_socket_threads_above_16_is_flagged():
    snap = {"env": {"NCCL_SOCKET_NTHREADS": "32"}}
    (f,) = only(snap, "nccl-socket-limit")
    assert f.fix == "export NCCL_SOCKET_NTHREADS=16"


def test_socket_value_not_an_integer_is_an_error():
    (f,) = only({"env": {"NCCL_NSOCKS_PERTHREAD": "four"}}, "nccl-socket-limit")
    assert f.severity == "error"


@pytest.mark.parametrize(
    "env",
    [
        {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"},
        {"NCCL_SOCKET_NTHREADS": "16", "NCCL_NSOCKS_PERTHREAD": "4"},  # exactly 64
        {"NCCL_NSOCKS_PERTHREAD": "32"},
        {},
    ],
)
def test_socket_limit_not_flagged(env):
    assert "nccl-socket-limit" not in codes({"env": env})


# -- EFA -------------------------------------------------------------------------------------------
EFA = [{"name": "rdmap16s27", "driver": "efa", "kind": "efa"}]
OFI = ["/opt/amazon/ofi-nccl/lib/libnccl-net.so"]


def test_efa_without_provider_and_plugin():
    snap = {"env": {}, "rdma_devices": EFA, "nccl_net_plugins": []}
    assert set(codes(snap)) == {"efa-provider", "efa-ofi-plugin"}


def test_efa_with_tcp_provider_is_an_error():
    snap = {"env": {"FI_PROVIDER": "tcp"}, "rdma_devices": EFA, "nccl_net_plugins": OFI}
    (f,) = only(snap, "efa-provider")
    assert f.severity == "error" and f.fix == "export FI_PROVIDER=efa"
    assert "efa-ofi-plugin" not in codes(snap)


@pytest.mark.parametrize(
    "snap",
    [
        {"env": {"FI_PROVIDER": "efa"}, "rdma_devices": EFA, "nccl_net_plugins": OFI},
        {"env": {"FI_PROVIDER": "efa", "NCCL_NET_PLUGIN": "ofi"}, "rdma_devices": EFA},
        {"env": {}, "rdma_devices": [{"name": "mlx5_0", "kind": "infiniband"}]},  # not EFA
    ],
)
def test_efa_not_flagged(snap):
    assert not {"efa-provider", "efa-ofi-plugin"} & set(codes(snap))


# -- InfiniBand in a VM ------------------------------------------------------------------------------
IB = [{"name": "mlx5_ib0", "driver": "mlx5_core", "kind": "infiniband"}]


def test_ib_vm_relaxed_ordering_off():
    snap = {
        "env": {"NCCL_IB_PCI_RELAXED_ORDERING": "0", "NCCL_TOPO_FILE": "/t.xml"},
        "rdma_devices": IB,
        "virtualized": True,
        "versions": {"nccl": "2.18.3"},
    }
    (f,) = only(snap, "ib-relaxed-ordering")
    assert f.fix == "export NCCL_IB_PCI_RELAXED_ORDERING=1" and "ib-topo-file" not in codes(snap)


def test_ib_vm_nccl_too_old_for_relaxed_ordering():
    snap = {
        "env": {"NCCL_TOPO_FILE": "/t.xml"},
        "rdma_devices": IB,
        "virtualized": True,
        "versions": {"nccl": "2.10.3"},
    }
    (f,) = only(snap, "ib-relaxed-ordering")
    assert "2.12" in f.message and "2.10.3" in f.message


def test_ib_vm_without_topology_file():
    snap = {"env": {}, "rdma_devices": IB, "virtualized": True, "versions": {"nccl": "2.21.5"}}
    assert codes(snap) == ["ib-topo-file"]


@pytest.mark.parametrize(
    "snap",
    [
        {
            "env": {},
            "rdma_devices": IB,
            "virtualized": False,
            "versions": {"nccl": "2.10.3"},
        },  # bare metal
        {
            "env": {"NCCL_TOPO_FILE": "/t.xml"},
            "rdma_devices": IB,
            "virtualized": True,
            "versions": {"nccl": "2.21.5"},
        },  # default: auto
        {
            "env": {"NCCL_IB_PCI_RELAXED_ORDERING": "1", "NCCL_TOPO_FILE": "/t.xml"},
            "rdma_devices": IB,
            "virtualized": True,
            "versions": {"nccl": "2.21.5"},
        },
        {"env": {}, "rdma_devices": [], "virtualized": True},
    ],
)
def test_ib_vm_not_flagged(snap):
    assert not {"ib-relaxed-ordering", "ib-topo-file"} & set(codes(snap))


# -- NCCL variables the installed NCCL does not read ------------------------------------------------
def test_variable_newer_than_installed_nccl():
    snap = {"env": {"NCCL_IB_PCI_RELAXED_ORDERING": "1"}, "versions": {"nccl": "2.11.4"}}
    (f,) = only(snap, "nccl-unknown-variable")
    assert "added in 2.12.0" in f.message


def test_variable_removed_from_installed_nccl():
    snap = {"env": {"NCCL_TREE_THRESHOLD": "0"}, "versions": {"nccl": "2.21.5"}}
    (f,) = only(snap, "nccl-unknown-variable")
    assert f.fix == "unset NCCL_TREE_THRESHOLD"


def test_misspelt_variable_gets_a_suggestion():
    (f,) = only({"env": {"NCCL_NSOCKS_PER_THREAD": "4"}}, "nccl-unknown-variable")
    assert f.severity == "warning" and "NCCL_NSOCKS_PERTHREAD" in f.message


def test_unrecognised_variable_is_only_information():
    (f,) = only({"env": {"NCCL_SOMETHING_ELSE": "1"}}, "nccl-unknown-variable")
    assert f.severity == "info"


@pytest.mark.parametrize(
    "env,version",
    [
        ({"NCCL_TREE_THRESHOLD": "0"}, "2.4.8"),  # still read before 2.5
        ({"NCCL_IB_PCI_RELAXED_ORDERING": "1"}, "2.12.12"),
        ({"NCCL_IB_PCI_RELAXED_ORDERING": "1"}, None),  # version unknown: no claim
        ({"NCCL_ASYNC_ERROR_HANDLING": "1"}, "2.21.5"),  # read by PyTorch, not NCCL
        ({"NCCL_FASTSOCKET_NUM_FLOWS": "8"}, "2.21.5"),  # read by a plugin
        ({"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "lo"}, "2.21.5"),
    ],
)
def test_nccl_variable_not_flagged(env, version):
    snap = {"env": env, "versions": {"nccl": version}, "interfaces": [LO]}
    assert "nccl-unknown-variable" not in codes(snap)


def test_nccl_version_code_decoding():
    assert nccl_vars.decode_nccl_version_code(22105) == (2, 21, 5)
    assert nccl_vars.decode_nccl_version_code(2708) == (2, 7, 8)
    assert nccl_vars.parse_version("2.12") == (2, 12, 0)
    with pytest.raises(ValueError, match="not a version"):
        nccl_vars.parse_version("two")


def test_clean_machine_has_no_findings_and_findings_sort_by_severity():
    assert diagnose({"env": {}, "interfaces": [LO, itf("eth0")], "versions": OMPI}) == []
    snap = {
        "env": {"FI_PROVIDER": "tcp", "NCCL_FOO": "1"},
        "rdma_devices": EFA,
        "nccl_net_plugins": OFI,
    }
    assert [f.severity for f in diagnose(snap)] == ["error", "info"]


# -- probes on a fake /sys, and the launcher ----------------------------------------------------------
def _fake_sys(root):
    net = root / "sys/class/net"
    for name, state, speed, typ in [("lo", "unknown", None, "772"), ("eth0", "up", "25000", "1")]:
        d = net / name
        d.mkdir(parents=True)
        (d / "operstate").write_text(state + "\n")
        (d / "type").write_text(typ + "\n")
        (d / "mtu").write_text("9001\n")
        if speed:
            (d / "speed").write_text(speed + "\n")
    drivers = root / "drivers"
    for drv in ("efa", "mlx5_core"):
        (drivers / drv).mkdir(parents=True)
    for dev, drv, layer in [
        ("rdmap16s27", "efa", "unspecified"),
        ("mlx5_0", "mlx5_core", "InfiniBand"),
        ("mlx5_1", "mlx5_core", "Ethernet"),
    ]:
        d = root / "sys/class/infiniband" / dev
        (d / "ports/1").mkdir(parents=True)
        (d / "ports/1/link_layer").write_text(layer + "\n")
        (d / "device").mkdir()
        os.symlink(drivers / drv, d / "device/driver")
    (root / "proc").mkdir()
    (root / "proc/cpuinfo").write_text("processor : 0\nflags : fpu sse2 hypervisor avx\n")
    dmi = root / "sys/class/dmi/id"
    dmi.mkdir(parents=True)
    (dmi / "sys_vendor").write_text("Amazon EC2\n")


def test_probes_read_a_fake_sysfs(tmp_path):
    _fake_sys(tmp_path)
    its = {i["name"]: i for i in probe.interfaces(str(tmp_path))}
    assert its["eth0"]["speed_mbps"] == 25000 and its["eth0"]["mtu"] == 9001
    assert its["lo"]["loopback"] and not its["eth0"]["loopback"]
    kinds = {d["name"]: d["kind"] for d in probe.rdma_devices(str(tmp_path))}
    assert kinds == {"rdmap16s27": "efa", "mlx5_0": "infiniband", "mlx5_1": "roce"}
    assert probe.virtualized(str(tmp_path)) is True
    assert probe.cloud(str(tmp_path)) == "aws"


def test_plugin_search_follows_ld_library_path(tmp_path):
    (tmp_path / "libnccl-net-ofi.so").write_text("")
    assert str(tmp_path / "libnccl-net-ofi.so") in probe.nccl_net_plugins(str(tmp_path))


@pytest.mark.parametrize(
    "env,expected",
    [
        ({"OMPI_COMM_WORLD_SIZE": "2"}, "mpirun (Open MPI)"),
        ({"HOROVOD_RANK": "0"}, "horovodrun"),
        ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0"}, "torchrun"),
        ({"SLURM_PROCID": "0"}, "srun (Slurm)"),
        ({}, None),
    ],
)
def test_launcher_detection(env, expected):
    assert probe.launcher(env) == expected


# -- profiles -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(PROFILES))
def test_every_profile_line_has_a_reason_and_a_source(name):
    snap = {"interfaces": [LO, itf("ens5", speed=100000)], "versions": {"nccl": "2.21.5"}}
    variables = profile_env(name, snap)
    assert variables and all(v.reason and v.source for v in variables)
    text = render(name, variables)
    exports = [line for line in text.splitlines() if line.startswith("export ")]
    assert exports and all("  # " in line for line in exports)
    # What a profile exports must not trip the doctor on the same machine.
    env = {v.name: v.value for v in variables if v.value and "$" not in v.value}
    assert not [f for f in diagnose({**snap, "env": env}) if f.severity != "info"]


def test_profiles_follow_the_published_values():
    aws = {v.name: v.value for v in profile_env("aws-tcp")}
    assert (aws["NCCL_SOCKET_NTHREADS"], aws["NCCL_NSOCKS_PERTHREAD"]) == ("4", "4")
    assert aws["OMPI_MCA_btl_tcp_if_exclude"] == "lo,docker0"
    efa_new = {v.name: v.value for v in profile_env("aws-efa", {"versions": {"nccl": "2.21.5"}})}
    efa_old = {v.name: v.value for v in profile_env("aws-efa", {"versions": {"nccl": "2.4.8"}})}
    assert efa_new["FI_PROVIDER"] == "efa" and efa_new["FI_EFA_TX_MIN_CREDITS"] == "64"
    assert efa_new["NCCL_TREE_THRESHOLD"] is None and efa_old["NCCL_TREE_THRESHOLD"] == "0"
    assert {v.name: v.value for v in profile_env("azure-ib")}["NCCL_IB_PCI_RELAXED_ORDERING"] == "1"
    with pytest.raises(ValueError, match="choose one of"):
        profile_env("aws")


def test_profile_output_is_valid_shell(tmp_path):
    import subprocess

    text = render("aws-tcp", profile_env("aws-tcp", {"interfaces": [itf("ens5")]}))
    out = subprocess.run(
        ["bash", "-c", text + "\necho $NCCL_SOCKET_IFNAME $NCCL_NSOCKS_PERTHREAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.split() == ["ens5", "4"]


# -- the command ------------------------------------------------------------------------------------
def test_doctor_command_report_json_and_profile(capsys, monkeypatch):
    from commopt.cli import main

    monkeypatch.setenv("NCCL_SOCKET_NTHREADS", "16")
    monkeypatch.setenv("NCCL_NSOCKS_PERTHREAD", "8")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "Versions" in out and "torch" in out and "[warning] nccl-socket-limit" in out
    assert main(["doctor", "--strict"]) == 1
    capsys.readouterr()
    assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["snapshot"]["env"]["NCCL_SOCKET_NTHREADS"] == "16"
    assert "nccl-socket-limit" in [f["code"] for f in data["findings"]]
    assert main(["doctor", "--profile", "tcp"]) == 0
    assert "export NCCL_SOCKET_IFNAME=" in capsys.readouterr().out
