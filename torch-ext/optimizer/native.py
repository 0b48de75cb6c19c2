"""The compiled ops of this build variant: `muon_momentum_`, `muon_momentum_rounded_`, `load_moment`, `store_moment_`,
`finite_flags` and `apply_update_`, each with a pure-PyTorch fallback of the same semantics when it is absent, and
`symmetric_gram_`, `adamw_rounded_`, `adamw_checked_`, `normalize_elements_`, `normalize_rows_` and `squared_norms_`,
which exist only compiled (callers check `has_compiled_symmetric_gram`, `has_compiled_adamw_rounded`,
`has_compiled_adamw_checked`, `has_compiled_normalize_elements`, `has_compiled_normalize_rows` and
`has_compiled_squared_norms`).

The only module that touches `_ops` (generated per build variant; the plain source tree has none).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .state_precision import EntryPositions, moment_code, working_copy, write_rounded_

try:
    from ._ops import add_op_namespace_prefix, ops
except ImportError:  # the plain source tree: no build, so no compiled ops
    add_op_namespace_prefix = None
    ops = None

logger = logging.getLogger(__name__)

_MOMENTUM_OP = "muon_momentum_"
_ROUNDED_MOMENTUM_OP = "muon_momentum_rounded_"
_SYMMETRIC_GRAM_OP = "symmetric_gram_"
_FINITE_FLAGS_OP = "finite_flags_"
_LOAD_MOMENT_OP = "load_moment_"
_STORE_MOMENT_OP = "store_moment_"
_APPLY_UPDATE_OP = "apply_update_"
_ADAMW_ROUNDED_OP = "adamw_rounded_"
_ADAMW_CHECKED_OP = "adamw_checked_"
_NORMALIZE_ELEMENTS_OP = "normalize_elements_"
_NORMALIZE_ROWS_OP = "normalize_rows_"
_SQUARED_NORMS_OP = "squared_norms_"
_OPS = (_MOMENTUM_OP, _ROUNDED_MOMENTUM_OP, _SYMMETRIC_GRAM_OP, _FINITE_FLAGS_OP, _LOAD_MOMENT_OP, _STORE_MOMENT_OP,
        _APPLY_UPDATE_OP, _ADAMW_ROUNDED_OP, _ADAMW_CHECKED_OP, _NORMALIZE_ELEMENTS_OP, _NORMALIZE_ROWS_OP,
        _SQUARED_NORMS_OP)
_SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# The device types a build can compile kernels for, with their dispatch keys; any other device takes the fallback.
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}


def _qualified_name(op_name: str) -> str | None:
    """`namespace::op_name` when this build registered the op, else None (noarch variants register nothing)."""
    if add_op_namespace_prefix is None:
        return None
    name = add_op_namespace_prefix(op_name)
    return name if torch._C._dispatch_has_kernel(name) else None


def _has_kernel_for(qualified_name: str, device_type: str) -> bool:
    key = _DISPATCH_KEYS.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(qualified_name, key)


def _compiled_devices(op_name: str) -> list[str]:
    name = _qualified_name(op_name)
    return [] if name is None else [device for device in _DISPATCH_KEYS if _has_kernel_for(name, device)]


def _compiled_op(op_name: str, device_type: str) -> torch._ops.OpOverloadPacket | None:
    """The compiled op when it has a kernel for this device type."""
    return getattr(ops, op_name) if _has_compiled_op(op_name, device_type) else None


def _eager_op(op_name: str, device_type: str) -> torch._ops.OpOverloadPacket | None:
    """The compiled op when it has a kernel for this device type and no torch.compile trace is running (the ops
    that serve only eager steps)."""
    return None if torch.compiler.is_compiling() else _compiled_op(op_name, device_type)


def _required_op(op_name: str, device_type: str | None) -> torch._ops.OpOverloadPacket:
    """The compiled op of an op that has no fallback (its callers check `has_compiled_*` first), else a RuntimeError
    naming the op, the device type and what this build has."""
    compiled = None if device_type is None else _compiled_op(op_name, device_type)
    if compiled is None:
        raise RuntimeError(f"{op_name}: this build has no compiled kernel for device type {device_type!r} "
                           f"({ops_summary()})")
    return compiled


@torch.compiler.assume_constant_result
def _has_compiled_op(op_name: str, device_type: str) -> bool:
    """Fixed for the process: torch.compile takes the answer as a constant instead of tracing the dispatcher queries
    (its tracer would look through a cache decorator on this function)."""
    return _decide_compiled_op(op_name, device_type)


@functools.cache
def _decide_compiled_op(op_name: str, device_type: str) -> bool:
    """Decided and logged once per op and device type."""
    name = _qualified_name(op_name)
    found = name is not None and _has_kernel_for(name, device_type)
    logger.info("%s on %s: %s", op_name, device_type, f"compiled op {name}" if found else "no compiled op")
    return found


@torch.compiler.assume_constant_result  # fixed for the process; its dispatcher queries would break a traced step
def ops_summary() -> str:
    """One line saying which path runs, e.g.
    'compiled ops (cpu): _optimizer_cpu_1a2b3c4d5e [muon_momentum_: cpu; symmetric_gram_: cpu]'."""
    devices_by_op = {op_name: _compiled_devices(op_name) for op_name in _OPS}
    devices = [device for device in _DISPATCH_KEYS if any(device in found for found in devices_by_op.values())]
    if not devices:
        return "pure PyTorch fallback: this build has no compiled ops"
    namespace = add_op_namespace_prefix("").split("::")[0]
    per_op = "; ".join(f"{op_name}: {', '.join(found) or 'none'}" for op_name, found in devices_by_op.items())
    return f"compiled ops ({', '.join(devices)}): {namespace} [{per_op}]"


def has_compiled_symmetric_gram(device_type: str) -> bool:
    """Whether this build has a compiled `symmetric_gram_` kernel for the device type ("cpu", "cuda", ...)."""
    return _compiled_op(_SYMMETRIC_GRAM_OP, device_type) is not None


def has_compiled_adamw_rounded(device_type: str) -> bool:
    """Whether this build has a compiled `adamw_rounded_` kernel for the device type, usable here (not while
    torch.compile traces)."""
    return _eager_op(_ADAMW_ROUNDED_OP, device_type) is not None


def adamw_rounded_(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_scales: Tensor | None, exp_avg_sq: Tensor,
                   exp_avg_sq_scales: Tensor | None, rounding_count: Tensor, positions: EntryPositions | None,
                   step: Tensor, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """One AdamW step of `param` (contiguous) whose moments are stored in fewer bytes, both bfloat16 or both "int8"
    e4m3 codes with their block scales (`exp_avg_sq`'s holding its square root, see `state_precision`): read, stepped
    in float32 as torch's AdamW steps them (`step`, float32, already counts this step), and stored back rounded at
    random as `store_moment_` stores them, salted by `rounding_count` (not moved) and each entry's position. In one
    pass, where the composition (load, torch's fused AdamW, store) takes three. Only compiled: callers check
    `has_compiled_adamw_rounded` first."""
    compiled = _required_op(_ADAMW_ROUNDED_OP, param.device.type)
    compiled(param, grad.contiguous(), exp_avg, exp_avg_scales, exp_avg_sq, exp_avg_sq_scales, rounding_count,
             *_rows_and_columns(positions), step, float(lr), betas[0], betas[1], eps, weight_decay)


def has_compiled_adamw_checked(device_type: str) -> bool:
    """Whether this build has a compiled `adamw_checked_` kernel for the device type, usable here (not while
    torch.compile traces)."""
    return _eager_op(_ADAMW_CHECKED_OP, device_type) is not None


# The parameter dtypes `adamw_checked_` steps (bfloat16 computed in float32, as torch's fused AdamW computes it).
ADAMW_CHECKED_DTYPES = (torch.float32, torch.bfloat16)


def adamw_checked_(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                   exp_avg_sqs: Sequence[Tensor], steps: Sequence[Tensor], found_inf: Tensor | None, *,
                   lr: float | Sequence[float], betas: tuple[float, float], eps: float,
                   weight_decay: float | Sequence[float]) -> Tensor:
    """torch's fused AdamW step (decoupled weight decay) on parameters whose moments are stored as they are: each
    parameter's tensors of one shape, its moments of its dtype (one of ADAMW_CHECKED_DTYPES), its gradient of any
    floating dtype (converted), its step count one float32; strided tensors step as their contiguous copies, written
    back.
    found_inf: (N,) float32 flags, 1.0 where a parameter is skipped; None: each gradient is checked for NaN and Inf in
    the same call, just before its parameter's update. Skipped parameters are left as they were; the others' step counts
    move by one before their update. `lr` and `weight_decay`: one for all, or one per parameter. Returns the flags
    (written when found_inf was None). Only compiled: callers check `has_compiled_adamw_checked` first."""
    compiled = _required_op(_ADAMW_CHECKED_OP, params[0].device.type if params else None)
    check = found_inf is None
    flags = torch.empty(len(params), dtype=torch.float32, device=params[0].device) if check else found_inf
    compiled(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(steps), flags, check, _floats(lr),
             betas[0], betas[1], eps, _floats(weight_decay))
    return flags


def _floats(rates: float | Sequence[float]) -> list[float]:
    """A rate for every parameter, or one per parameter, as the ops' float lists take them."""
    return [float(rate) for rate in rates] if isinstance(rates, Sequence) else [float(rates)]


def has_compiled_normalize_elements(device_type: str) -> bool:
    """Whether this build has a compiled `normalize_elements_` kernel for the device type, usable here (not while
    torch.compile traces)."""
    return _eager_op(_NORMALIZE_ELEMENTS_OP, device_type) is not None


def normalize_elements_(updates: Sequence[Tensor], moments: Sequence[Tensor], decays: Tensor, corrections: Tensor,
                        one_minus_beta: float, eps: float) -> Tensor:
    """AdaMuon's normalization in place, one pass per tensor: moments[i] <- moments[i] * decays[i] +
    one_minus_beta * u², then updates[i] <- u / (sqrt(moments[i] / corrections[i]) + eps), u each entry of
    updates[i], with the roundings of that composition of torch ops. updates[i] contiguous or the transpose of a
    contiguous tensor (a tall matrix's Newton-Schulz result); moments[i] (float32 or float64) contiguous, of its
    update's shape. `decays`, `corrections`: one value per tensor (sent to the host as float64). Returns each
    normalized update's sum of squares (float64, on the CPU), which the RMS rule scales by. Only compiled: callers
    check `has_compiled_normalize_elements` first."""
    return _normalized_in_place(_NORMALIZE_ELEMENTS_OP, updates, moments, decays, corrections, one_minus_beta, eps)


def has_compiled_normalize_rows(device_type: str) -> bool:
    """Whether this build has a compiled `normalize_rows_` kernel for the device type, usable here (not while
    torch.compile traces)."""
    return _eager_op(_NORMALIZE_ROWS_OP, device_type) is not None


def normalize_rows_(updates: Sequence[Tensor], moments: Sequence[Tensor], decays: Tensor, corrections: Tensor,
                    one_minus_beta: float, eps: float) -> Tensor:
    """NorMuon's normalization in place, one parallel pass per tensor: with s the sum of squares of a row of
    updates[i] and n its length, the row's entry of moments[i] <- moment * decays[i] + one_minus_beta * s / n, then
    the row <- row / (sqrt(moment / corrections[i]) + eps). updates[i] is (..., rows, cols), contiguous or the
    transpose of a contiguous tensor (a tall matrix's Newton-Schulz result); moments[i] (float32 or float64)
    contiguous, one entry per row. `decays`, `corrections`: one value per tensor (sent to the host as float64).
    Returns each normalized update's sum of squares (float64, on the CPU), which the RMS rule scales by. Only
    compiled: callers check `has_compiled_normalize_rows` first."""
    return _normalized_in_place(_NORMALIZE_ROWS_OP, updates, moments, decays, corrections, one_minus_beta, eps)


def _normalized_in_place(op_name: str, updates: Sequence[Tensor], moments: Sequence[Tensor], decays: Tensor,
                         corrections: Tensor, one_minus_beta: float, eps: float) -> Tensor:
    """Runs a compiled normalization op; returns the sums of squares it wrote."""
    compiled = _required_op(op_name, updates[0].device.type if updates else None)
    squares = torch.empty(len(updates), dtype=torch.float64, device="cpu")
    compiled(list(updates), list(moments), decays.to("cpu", torch.float64), corrections.to("cpu", torch.float64),
             one_minus_beta, eps, squares)
    return squares


def has_compiled_squared_norms(device_type: str) -> bool:
    """Whether this build has a compiled `squared_norms_` kernel for the device type, usable here (not while
    torch.compile traces)."""
    return _eager_op(_SQUARED_NORMS_OP, device_type) is not None


def squared_norms(tensors: Sequence[Tensor]) -> Tensor:
    """(N,) float64 on the tensors' device: the sum of the squares of each tensor's elements, accumulated in
    float64, each tensor read once at memory speed. For float32, bfloat16 and float16 tensors a sum is finite exactly
    when the tensor is (their squares cannot overflow float64); a float64 tensor's sum can overflow."""
    device = tensors[0].device if tensors else torch.device("cpu")
    sums = torch.empty(len(tensors), dtype=torch.float64, device=device)
    if tensors:
        _required_op(_SQUARED_NORMS_OP, device.type)([tensor.contiguous() for tensor in tensors], sums)
    return sums


def symmetric_gram_(out: Tensor, X: Tensor, C: Tensor | None = None, alpha: float = 1.0,
                    beta: float = 0.0) -> Tensor:
    """out <- alpha * X @ X^T + beta * C with about half the multiply-adds of a full product; returns out.

    X is (m, k) or (B, m, k); out, and C if given, are (m, m) or (B, m, m) in X's dtype (float32, float64, bfloat16
    or float16) on X's device, out contiguous and sharing no memory with X or C. C must be symmetric (not checked:
    kernels read only some of it). Without C, beta is ignored and out's old contents are never read. Products
    accumulate in float32 (float64 for float64), and out is exactly symmetric.

    There is no fallback: raises RuntimeError when this build has no compiled kernel for X's device type (check
    has_compiled_symmetric_gram first), and ValueError, naming the argument, for invalid arguments.
    """
    for name, tensor in (("out", out), ("C", C)):
        if tensor is not None and tensor.device != X.device:  # else the dispatcher would pick the other device
            raise ValueError(f"symmetric_gram_: {name} is on {tensor.device} but X is on {X.device}")
    _required_op(_SYMMETRIC_GRAM_OP, X.device.type)(out, X, C, alpha, beta)
    return out


def muon_momentum_(momentum_buffers: list[Tensor], grads: list[Tensor], updates: list[Tensor],
                   beta: float, nesterov: bool) -> Tensor:
    """Muon's momentum step for a list of tensors, skipping any whose gradient is not finite.

    For each i with an all-finite grads[i]: momentum_buffers[i] <- lerp(buffer, grad, 1 - beta), and updates[i] <-
    lerp(grad, buffer, beta) if nesterov else the buffer, written in updates[i]'s own dtype. Otherwise the buffer is
    left untouched and updates[i] <- 0. Arithmetic is float32 (float64 for float64 tensors).

    Returns the float32 (N,) finite flags (1.0 or 0.0) on the grads' device, computed without a host sync.
    """
    device = _common_device(momentum_buffers, grads, updates)
    finite = torch.empty(len(grads), dtype=torch.float32, device=device)
    compiled = _compiled_op(_MOMENTUM_OP, device.type)
    if compiled is not None:
        compiled(momentum_buffers, grads, updates, finite, beta, nesterov)
    else:
        _check_momentum_args(momentum_buffers, grads, updates, beta)
        _muon_momentum_fallback(momentum_buffers, grads, updates, finite, beta, nesterov)
    return finite


def muon_momentum_rounded_(momentum_buffers: list[Tensor], scales: list[Tensor | None], grads: list[Tensor],
                           updates: list[Tensor], rounding_counts: list[Tensor],
                           positions: list[EntryPositions | None], beta: float, nesterov: bool) -> Tensor:
    """`muon_momentum_` on momentum stored in fewer bytes (see `state_precision`): momentum_buffers[i] is bfloat16
    (scales[i] None) or int8 linear codes with float32 block scales scales[i]. The momentum is stepped in float32 from
    its stored value, updates[i] is written from that float32 value, and the momentum is stored back stochastically
    rounded, salted by rounding_counts[i] (int64, one element) and each entry's index in the whole tensor,
    positions[i] (see `EntryPositions`; None: the tensor is whole). A non-finite gradient leaves the stored momentum
    as it is and zeroes the update. The counts are not moved (the caller knows whether other ranks agreed). A
    torch.compile trace takes the fallback's torch ops: inductor failed to lower the op's lists of optional tensors
    (torch 2.13: "'dict' object has no attribute 'append'"), so a compiled step with a `state_dtype` did not compile.

    Returns the float32 (N,) finite flags on the grads' device, computed without a host sync."""
    device = _common_device(momentum_buffers, grads, updates)
    finite = torch.empty(len(grads), dtype=torch.float32, device=device)
    compiled = _eager_op(_ROUNDED_MOMENTUM_OP, device.type)
    if compiled is not None:
        rows_and_columns = [_rows_and_columns(position) for position in positions]
        compiled(momentum_buffers, scales, grads, updates, finite, rounding_counts,
                 [rows for rows, _ in rows_and_columns], [columns for _, columns in rows_and_columns], beta, nesterov)
    else:
        _muon_momentum_rounded_fallback(momentum_buffers, scales, grads, updates, finite, rounding_counts, positions,
                                        beta, nesterov)
    return finite


def _rows_and_columns(positions: EntryPositions | None) -> tuple[Tensor | None, Tensor | None]:
    """The ops' row_positions and column_positions arguments."""
    return (None, None) if positions is None else (positions.rows, positions.columns)


def load_moment(key: str, stored: Tensor, scales: Tensor | None) -> Tensor:
    """The float32 values of the moment `key` stored in fewer bytes (bfloat16, or int8 codes with their block
    scales; see `state_precision`), as a new contiguous tensor."""
    compiled = _compiled_op(_LOAD_MOMENT_OP, stored.device.type)
    if compiled is None:
        return working_copy(key, stored, scales)
    out = torch.empty(stored.shape, dtype=torch.float32, device=stored.device)
    compiled(out, stored, scales, moment_code(key, scales))
    return out


def store_moment_(key: str, stored: Tensor, scales: Tensor | None, values: Tensor, rounding_count: Tensor,
                  taken: Tensor, positions: EntryPositions | None, position_offset: int = 0) -> None:
    """The moment `key` <- values (float32), rounded at random with bits salted by rounding_count and each entry's
    index in the whole tensor: `values` are the entries from position_offset on of a tensor (or shard: `positions`)
    whose entries are in row-major order. Where taken (one float32) is 0.0, nothing is written. The count is not
    moved."""
    compiled = _compiled_op(_STORE_MOMENT_OP, stored.device.type)
    if compiled is not None:
        compiled(stored, scales, values.contiguous(), rounding_count, *_rows_and_columns(positions), position_offset,
                 taken, moment_code(key, scales))
        return
    write_rounded_(key, stored, scales, values, rounding_count, taken.reshape(()), positions, position_offset)


def apply_update_(params: Sequence[Tensor], updates: Sequence[Tensor], decay: Tensor | None,
                  step_sizes: Sequence[float | Tensor]) -> None:
    """params[i] <- params[i] * decay[i], then <- params[i] + step_sizes[i] * updates[i], each rounded to the
    parameter's dtype: `_foreach_mul_` then `add_`, the add computed in the two dtypes' common type as torch's is
    (a float64 update of a float32 parameter: in double, rounded once).
    `decay`: (N,) factors in `functional.decay_dtype` on the parameters' device, or None (no decay); a step size is
    a number or a one-element tensor. An update may be strided (a tall matrix's Newton-Schulz result is the
    transpose of a contiguous one).

    The compiled op serves CPU parameters outside torch.compile, one pass per parameter (an update laid out otherwise
    than flat or transposed, a batched conv's, is copied flat first, as torch's add_ would need it on the CPU):
    there torch's add_ first copies an update of another dtype to the parameter's (a bfloat16 update of a float32
    768 x 3072 parameter: a fresh float32 copy, then the add, then the decay's own pass), and reads a transposed
    operand at a fifth of its speed. The others take the torch ops. On the CPU, either way, a strided parameter (a
    transposed or channels_last weight, a column of a larger tensor) steps as its contiguous copy, written back: its
    entries round as a contiguous parameter's do (torch's 16-bit add_ rounds some of them otherwise)."""
    compiled = _eager_op(_APPLY_UPDATE_OP, params[0].device.type) if params else None
    by_op = [compiled is not None and update.shape == param.shape for param, update in zip(params, updates)]
    served = [i for i, taken in enumerate(by_op) if taken]
    rest = [i for i, taken in enumerate(by_op) if not taken]
    if served:
        if decay is None:
            served_decay = torch.ones(len(served), dtype=torch.float64, device="cpu")
        else:  # no index op where every parameter is served, as on the CPU they all are
            served_decay = (decay if len(served) == len(params) else decay[served]).to(torch.float64)
        stepped = [params[i].contiguous() for i in served]
        compiled(stepped, [_flat_or_transposed(updates[i]) for i in served], served_decay,
                 torch.tensor([float(step_sizes[i]) for i in served], dtype=torch.float64, device="cpu"))
        for i, copy in zip(served, stepped):
            if copy is not params[i]:
                params[i].copy_(copy)
    if decay is not None and rest:
        factors = decay.unbind()  # views: no index tensor to send to a GPU
        torch._foreach_mul_([params[i] for i in rest], [factors[i] for i in rest])
    for i in rest:
        _add_scaled_(params[i], updates[i], step_sizes[i])


def _flat_or_transposed(update: Tensor) -> Tensor:
    """The update in a layout the compiled op reads."""
    return update if is_contiguous_or_transposed(update) else update.contiguous()


def is_contiguous_or_transposed(tensor: Tensor) -> bool:
    """The layouts the CPU ops read a tall matrix's Newton-Schulz result in: computed on its transpose, it is that
    transpose's contiguous memory."""
    return tensor.is_contiguous() or (tensor.ndim >= 2 and tensor.mT.is_contiguous())


def _add_scaled_(param: Tensor, update: Tensor, step_size: float | Tensor) -> None:
    """param += step_size * update, computed in the two dtypes' common type and rounded to the parameter's; a
    tensor step size is multiplied in on the device. On the CPU a strided parameter steps as its contiguous copy
    (see `apply_update_`), and a strided update is copied into a contiguous one first: torch's add_ read a
    transposed 768 x 3072 bf16 operand in 7.5 ms, a (blocked) copy took 1.5 and the add then 0.7."""
    if param.device.type == "cpu":
        if not param.is_contiguous():
            stepped = param.contiguous()
            _add_scaled_(stepped, update, step_size)
            param.copy_(stepped)
            return
        update = update.contiguous()
    if isinstance(step_size, Tensor):
        param.addcmul_(update, step_size.to(param.device))
    else:
        param.add_(update, alpha=step_size)


def finite_flags(tensors: Sequence[Tensor]) -> Tensor:
    """(N,) float32 on the tensors' device: 1.0 where tensors[i] holds no NaN or Inf, else 0.0; no host sync.

    On the CPU the compiled op reads each tensor once at memory speed, all of them in one call. Elsewhere (GPUs, and
    builds without the op) each tensor's largest magnitude, finite exactly when the tensor is, comes from torch's
    multi-tensor norm (`tensor_norms`): one pass over each tensor in a few launches for all of them, where a kernel
    per tensor (97 for GPT-2 small's AdamW part) cost more host time than the reads take on a GPU."""
    device = tensors[0].device if tensors else torch.device("cpu")
    for i, tensor in enumerate(tensors):
        if tensor.device != device:  # else the dispatcher would pick the other device
            raise ValueError(f"finite_flags: tensors[{i}] is on {tensor.device} but tensors[0] is on {device}")
    compiled = _compiled_op(_FINITE_FLAGS_OP, device.type)
    if compiled is None and tensors:
        return torch.stack(tensor_norms(tensors, math.inf)[0]).isfinite().to(torch.float32)
    finite = torch.ones(len(tensors), dtype=torch.float32, device=device)
    if compiled is not None:
        compiled([tensor.contiguous() for tensor in tensors], finite)
    return finite


def tensor_norms(tensors: Sequence[Tensor], ord: float) -> tuple[list[Tensor], list[list[int]]]:
    """Each tensor's `ord`-norm as a 0-dim tensor, in the tensors' order (0 for an empty tensor, whose infinity norm
    torch leaves undefined), by `torch._foreach_norm`, one multi-tensor call per dtype (its kernel takes one); and
    the indices of each dtype's tensors, dtypes in the order they first appear, as torch.nn.utils.clip_grad_norm_
    groups (and sums) them. A NaN anywhere in a tensor makes its norm NaN."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, tensor in enumerate(tensors):
        groups.setdefault(tensor.dtype, []).append(i)
    norms: dict[int, Tensor] = {}
    for indices in groups.values():
        measured = [i for i in indices if tensors[i].numel()]
        if measured:
            norms.update(zip(measured, torch._foreach_norm([tensors[i] for i in measured], ord)))
    ordered = [norms[i] if i in norms else torch.zeros((), dtype=tensor.dtype, device=tensor.device)
               for i, tensor in enumerate(tensors)]
    return ordered, list(groups.values())


def _common_device(momentum_buffers: list[Tensor], grads: list[Tensor], updates: list[Tensor]) -> torch.device:
    """The grads' device, which picks the path; checked here because mixed devices would reach the dispatcher."""
    device = grads[0].device if grads else torch.device("cpu")
    for name, tensors in (("momentum_buffers", momentum_buffers), ("grads", grads), ("updates", updates)):
        for i, tensor in enumerate(tensors):
            if tensor.device != device:
                raise ValueError(f"muon_momentum_: {name}[{i}] is on {tensor.device} but grads[0] is on {device}")
    return device


def _check_momentum_args(momentum_buffers: list[Tensor], grads: list[Tensor], updates: list[Tensor],
                         beta: float) -> None:
    """The compiled op's checks (torch_binding.cpp), with its messages, so both paths reject the same calls."""
    if len(grads) != len(momentum_buffers):
        raise ValueError(f"muon_momentum_: grads has {len(grads)} tensors but momentum_buffers has "
                         f"{len(momentum_buffers)}")
    if len(updates) != len(momentum_buffers):
        raise ValueError(f"muon_momentum_: updates has {len(updates)} tensors but momentum_buffers has "
                         f"{len(momentum_buffers)}")
    if not 0.0 <= beta <= 1.0:  # also rejects NaN
        raise ValueError(f"muon_momentum_: beta must be in [0, 1], got {beta}")
    for i, (buffer, grad, update) in enumerate(zip(momentum_buffers, grads, updates)):
        for name, tensor in (("momentum_buffers", buffer), ("grads", grad), ("updates", update)):
            _check_tensor(tensor, f"{name}[{i}]")
        if grad.shape != buffer.shape:
            raise ValueError(f"muon_momentum_: grads[{i}] has shape {list(grad.shape)} but momentum_buffers[{i}] "
                             f"has shape {list(buffer.shape)}")
        if grad.dtype != buffer.dtype:
            raise ValueError(f"muon_momentum_: grads[{i}] has dtype {grad.dtype} but momentum_buffers[{i}] has "
                             f"dtype {buffer.dtype}")
        if update.shape != buffer.shape:
            raise ValueError(f"muon_momentum_: updates[{i}] has shape {list(update.shape)} but momentum_buffers[{i}] "
                             f"has shape {list(buffer.shape)}")


def _check_tensor(tensor: Tensor, label: str) -> None:
    if tensor.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"muon_momentum_: {label} has dtype {tensor.dtype} "
                         "(expected float32, float64, bfloat16 or float16)")
    if not tensor.is_contiguous():
        raise ValueError(f"muon_momentum_: {label} must be contiguous")


def _muon_momentum_fallback(momentum_buffers: list[Tensor], grads: list[Tensor], updates: list[Tensor],
                            finite: Tensor, beta: float, nesterov: bool) -> None:
    for i, (buffer, grad, update) in enumerate(zip(momentum_buffers, grads, updates)):
        opmath = torch.float64 if buffer.dtype == torch.float64 else torch.float32
        grad_math = grad.to(opmath)
        buffer_math = buffer.to(opmath)  # exact: every supported dtype widens losslessly
        grad_finite = torch.isfinite(grad_math).all()  # a device tensor: choosing with torch.where needs no sync
        finite[i] = grad_finite
        buffer.copy_(torch.where(grad_finite, torch.lerp(buffer_math, grad_math, 1.0 - beta), buffer_math))
        # Nesterov blends with the buffer as stored (rounded to its dtype), as the compiled kernels do.
        new_buffer = buffer.to(opmath)
        step = torch.lerp(grad_math, new_buffer, beta) if nesterov else new_buffer
        update.copy_(torch.where(grad_finite, step, 0.0))


def _muon_momentum_rounded_fallback(momentum_buffers: list[Tensor], scales: list[Tensor | None], grads: list[Tensor],
                                    updates: list[Tensor], finite: Tensor, rounding_counts: list[Tensor],
                                    positions: list[EntryPositions | None], beta: float, nesterov: bool) -> None:
    """Float32 working copies through `_muon_momentum_fallback`, stored back rounded where the step was taken."""
    if not len(scales) == len(rounding_counts) == len(positions) == len(momentum_buffers):
        raise ValueError(f"muon_momentum_rounded_: scales, rounding_counts and positions have {len(scales)}, "
                         f"{len(rounding_counts)} and {len(positions)} entries but momentum_buffers has "
                         f"{len(momentum_buffers)}")
    work = [working_copy("momentum_buffer", buffer, scale) for buffer, scale in zip(momentum_buffers, scales)]
    float_grads = [grad.float() for grad in grads]
    _check_momentum_args(work, float_grads, updates, beta)
    _muon_momentum_fallback(work, float_grads, updates, finite, beta, nesterov)
    for buffer, scale, value, count, flag, position in zip(momentum_buffers, scales, work, rounding_counts,
                                                           finite.unbind(), positions):
        write_rounded_("momentum_buffer", buffer, scale, value, count, flag, position)
