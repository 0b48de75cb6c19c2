"""Triton kernels: for Newton-Schulz, X X^T and b*A + c*A@A computing only lower tiles (they exploit symmetry); for
the AdamW part, one launch over many tensors with a skip flag per tensor (moments stored as they are, or rounded);
for the Muon update, one launch writing many matrices.

Triton is optional: without it `TRITON_AVAILABLE` is False and the launchers raise a RuntimeError when called.
"""

try:
    import triton  # noqa: F401
except ImportError:
    TRITON_AVAILABLE = False
else:
    TRITON_AVAILABLE = True

if TRITON_AVAILABLE:
    from .adamw import (adamw_flagged_, launch_adamw_, launch_counts_, launch_nonfinite_, launchable,
                        launchable_rounded, tabulate, tabulate_rounded)
    from .apply_update import apply_takes, launch_apply_
    from .symmetric_poly import ba_plus_caa
    from .xxt import xxt
else:
    from ._without_triton import (adamw_flagged_, apply_takes, ba_plus_caa, launch_adamw_, launch_apply_,
                                  launch_counts_, launch_nonfinite_, launchable, launchable_rounded, tabulate,
                                  tabulate_rounded, xxt)

__all__ = ["TRITON_AVAILABLE", "adamw_flagged_", "apply_takes", "ba_plus_caa", "launch_adamw_", "launch_apply_",
           "launch_counts_", "launch_nonfinite_", "launchable", "launchable_rounded", "tabulate", "tabulate_rounded",
           "xxt"]
