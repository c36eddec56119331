"""Short labels for the library's kernels, from the names profilers report.

CUPTI (the PyTorch profiler) gives some names demangled and others mangled;
Nsight Compute gives template arguments as numbers. No torch needed.
"""

from __future__ import annotations

import re

# The pipeline's kernels by their template-free names; the GEMMs by epilogue
# (GemmEpilogue 0 and 3 are GEMM1's, 2 is GEMM2's).
_GEMM_EPI = re.compile(r"moe_gemm(?:_portable)?_kernel<.*?\(expertd::GemmEpilogue\)(\d)")


def kernel_label(name: str) -> str:
    """A short label for a kernel name; "gemm?" for a hand GEMM whose name
    does not say its epilogue (call_labels resolves those by order)."""
    m = _GEMM_EPI.search(name)
    if m:
        return "gemm2" if m.group(1) == "2" else "gemm1"
    if "moe_gemm" in name:
        return "gemm?"
    if "cutlass::device_kernel" in name or "cutlass13device_kernel" in name:
        # GEMM1's epilogue (cutlass_grouped.cuh) names its functor.
        return "gemm1 (cutlass)" if "Relu2Scale" in name else "gemm2 (cutlass)"
    for anon in ("(anonymous namespace)::", "<unnamed>::", "unnamed>::"):
        name = name.replace(anon, "")
    base = name.split("(")[0].split("<")[0]
    return base.replace("void ", "").split("::")[-1]


def call_labels(names: list[str]) -> list[str]:
    """Labels of one call's kernels in launch order: a GEMM the name leaves
    open is GEMM1 when no GEMM1 came before it in the call, else GEMM2."""
    labels, gemm1 = [], False
    for n in names:
        lab = kernel_label(n)
        if lab == "gemm?":
            lab = "gemm2" if gemm1 else "gemm1"
        gemm1 = gemm1 or lab.startswith("gemm1")
        labels.append(lab)
    return labels
