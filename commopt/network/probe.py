"""Collect a snapshot of this machine for `commopt doctor`: versions, interfaces, devices.

The snapshot is a plain, JSON-serialisable dict, so the checks in ``doctor.py`` are pure
functions of it and tests can craft any machine:

    >>> from commopt.network.probe import collect_snapshot
    >>> snap = collect_snapshot()
    >>> sorted(snap)  # doctest: +NORMALIZE_WHITESPACE
    ['cloud', 'env', 'interfaces', 'launcher', 'mca_params', 'nccl_net_plugins',
     'rdma_devices', 'versions', 'virtualized']

Every probe is cheap (sysfs reads, ``mpirun --version`` with a timeout) and never fails:
what cannot be read is None or empty.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import shutil
import subprocess
from pathlib import Path

from commopt.network.nccl_vars import decode_nccl_version_code, format_version

# Environment variables shown by the doctor and read by its checks.
ENV_PREFIXES = (
    "NCCL_",
    "TORCH_NCCL_",
    "FI_",
    "OMPI_MCA_",
    "UCX_",
    "GLOO_",
    "HOROVOD_",
    "COMMOPT_",
    "RDMAV_",
    "MASTER_",
    "OMPI_COMM_WORLD_",
    "PMI_",
    "PMIX_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "TORCHELASTIC_",
)
ENV_NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "CUDA_VISIBLE_DEVICES",
    "LD_LIBRARY_PATH",
    "OMP_NUM_THREADS",
)

# Where network plugins for NCCL are usually installed (besides LD_LIBRARY_PATH).
PLUGIN_DIRS = (
    "/opt/amazon/ofi-nccl/lib",
    "/opt/amazon/ofi-nccl/lib64",
    "/opt/aws-ofi-nccl/lib",
    "/opt/amazon/efa/lib",
    "/opt/amazon/efa/lib64",
    "/usr/local/lib",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib64",
    "/usr/local/nccl-fastsocket/lib",
    "/usr/local/fastsocket/lib",
    "/usr/local/nvidia/lib64",
)

# Open MPI's system and user MCA parameter files (the environment overrides both).
MCA_FILES = (
    "/etc/openmpi/openmpi-mca-params.conf",
    "/usr/etc/openmpi-mca-params.conf",
    "~/.openmpi/mca-params.conf",
)


def collect_snapshot(sys_root: str = "/") -> dict:
    """Everything the doctor looks at, for this process on this machine."""
    env = relevant_env(os.environ)
    return {
        "env": env,
        "versions": versions(),
        "interfaces": interfaces(sys_root),
        "rdma_devices": rdma_devices(sys_root),
        "nccl_net_plugins": nccl_net_plugins(env.get("LD_LIBRARY_PATH", "")),
        "mca_params": mca_params(),
        "launcher": launcher(os.environ),
        "virtualized": virtualized(sys_root),
        "cloud": cloud(sys_root),
    }


def relevant_env(environ) -> dict[str, str]:
    return {
        k: v for k, v in sorted(environ.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES
    }


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def interfaces(sys_root: str = "/") -> list[dict]:
    """Network interfaces from /sys/class/net: name, state, speed (Mbit/s), mtu, driver."""
    out = []
    base = Path(sys_root, "sys/class/net")
    for d in sorted(base.glob("*")):
        speed = _read(d / "speed")
        driver = d / "device" / "driver"
        out.append(
            {
                "name": d.name,
                "state": _read(d / "operstate") or "unknown",
                # speed is -1 (or unreadable) for virtual and virtio links
                "speed_mbps": int(speed)
                if speed and speed.lstrip("-").isdigit() and int(speed) > 0
                else None,
                "mtu": int(_read(d / "mtu") or 0) or None,
                "driver": os.path.basename(os.readlink(driver)) if driver.is_symlink() else None,
                "loopback": _read(d / "type") == "772",  # ARPHRD_LOOPBACK
                "address": _ipv4_of(d.name),
            }
        )
    return out


def _ipv4_of(name: str) -> str | None:
    """The interface's IPv4 address, if any (SIOCGIFADDR); None where it cannot be read."""
    try:
        import fcntl
        import socket
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None


def rdma_devices(sys_root: str = "/") -> list[dict]:
    """RDMA devices from /sys/class/infiniband, each classified as efa, infiniband or roce."""
    out = []
    for d in sorted(Path(sys_root, "sys/class/infiniband").glob("*")):
        driver_link = d / "device" / "driver"
        driver = os.path.basename(os.readlink(driver_link)) if driver_link.is_symlink() else None
        layers = {(_read(p) or "").lower() for p in d.glob("ports/*/link_layer")}
        if driver == "efa" or d.name.startswith("efa"):
            kind = "efa"
        elif "ethernet" in layers:
            kind = "roce"
        else:
            kind = "infiniband"
        out.append({"name": d.name, "driver": driver, "kind": kind})
    return out


def nccl_net_plugins(ld_library_path: str) -> list[str]:
    """Paths of NCCL network plugins (libnccl-net*.so) NCCL could load here."""
    dirs = [p for p in ld_library_path.split(":") if p] + list(PLUGIN_DIRS)
    found: list[str] = []
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "libnccl-net*.so*"))):
            real = os.path.realpath(path)
            if path not in found and real not in found:
                found.append(path)
    return found


def mca_params() -> dict[str, str]:
    """Open MPI MCA parameters from its parameter files (system, then user)."""
    params: dict[str, str] = {}
    for f in MCA_FILES:
        text = _read(Path(os.path.expanduser(f)))
        for line in (text or "").splitlines():
            line = line.split("#", 1)[0].strip()
            if "=" in line:
                key, value = line.split("=", 1)
                params[key.strip()] = value.strip()
    return params


def launcher(environ) -> str | None:
    """The launcher this process was started by, from the variables each one sets."""
    if "OMPI_COMM_WORLD_SIZE" in environ:
        return "mpirun (Open MPI)"
    if "HOROVOD_RANK" in environ:
        return "horovodrun"
    if "PMI_RANK" in environ or "PMI_SIZE" in environ:
        return "mpiexec (MPICH/Hydra)"
    if "TORCHELASTIC_RUN_ID" in environ:
        return "torchrun"
    if "SLURM_PROCID" in environ:
        return "srun (Slurm)"
    if {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= set(environ):
        return "torch.distributed environment (RANK/WORLD_SIZE/MASTER_ADDR)"
    return None


def virtualized(sys_root: str = "/") -> bool | None:
    """True in a virtual machine (the CPU's hypervisor flag); None if it cannot be read."""
    text = _read(Path(sys_root, "proc/cpuinfo"))
    if text is None:
        return None
    return bool(re.search(r"^flags\s*:.*\bhypervisor\b", text, re.M))


def cloud(sys_root: str = "/") -> str | None:
    """aws, gcp or azure from the DMI vendor strings; None elsewhere or unreadable."""
    dmi = Path(sys_root, "sys/class/dmi/id")
    text = " ".join(
        filter(
            None,
            (_read(dmi / f) for f in ("sys_vendor", "product_name", "bios_vendor", "board_vendor")),
        )
    ).lower()
    if "amazon" in text or "ec2" in text:
        return "aws"
    if "google" in text:
        return "gcp"
    if "microsoft" in text:
        return "azure"
    return None


# -- versions ------------------------------------------------------------------------------
def versions() -> dict[str, str | None]:
    torch_v, cuda_v, nccl_v = _torch_versions()
    if nccl_v is None:
        nccl_v = _cupy_nccl_version() or _libnccl_version()
    return {
        "torch": torch_v,
        "cuda (torch build)": cuda_v,
        "nccl": nccl_v,
        "nvcc": _command_version(["nvcc", "--version"], r"release ([\d.]+)"),
        "driver": _driver_version(),
        "mpi": _mpi_version(),
        "mpi4py": _module_version("mpi4py"),
        "cupy": _module_version("cupy"),
        "horovod": _module_version("horovod"),
    }


def _torch_versions() -> tuple[str | None, str | None, str | None]:
    try:
        import torch
    except ImportError:
        return None, None, None
    nccl = None
    if torch.version.cuda is not None:
        try:  # ncclGetVersion needs no GPU, only a CUDA build of torch
            v = torch.cuda.nccl.version()
            nccl = format_version(
                tuple(v) if isinstance(v, tuple) else decode_nccl_version_code(int(v))
            )
        except Exception:
            nccl = None
    return torch.__version__, torch.version.cuda, nccl


def _cupy_nccl_version() -> str | None:
    if not _module_version("cupy"):
        return None
    try:
        from cupy.cuda import nccl

        return format_version(decode_nccl_version_code(int(nccl.get_version())))
    except Exception:
        return None


def _libnccl_version() -> str | None:
    try:
        lib = ctypes.CDLL("libnccl.so.2")
        code = ctypes.c_int(0)
        if lib.ncclGetVersion(ctypes.byref(code)) != 0:
            return None
        return format_version(decode_nccl_version_code(code.value))
    except (OSError, AttributeError):
        return None


def _module_version(name: str) -> str | None:
    from importlib import metadata

    dist = {"cupy": ("cupy", "cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x")}.get(name, (name,))
    for d in dist:
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            continue
    return None


def _command_version(cmd: list[str], pattern: str) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(pattern, out)
    return m.group(1) if m else None


def _mpi_version() -> str | None:
    """'Open MPI 4.1.4' or 'MPICH 4.0' (from `mpirun --version`), else None."""
    if shutil.which("mpirun") is None:
        return None
    try:
        out = subprocess.run(
            ["mpirun", "--version"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"Open MPI\)? ([\d.]+\w*)", out)
    if m:
        return f"Open MPI {m.group(1)}"
    m = re.search(r"Version:\s*([\d.]+\w*)", out)  # MPICH's Hydra
    if m:
        return f"MPICH {m.group(1)}"
    first = out.strip().splitlines()[:1]
    return first[0] if first else None


def _driver_version() -> str | None:
    text = _read(Path("/proc/driver/nvidia/version"))
    if text:
        m = re.search(r"Kernel Module\s+([\d.]+)", text)
        if m:
            return m.group(1)
    return _command_version(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], r"([\d.]+)"
    )
