"""The framework integrations are optional: importing commopt's modules needs neither
framework, and using one that is missing raises an ImportError naming the pip command."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.multirank import REPO

MISSING = r"""
import sys
sys.modules["lightning"] = sys.modules["lightning.pytorch"] = None  # as if not installed
sys.modules["lightning.pytorch.strategies"] = None
sys.modules["accelerate"] = sys.modules["accelerate.optimizer"] = None
import commopt.integrations.lightning as lit
import commopt.integrations.accelerate as acc
try:
    lit.CommoptStrategy
except ImportError as e:
    assert "pip install 'lightning==2.6.6'" in str(e), e
else:
    raise AssertionError("CommoptStrategy without Lightning")
try:
    acc.prepare_optimizer(None, None, None)
except ImportError as e:
    assert "pip install 'accelerate==1.15.0'" in str(e), e
else:
    raise AssertionError("prepare_optimizer without Accelerate")
print("ok")
"""

#: Run first, in a fresh interpreter: importing the integrations imports no framework.
NOT_IMPORTED = r"""
import sys
import commopt.integrations.lightning, commopt.integrations.accelerate
loaded = sorted(m for m in ("lightning", "accelerate") if m in sys.modules)
assert loaded == [], f"importing commopt's integrations imported {loaded}"
"""


def test_frameworks_are_imported_on_use_and_a_missing_one_names_pip():
    out = subprocess.run(
        [sys.executable, "-c", NOT_IMPORTED + MISSING],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout == "ok\n", out.stderr[-2000:]


def test_unknown_attribute_is_an_attribute_error():
    import commopt.integrations.lightning as lit

    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        lit.Nothing  # noqa: B018
