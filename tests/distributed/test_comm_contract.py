"""The communicator contract, run by every transport on real processes (2 and 4 ranks)."""

from pathlib import Path

import pytest

from tests.multirank import run_mpi, run_torch

RANK_SCRIPT = (Path(__file__).with_name("comm_contract_rank.py")).read_text()

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("nprocs", [2, 4])
def test_mpi_contract(nprocs):
    out = run_mpi(RANK_SCRIPT, nprocs, args=["mpi"], timeout=180)
    assert [o.strip() for o in out] == [f"contract ok mpi rank {r}/{nprocs}" for r in range(nprocs)]


@pytest.mark.parametrize("nprocs", [2, 4])
def test_torch_gloo_contract(nprocs):
    out = run_torch(RANK_SCRIPT, nprocs, args=["torch"], timeout=180)
    assert [o.strip() for o in out] == [
        f"contract ok torch rank {r}/{nprocs}" for r in range(nprocs)
    ]


def test_local_contract():
    out = run_torch(RANK_SCRIPT, 1, args=["local"], timeout=60)
    assert out[0].strip() == "contract ok local rank 0/1"


def test_torch_communicator_under_mpirun_shares_master_address():
    """mpirun without MASTER_ADDR: rank 0's address and port travel over MPI."""
    out = run_mpi(RANK_SCRIPT, 2, args=["torch"], timeout=180)
    assert [o.strip() for o in out] == [f"contract ok torch rank {r}/2" for r in range(2)]
