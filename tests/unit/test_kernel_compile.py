"""The Triton kernels compile to real sm_90 (H100/H200) cubins, no GPU needed.

The interpreter tests check the kernels' numbers; this checks what the interpreter cannot:
that the native compiler accepts them (types of loop-carried values, constexpr branches,
pointer arithmetic) for bf16 and fp32 logits. Triton's bundled ptxas does the lowering, in a
subprocess without TRITON_INTERPRET (the conftest sets it for this process).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megagrpo.kernels import triton_loss as m

assert type(m._stats_fwd_kernel).__name__ == "JITFunction"
target = GPUTarget("cuda", 90, 32)
for dt in ("bf16", "fp32"):
    sig = {"logits_ptr": f"*{dt}", "stride_row": "i64", "target_ptr": "*i64",
           "vocab_start": "i32", "V": "i32", "stats_ptr": "*fp32", "terms_ptr": "*fp32",
           "old_ptr": "*fp32", "adv_ptr": "*fp32", "ref_ptr": "*fp32", "eps_low": "fp32",
           "eps_high": "fp32", "BLOCK_V": "constexpr", "FUSE": "constexpr",
           "HAS_REF": "constexpr"}
    for fuse, has_ref in ((True, True), (False, False)):
        src = ASTSource(fn=m._stats_fwd_kernel, signature=sig,
                        constexprs={"BLOCK_V": 4096, "FUSE": fuse, "HAS_REF": has_ref})
        k = triton.compile(src, target=target, options={"num_warps": 8})
        assert len(k.asm["cubin"]) > 1000
    sig = {"logits_ptr": f"*{dt}", "stride_row": "i64", "grad_ptr": f"*{dt}",
           "grad_stride": "i64", "target_ptr": "*i64", "vocab_start": "i32", "V": "i32",
           "lse_ptr": "*fp32", "ex_ptr": "*fp32", "g_ptr": "*fp32", "h_ptr": "*fp32",
           "BLOCK_V": "constexpr", "HAS_H": "constexpr"}
    for has_h in (True, False):
        src = ASTSource(fn=m._logits_grad_kernel, signature=sig,
                        constexprs={"BLOCK_V": 4096, "HAS_H": has_h})
        k = triton.compile(src, target=target, options={"num_warps": 8})
        assert ".target sm_90" in k.asm["ptx"]
print("compiled")
"""


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("Triton's bundled ptxas is not available")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiled" in proc.stdout
