"""Collection rules for the whole tree (pytest's root conftest).

``--doctest-modules`` imports every module under the test paths to find its examples. Under
tests/ only the test modules (and conftests) may be imported that way: the other files there are
helpers and rank scripts that mpirun starts, and a rank script runs its rank at import.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent / "tests"


def pytest_ignore_collect(collection_path: Path, config: object) -> bool | None:
    if collection_path.suffix != ".py" or _TESTS not in collection_path.parents:
        return None  # pytest decides
    name = collection_path.name
    if name.startswith("test_") or name in ("conftest.py", "__init__.py"):
        return None
    return True


# Any library that started MPI here (Horovod, a C extension) left its variables in the C
# environment, which os.environ does not see but every child inherits.
_c_getenv = ctypes.CDLL(None).getenv
_c_getenv.restype = ctypes.c_char_p


def _mpi_initialised_here() -> bool:
    mpi = sys.modules.get("mpi4py.MPI")  # never imported here: importing it would init MPI
    if mpi is not None and mpi.Is_initialized():
        return True
    return any(_c_getenv(name) for name in (b"OMPI_MCA_ess", b"PMIX_NAMESPACE", b"PMIX_RANK"))


@pytest.fixture(autouse=True)
def _mpi_stays_out_of_the_pytest_process(request):
    """Fail the test that initialises MPI in pytest's own process.

    Open MPI's singleton init writes PMIX_* and OMPI_MCA_* variables into the C environment
    of the process; every later subprocess inherits them, and mpirun started with them exits
    1 without a word. MPI belongs in the ranks' processes (tests/multirank.py).
    """
    before = _mpi_initialised_here()
    yield
    if not before and _mpi_initialised_here():
        pytest.fail(
            f"{request.node.nodeid} initialised MPI in the pytest process (a singleton whose "
            f"PMIX_/OMPI_ variables break every later mpirun): run it in a rank's process"
        )


_MPI_BEFORE_COLLECTION = _mpi_initialised_here()
_first_module_that_started_mpi: list[str] = []


def pytest_collectreport(report) -> None:
    # --doctest-modules imports every module: one that imports mpi4py at its top starts MPI.
    if not (_MPI_BEFORE_COLLECTION or _first_module_that_started_mpi) and _mpi_initialised_here():
        _first_module_that_started_mpi.append(report.nodeid)


def pytest_collection_finish(session) -> None:
    if _first_module_that_started_mpi:
        raise pytest.UsageError(
            f"importing {_first_module_that_started_mpi[0]} to collect it initialised MPI in "
            f"pytest's process (its PMIX_/OMPI_ variables break every later mpirun): import "
            f"mpi4py inside the function that needs it"
        )
