"""The Triton symmetric products (`xxt`, `ba_plus_caa`) as torch custom ops for torch.compile: a compiled step calls
each as one opaque op of its graph. Traced into, Triton's launcher breaks the graph on a GPU (and crashes dynamo under
the Triton interpreter); the frames resumed after each break were then compiled one by one, specialized on each
Newton-Schulz coefficient, until an H100 run hit dynamo's recompile limit on a Llama-3-8B layer's step. Eager calls
go to the launchers directly, without the custom op's dispatch."""

from __future__ import annotations

import torch
from torch import Tensor

from .triton_kernels import ba_plus_caa, xxt

# One namespace per loaded copy of the package: the kernels loader names each build variant's package after its op
# namespace, and two variants (the compiled one and the noarch fallback, say) may share a process.
_NAMESPACE = __name__.rpartition(".")[0].replace(".", "_") + "_triton"


@torch.library.custom_op(f"{_NAMESPACE}::xxt", mutates_args=())
def _traced_xxt(X: Tensor, exact_fp32: bool) -> Tensor:
    return xxt(X, exact_fp32=exact_fp32)


@_traced_xxt.register_fake
def _(X: Tensor, exact_fp32: bool) -> Tensor:
    return X.new_empty((*X.shape[:-1], X.shape[-2]))


@torch.library.custom_op(f"{_NAMESPACE}::ba_plus_caa", mutates_args=())
def _traced_ba_plus_caa(A: Tensor, b: float, c: float, exact_fp32: bool) -> Tensor:
    return ba_plus_caa(A, b, c, exact_fp32=exact_fp32)


@_traced_ba_plus_caa.register_fake
def _(A: Tensor, b: float, c: float, exact_fp32: bool) -> Tensor:
    return torch.empty_like(A, memory_format=torch.contiguous_format)


def gram_product(X: Tensor, exact_fp32: bool) -> Tensor:
    """X @ X.mT by the Triton kernel, a fresh tensor."""
    return _traced_xxt(X, exact_fp32) if torch.compiler.is_compiling() else xxt(X, exact_fp32=exact_fp32)


def polynomial_product(A: Tensor, b: float, c: float, exact_fp32: bool) -> Tensor:
    """b*A + c*A@A for symmetric A by the Triton kernel, a fresh tensor."""
    if torch.compiler.is_compiling():
        return _traced_ba_plus_caa(A, b, c, exact_fp32)
    return ba_plus_caa(A, b, c, exact_fp32=exact_fp32)
