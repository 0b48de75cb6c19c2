"""Triton kernels for Newton-Schulz that exploit symmetry: X X^T and b*A + c*A@A compute only lower tiles.

Triton is optional: without it `TRITON_AVAILABLE` is False and the launchers raise a RuntimeError when called.
"""

try:
    import triton  # noqa: F401
except ImportError:
    TRITON_AVAILABLE = False
else:
    TRITON_AVAILABLE = True

if TRITON_AVAILABLE:
    from .symmetric_poly import ba_plus_caa
    from .xxt import xxt
else:
    from ._without_triton import ba_plus_caa, xxt

__all__ = ["TRITON_AVAILABLE", "ba_plus_caa", "xxt"]
