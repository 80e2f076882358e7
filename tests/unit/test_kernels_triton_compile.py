"""The Triton kernels compile for NVIDIA (sm_80, sm_90) and AMD (gfx942) without a GPU, and
the generated code keeps the reference's arithmetic: no fused multiply-add, no approximate
division, square roots rounded to nearest. This checks the compiler's output, not the
device's results (those are tests/gpu); it runs in a subprocess because this process loads
the kernels under the interpreter.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="needs triton: pip install triton==3.7.1 (commopt[triton])",
)

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from commopt.kernels import triton as tk

assert not tk.INTERPRETED
variants = [
    (tk._qsgd_encode_fused_kernel, {"x_ptr": "*fp32", "out_ptr": "*u8", "payload_ptr": "*u8", "n": "i64",
     "nb": "i64", "bucket": "i32", "levels": "i32", "k0": "i32", "k1": "i32", "scale": "fp32"},
     [dict(HAS_SCALE=True, HALF=half, STOCHASTIC=st, BITS=b, PER_BYTE=8 // b, ROWS=r, WIDTH=w, WIDE=wide)
      for half, st, b, r, w, wide in ((False, True, 4, 16, 128, False), (True, True, 2, 16, 128, False),
                                      (False, False, 8, 1, 4096, True))]),
    (tk._qsgd_steps_kernel, {"x_ptr": "*fp32", "norms_ptr": "*fp32", "out_ptr": "*u8", "steps_ptr": "*fp32",
     "n": "i64", "nb": "i64", "bucket": "i32", "nchunks": "i32", "levels": "i32", "scale": "fp32"},
     [dict(HAS_SCALE=True, L2=l2, PRE_NORMS=False, HALF=half, ROWS=r, WIDTH=w, LOG2W=w.bit_length() - 1,
           WIDE=wide) for l2, half, r, w, wide in ((True, True, 16, 128, False), (False, False, 1, 4096, True),
                                                    (True, False, 2048, 1, False))]),
    (tk._qsgd_quantize_kernel, {"x_ptr": "*fp32", "steps_ptr": "*fp32", "payload_ptr": "*u8", "n": "i64",
     "payload_bytes": "i64", "bucket": "i32", "levels": "i32", "k0": "i32", "k1": "i32", "scale": "fp32"},
     [dict(HAS_SCALE=True, STOCHASTIC=s, BITS=b, PER_BYTE=8 // b, BLOCK=1024 // (8 // b), WIDE=w)
      for s, b, w in ((True, 4, False), (False, 2, True), (True, 8, False))]),
    (tk._qsgd_decode_kernel, {"wire_ptr": "*u8", "out_ptr": "*fp32", "n": "i64", "nb": "i64", "bucket": "i32",
     "alpha": "fp32"},
     [dict(HAS_ALPHA=True, ACCUMULATE=True, HALF=h, BITS=b, PER_BYTE=8 // b, BLOCK=1024, WIDE=w)
      for h, b, w in ((True, 4, False), (False, 2, True))]),
    (tk._cast_encode_kernel, {"x_ptr": "*fp32", "out_ptr": "*bf16", "n": "i64", "scale": "fp32"},
     [dict(HAS_SCALE=True, BLOCK=1024)]),
    (tk._cast_encode_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp16", "n": "i64", "scale": "fp32"},
     [dict(HAS_SCALE=True, BLOCK=1024)]),
    (tk._cast_decode_kernel, {"wire_ptr": "*bf16", "out_ptr": "*fp32", "n": "i64", "alpha": "fp32"},
     [dict(HAS_ALPHA=True, ACCUMULATE=True, BLOCK=1024)]),
]
targets = {"sm_80": GPUTarget("cuda", 80, 32), "sm_90": GPUTarget("cuda", 90, 32),
           "gfx942": GPUTarget("hip", "gfx942", 64)}
wanted = sys.argv[1].split(",")
report = []
for name in wanted:
    for fn, sig, consts in variants:
        for c in consts:
            signature = dict(sig, **{k: "constexpr" for k in c})
            k = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=c), target=targets[name],
                               options=dict(tk.LAUNCH))
            code = k.asm.get("ptx") or k.asm.get("amdgcn")
            binary = k.asm.get("cubin") or k.asm.get("hsaco")
            report.append(dict(target=name, kernel=fn.__name__, constexprs=c, code=code, binary=len(binary)))
print(json.dumps(report))
"""


def _compile(targets: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, targets],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_kernels_compile_for_nvidia_and_amd_with_exact_arithmetic():
    report = _compile("sm_80,sm_90,gfx942")
    assert {r["target"] for r in report} == {"sm_80", "sm_90", "gfx942"}
    for r in report:
        assert r["binary"] > 0, r["kernel"]
        code = r["code"]
        where = f"{r['kernel']} {r['constexprs']} on {r['target']}"
        if r["target"].startswith("sm_"):
            assert "fma.rn.f32" not in code and "fma.rn.f64" not in code, (
                f"contracted multiply-add in {where}"
            )
            assert "div.full.f32" not in code and "div.approx" not in code, (
                f"approximate division in {where}"
            )
            assert "sqrt.approx" not in code, f"approximate square root in {where}"
            if r["constexprs"].get("WIDE") is False:
                assert "div.s64" not in code and "rem.s64" not in code, (
                    f"64-bit division in {where}"
                )
            if r["kernel"] in ("_qsgd_steps_kernel", "_qsgd_encode_fused_kernel"):
                assert "div.rn.f32" in code
                if r["constexprs"].get("L2"):
                    assert "sqrt.rn.f64" in code
        elif r["kernel"] in (
            "_qsgd_steps_kernel",
            "_qsgd_quantize_kernel",
            "_qsgd_encode_fused_kernel",
        ):
            # AMD has no division instruction: the IEEE one is a scale/fma/fixup sequence
            assert "v_div_fixup_f32" in code, f"approximate division in {where}"
        else:  # the decode and cast kernels: multiply, then add, never fused
            assert "v_fma_f32" not in code and "v_fmac_f32" not in code, (
                f"contracted multiply-add in {where}"
            )
