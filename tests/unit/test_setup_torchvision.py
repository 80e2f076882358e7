"""scripts/setup_torchvision.sh keeps torchvision only where it imports.

Runs the real script against a real (throw-away) virtualenv holding a stand-in torchvision
distribution: one that raises the error a CUDA wheel raises next to a CPU torch, and one that
imports. No download is made (TORCHVISION_PIN is empty: check only).
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.multirank import REPO

SCRIPT = REPO / "scripts" / "setup_torchvision.sh"
NMS_ERROR = "RuntimeError: operator torchvision::nms does not exist"


@pytest.fixture(scope="module")
def env_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tvvenv") / "venv"
    venv.EnvBuilder(with_pip=True).create(root)  # pip from the interpreter's bundled wheel
    return root


def _install_standin(root: Path, broken: bool) -> Path:
    site = next((root / "lib").glob("python3*/site-packages"))
    pkg = site / "torchvision"
    pkg.mkdir(exist_ok=True)
    body = f"raise RuntimeError({NMS_ERROR.split(': ', 1)[1]!r})\n" if broken else ""
    (pkg / "__init__.py").write_text(body)
    (pkg / "models.py").write_text("")
    (pkg / "datasets.py").write_text("")
    info = site / "torchvision-0.28.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n")
    (info / "INSTALLER").write_text("pip\n")
    files = [
        "torchvision/__init__.py",
        "torchvision/models.py",
        "torchvision/datasets.py",
        *(f"torchvision-0.28.0.dist-info/{n}" for n in ("METADATA", "INSTALLER", "RECORD")),
    ]
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
    return pkg


def _run(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "TORCHVISION_PIN": ""},
    )


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="the set-up scripts target Linux")
def test_a_torchvision_that_cannot_import_is_removed_with_the_fix_printed(env_dir):
    pkg = _install_standin(env_dir, broken=True)
    done = _run(env_dir)
    assert done.returncode == 0, done.stderr
    assert not pkg.exists(), f"the broken torchvision is still installed:\n{done.stderr}"
    err = " ".join(done.stderr.split())
    assert "removed torchvision 0.28.0" in err and "torchvision::nms does not exist" in err, err
    assert "--index-url https://download.pytorch.org/whl/cpu" in err, err


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="the set-up scripts target Linux")
def test_a_torchvision_that_imports_is_kept(env_dir):
    pkg = _install_standin(env_dir, broken=False)
    done = _run(env_dir)
    assert done.returncode == 0, done.stderr
    assert (pkg / "__init__.py").exists(), done.stderr
    assert "removed" not in done.stderr, done.stderr
