"""The mpi communicator's pipelined transfers (segmented ring allreduce, pairwise alltoall,
direct allgather) on real ranks: exact and bit-identical results, the full contract suite run
through them, and a clear error when ranks disagree on the settings."""

from pathlib import Path

import pytest

from tests.multirank import run_mpi

pytestmark = pytest.mark.distributed

HERE = Path(__file__).parent
PIPELINE_RANK = (HERE / "mpi_pipeline_rank.py").read_text()
CONTRACT_RANK = (HERE / "comm_contract_rank.py").read_text()
# Every buffer pipelined, in segments of 24 bytes: the contract's sizes become many segments.
FORCED = {
    "COMMOPT_MPI_PIPELINE": "on",
    "COMMOPT_MPI_SEGMENT_BYTES": "24",
    "COMMOPT_MPI_PIPELINE_MIN_BYTES": "1",
}


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_pipelined_transfers_every_dtype_and_odd_size(nprocs):
    pytest.importorskip("mpi4py")
    out = run_mpi(PIPELINE_RANK, nprocs, timeout=240)
    assert [o.strip() for o in out] == [f"pipeline ok rank {r}/{nprocs}" for r in range(nprocs)]


@pytest.mark.parametrize("nprocs", [2, 4])
def test_contract_suite_through_the_pipelined_path(nprocs):
    pytest.importorskip("mpi4py")
    out = run_mpi(CONTRACT_RANK, nprocs, args=["mpi"], env=FORCED, timeout=240)
    assert [o.strip() for o in out] == [f"contract ok mpi rank {r}/{nprocs}" for r in range(nprocs)]


def test_ranks_that_disagree_on_the_settings_get_an_error_not_a_hang():
    pytest.importorskip("mpi4py")
    code = """
        import os
        rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
        os.environ["COMMOPT_MPI_PIPELINE"] = "on" if rank == 0 else "off"
        from commopt.comm.mpi import MPICommunicator
        try:
            MPICommunicator()
        except ValueError as exc:
            assert "disagree on the MPI pipeline settings" in str(exc), exc
            print("refused")
    """
    out = run_mpi(code, 2, timeout=120)
    assert [o.strip() for o in out] == ["refused", "refused"]
