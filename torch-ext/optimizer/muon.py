"""`Muon`: the optimizer class, a thin layer over the update functions: groups enter and are checked, state is
prepared and gathered into items, and each step hands the items to the single-device or distributed updates."""

from __future__ import annotations

import contextlib
import logging
import operator
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor
from torch.nn.parameter import is_lazy
from torch.optim import Optimizer

from .checkpoint import (aligned_by_name, check_group_sizes, check_saved_state, codes_under_their_keys,
                         dtypes_from_names, dtypes_named, restore_state_dtypes_)
from .clipping import (CheckedGradients, check_max_norm, clip_by_tensor_norms_, clip_grad_norm_, reads_once,
                       tensor_norms_serve)
from .coefficients import Coefficients, resolve_coefficients
from .distributed.dtensors import any_dtensor, is_dtensor, local_or_none, local_tensor, placed_like, zeros_like_resized
from .distributed.finite import found_inf_flags
from .distributed.layout import shard_positions
from .distributed.step import check_spread_param, distributed_muon_update, is_spread
from .functional import AdamWTensors, MuonTensors, Rates, by_device
from .group_options import (entered, learning_rate, needs_reentry, param_names, put_back_, reenter_, reentered,
                            validate_group)
from .held_items import LAYOUT_OPTIONS, HeldItems, KeptOptions
from .newton_schulz import Orthogonalizer
from .normalization import moment_dtype, second_moment_shape
from .option_values import as_integer, as_real, check_choice
from .offload import (OFFLOAD_TARGETS, StagedUpdates, home_device, keep_at_home, staged_adamw_update,
                      staged_muon_update)
from .precision import default_ns_dtype, ns_dtype_choice, warn_if_slow, without_autocast
from .qk_clip import (DEFAULT_THRESHOLD, QKClipLayer, check_qk_logits, check_threshold, clip_checked_,
                      resolve_layers)
from .routing import MatrixView, check_forced_muon, muon_view
from .state_layout import (ADAMW_MOMENTS, ADAMW_STATE, MUON_MOMENTS, MUON_STATE, keep_moments, keep_own_dtypes,
                           misplaced_state, misshapen_state, moment_form, param_state_keys, state_keys)
from .state_precision import rounds_stochastically
from .torch_support import COMPILED_DTENSOR_STEPS_TORCH, compiles_dtensor_steps, release_name
from .workspace import Workspace

# What a copied or unpickled optimizer holds in place of the process group it was built with: a process group
# belongs to its process and cannot be saved, so the copy's step asks for one instead of running single-device.
_PROCESS_GROUP_NOT_SAVED = "process group not saved"

logger = logging.getLogger(__name__)


def _view(group: dict[str, Any], param: Tensor) -> MatrixView | None:
    """The matrix view Muon steps `param` in under its group's routing options, or None where AdamW steps it."""
    use_muon = group["use_muon"]
    # Answered before `muon_view`'s kept lookup, which hashes the shape: without this, an AdamW-only group of GPT-2
    # small's 97 AdamW tensors (every dim / 96) took ~0.1 ms more a step (2-core Xeon).
    if use_muon is False:
        return None
    return muon_view(param.shape, use_muon, group["param_layout"], group["conv_mode"])


def _muon_settings(group: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """What `muon_update` takes from a group whose Muon parameters are on `device` (the first, where several)."""
    orthogonalizer = Orthogonalizer(
        tuple(resolve_coefficients(group["ns_coefficients"], as_integer(group["ns_steps"]), group["preconditioner"])),
        as_real(group["eps"]), group["ns_dtype"] or default_ns_dtype(device),
        group["ns_algorithm"], group["preconditioner"], as_real(group["safety_factor"]), group["scale_eps"],
        dtype_is_default=group["ns_dtype"] is None)
    return dict(lr=learning_rate(group["lr"]), weight_decay=as_real(group["weight_decay"]),
                momentum=as_real(group["momentum"]), nesterov=group["nesterov"], orthogonalizer=orthogonalizer,
                adjust_lr_fn=group["adjust_lr_fn"], normalize_spatial=group["normalize_spatial"],
                normalization=group["normalization"], normalization_beta=as_real(group["adamw_betas"][1]))


# The settings the Muon updates take one per parameter, where groups share a call.
_PER_ITEM_SETTINGS = ("lr", "weight_decay")
# The same object for every group of a step, so no part of what tells groups apart; left out of the key, too, because
# torch 2.9's compiler cannot hash an object of a class of ours in a dict key.
_STEP_WIDE_SETTINGS = ("workspace", "schedule")
# Updates waiting for the groups that share them: key -> (the update, each group's settings and items).
_Pending = dict[tuple, tuple[Callable[..., None], list[tuple[dict[str, Any], list[MuonTensors] | list[AdamWTensors]]]]]


def _run_pending(pending: _Pending) -> None:
    """Each pending update, once, on the items of every group that shares it, each item with its group's rates."""
    for update, members in pending.values():
        settings, items = members[0]
        if len(members) > 1:
            items = [item for _, chosen in members for item in chosen]
            settings = {**settings, **{name: [other[name] for other, chosen in members for _ in chosen]
                                       for name in _PER_ITEM_SETTINGS}}
        update(items, **settings)


def _shared_update_key(settings: dict[str, Any]) -> tuple:
    """Equal for groups whose updates (Muon's, AdamW's) may share one call: all their settings but lr and weight
    decay (and the step-wide ones) equal."""
    return tuple((name, value.recipe if isinstance(value, Orthogonalizer) else value)
                 for name, value in settings.items() if name not in _PER_ITEM_SETTINGS + _STEP_WIDE_SETTINGS)


def _local_adamw_item(item: AdamWTensors) -> AdamWTensors:
    """A DTensor parameter's AdamW tensors as this rank's shards (plain tensors pass through)."""
    if not is_dtensor(item.param):
        return item
    positions = None if item.rounding_count is None else shard_positions(item.param)
    return replace(item, param=local_tensor(item.param), grad=local_tensor(placed_like(item.grad, item.param)),
                   exp_avg=local_tensor(item.exp_avg), exp_avg_sq=local_tensor(item.exp_avg_sq),
                   exp_avg_scales=local_or_none(item.exp_avg_scales),
                   exp_avg_sq_scales=local_or_none(item.exp_avg_sq_scales), rounding_positions=positions)


class Muon(Optimizer):
    """Muon for matrices (momentum, then Newton-Schulz orthogonalization), AdamW for every other parameter.

    Routing: a group's ``use_muon`` forces Muon (True) or AdamW (False); without it, matrices, conv weights and 3D
    expert banks that are not degenerate go to Muon and the rest (1D, scalars, thin shapes) to AdamW. Use
    :func:`muon_param_groups` to also send embeddings and the output head to AdamW.

    Args:
        params: parameters or parameter groups (dicts); groups may set any option below, plus ``use_muon``
            (None/True/False) and ``param_layout`` ("auto", "conv" for Conv1d weights, "experts", "transposed" for
            matrices stored (in, out)).
        lr: learning rate. weight_decay: decoupled (``p *= 1 - lr * weight_decay``), as torch.optim.Muon does.
        momentum, nesterov: the momentum buffer is ``lerp(buffer, grad, 1 - momentum)``; Nesterov orthogonalizes
            ``lerp(grad, buffer, momentum)``.
        ns_steps, ns_coefficients: Newton-Schulz iterations and their (a, b, c) coefficients: "polar_express",
            "polar_express_safer", "quintic", "original", or a list of triples (the last repeats).
        eps: lower clamp of the Frobenius norm before the iteration.
        adjust_lr_fn: "match_rms_adamw" (0.2 * sqrt(max(out, in))), "original" (sqrt(max(1, out / in))),
            "spectral" (sqrt(out / in); timm's "rms_to_rms"), "rsqrt_in" (1 / sqrt(in)) or None (no scaling).
        ns_dtype: Newton-Schulz compute dtype; None is what the device multiplies fastest (`default_ns_dtype`):
            bfloat16 on GPUs from compute capability 8.0 (float16 below) and on CPUs with fast bf16 products (AMX;
            AVX512-BF16 on AMD cores), float32 on other CPUs, and on those, for a lone matrix under 2^23 (AMX) or
            2^22 (AVX512-BF16) multiply-adds a product (`matrix_ns_dtype`).
        ns_algorithm: "standard" (three products of the matrix's size per step), "gram" (the same polynomial
            applied through the matrix's Gram matrix: 1.7-2.1x faster on 1:4 matrices in float32) or "auto" (per
            shape, "gram" where it takes fewer FLOPs, from an aspect ratio of about 1.5, by 3M or more, and the
            iteration is float32 or float64; in 16-bit on CUDA GPUs, "gram" (in float16) from 2048 rows where it
            does at most 3/4 of the standard iteration's FLOPs; "standard" otherwise).
        preconditioner: None or "aol": rows scaled by (|X Xᵀ| 1)^(-1/2) before the iteration instead of relying on
            the Frobenius scaling alone (Turbo-Muon); the "polar_express" schedule then assumes it, and 4 steps reach
            the accuracy 5 reach without it on well-conditioned matrices.
        safety_factor: the Frobenius norm is multiplied by it before the division (timm's option; >= 1).
        scale_eps: timm's μP option (arXiv 2512.05620): eps * sqrt(in / out) is added to the norm instead of
            clamping it.
        capturable: a step safe to capture in a CUDA graph (timm's and torch's option): tensor option values (a
            tensor lr) are not read at step time. The step never syncs with the host in any case.
        verbose: log (INFO, logger "optimizer.muon" under the package's name) where each parameter goes and why.
        normalization: None, "neuron" (NorMuon: each output row of the orthogonalized update divided by the root of
            a running mean of its squares) or "element" (AdaMuon: the same per entry; timm's algo="adamuon"). The
            running mean's beta is adamw_betas[1], as timm shares it; under "match_rms_adamw" the normalized update
            is rescaled to RMS 0.2, as both papers do. The second moment (state "update_sq") is laid out like the
            parameter (per row: the parameter's shape with the dims a row runs along reduced to 1) and, for a
            DTensor, sharded like it: each rank normalizes its own shard of the update.
        state_dtype: None (the moments, Muon's momentum and AdamW's two, have the parameter's dtype),
            torch.bfloat16 (half the bytes of float32 moments) or "int8" (8-bit codes with a float32 scale per block
            of 256 along the last dim, a quarter of the bytes and 1/64 more: linear codes for Muon's momentum, float8
            e4m3 values for AdamW's moments, the second one's square root; vectors, scalars and tensors split along
            their last dim keep bfloat16). The moments are stepped in float32 and
            stored back with stochastic rounding, so small updates are not lost; the count of rounded writes is
            state "rounding_count". A group's moments follow a change of its state_dtype at its next step.
        offload: None or "cpu": the moments (Muon's momentum, AdamW's two, their block scales, NorMuon's second
            moment) of parameters on a GPU live in pinned host memory; each step streams them to the GPU in groups
            (a bucket of matrices, AdamW tensors of up to 32 MiB of state) on side streams, the next group's fetch
            overlapping this one's update, and writes them back. The GPU then holds about three groups' state.
            DTensor parameters keep DTensor state whose local shards live on the host; the distributed pipeline
            fetches each chunk's while the chunks before it compute (its GPU holds at most four chunks' state). On
            CPU parameters it moves nothing and says so once. Not a per-group option.
        normalize_spatial: in conv_mode "batched", scale each kernel position's update by 1 / sqrt(positions)
            (timm's option; its default is True, ours False: under "match_rms_adamw" both conv modes then give every
            entry AdamW's RMS).
        conv_mode: "flatten" (out, in * k) or "batched" (one (out, in) matrix per kernel position).
        adamw_lr_scale: AdamW's lr is lr * adamw_lr_scale (None: 1), so whatever moves lr moves it too.
        adamw_lr: shorthand for adamw_lr_scale = adamw_lr / lr, with lr as given here (or in the group).
        adamw_betas, adamw_eps: AdamW's (None: betas (0.9, 0.95)).
        adamw_weight_decay: AdamW's decoupled weight decay; None uses weight_decay.
        comm_dtype: dtype of the momentum and of the orthogonalized update while they travel between ranks
            (DTensor parameters, or any parameter with a process_group); torch.float32 sends them unrounded.
        chunk_size: matrices per chunk of the distributed pipeline (one chunk's transfers overlap the previous
            chunk's Newton-Schulz); None is twice the number of ranks.
        process_group: for plain (not DTensor) parameters replicated over this group, as under DDP, each rank
            orthogonalizes about 1/world of the matrices and the results are shared; None keeps plain tensors
            single-device. Not a per-group option. DTensor parameters always use their own device mesh.
        qk_clip: QK-clip (MuonClip, Kimi K2) layers, a mapping from a layer key of your choice (an index, a name)
            to a :class:`QKClipLayer` (query and key weights, or their parameter names, and the head layout).
            `step(qk_logits={key: max_logits})` then clips those layers after the update. Not a per-group option.
        qk_clip_threshold: the largest attention logit a head may keep (Kimi's tau, 100 by default). Not a per-group
            option.
        betas, fallback_lr_scale: timm's names for adamw_betas and adamw_lr_scale; groups may also say
            ``use_fallback`` (timm's, the opposite of use_muon) and adjust_lr_fn "rms_to_rms" (timm's "spectral").
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, Tensor]],
                 lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, ns_coefficients: str | list[Coefficients] = "polar_express", eps: float = 1e-7,
                 adjust_lr_fn: str | None = "match_rms_adamw", ns_dtype: torch.dtype | None = None,
                 ns_algorithm: str = "auto", conv_mode: str = "flatten", normalize_spatial: bool = False,
                 adamw_lr: float | None = None, adamw_lr_scale: float | None = None,
                 adamw_betas: tuple[float, float] | None = None, adamw_eps: float = 1e-8,
                 adamw_weight_decay: float | None = None, comm_dtype: torch.dtype = torch.bfloat16,
                 chunk_size: int | None = None, process_group: "torch.distributed.ProcessGroup | None" = None,
                 qk_clip: Mapping[Hashable, QKClipLayer] | None = None,
                 qk_clip_threshold: float = DEFAULT_THRESHOLD, *, preconditioner: str | None = None,
                 normalization: str | None = None, safety_factor: float = 1.0, scale_eps: bool = False,
                 capturable: bool = False, verbose: bool = False, state_dtype: torch.dtype | str | None = None,
                 betas: tuple[float, float] | None = None, fallback_lr_scale: float | None = None,
                 algo: str | None = None, offload: str | None = None) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        ns_coefficients=ns_coefficients, eps=eps, adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype,
                        ns_algorithm=ns_algorithm, conv_mode=conv_mode, normalize_spatial=normalize_spatial,
                        adamw_lr=adamw_lr, adamw_lr_scale=adamw_lr_scale,
                        adamw_betas=adamw_betas, adamw_eps=adamw_eps, adamw_weight_decay=adamw_weight_decay,
                        comm_dtype=comm_dtype, chunk_size=chunk_size, preconditioner=preconditioner,
                        normalization=normalization, safety_factor=safety_factor, scale_eps=scale_eps,
                        capturable=capturable, verbose=verbose, state_dtype=state_dtype, use_muon=None,
                        param_layout="auto")
        defaults = entered({**defaults, "betas": betas, "algo": algo, "fallback_lr_scale": fallback_lr_scale}, lr)
        validate_group(defaults)
        # An attribute, not a group option: param_groups go into state dicts, and a process group cannot be saved.
        self.process_group = process_group
        self.qk_clip_threshold = check_threshold(qk_clip_threshold)
        check_choice("offload", offload, OFFLOAD_TARGETS)
        self.offload = offload
        super().__init__(params, defaults)
        self._say_where_offload_applies()
        # Attributes too: they hold parameters, and names resolve only once the groups (and their names) exist.
        self.qk_clip = resolve_layers(qk_clip or {}, self._named_params())
        self._workspace = Workspace()  # CPU steps' scratch memory, kept from step to step; never saved
        self._kept: dict[int, KeptOptions] = {}  # by id of each group whose options are all immutable; never saved
        self._held: dict[int, HeldItems] = {}  # by id of each group; never saved
        self._staged_updates = StagedUpdates()  # with offload, each step's schedule and its kept buffers; never saved
        self._checked_gradients: CheckedGradients | None = None  # what clip_grad_norm_ read for the next step

    def __getstate__(self) -> dict[str, Any]:
        # torch saves defaults, state and param_groups; the QK-clip layers and the process group are attributes.
        process_group = None if self.process_group is None else _PROCESS_GROUP_NOT_SAVED
        return {**super().__getstate__(), "qk_clip": self.qk_clip, "qk_clip_threshold": self.qk_clip_threshold,
                "process_group": process_group, "offload": self.offload}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if state.get("process_group") is not None:  # __getstate__'s marker, a new string once unpickled: step's own
            self.process_group = _PROCESS_GROUP_NOT_SAVED
        # torch's adds a `differentiable` flag to the defaults, which is no option of Muon's: groups added later would
        # carry it.
        self.defaults.pop("differentiable", None)
        self.__dict__.setdefault("offload", None)  # a copy from before the option existed
        self._workspace = Workspace()
        self._kept = {}
        self._held = {}
        self._staged_updates = StagedUpdates()
        self._checked_gradients = None
        self._note_compile_support()
        for group in self.param_groups:  # a copy from before an option existed gets its default
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def _say_where_offload_applies(self) -> None:
        """offload="cpu" moves the state of parameters on an accelerator; it says once when it moves none."""
        params = [param for group in self.param_groups for param in group["params"]]
        if self.offload is None or any(home_device(param, self.offload) != param.device for param in params):
            return
        warnings.warn(f"Muon: offload={self.offload!r} has no effect here: every parameter is on the CPU already",
                      stacklevel=3)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        as_entered = entered(param_group, self.defaults["lr"])
        validate_group({**self.defaults, **as_entered})
        # The very dict given becomes the group, as in torch: a training loop may hold it and set its lr.
        param_group.clear()
        param_group.update(as_entered)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_forced_muon(group)
            if group["ns_dtype"] is not None:
                for device in {param.device for param in group["params"] if self._uses_muon(group, param)}:
                    warn_if_slow(group["ns_dtype"], device)
            if group["verbose"]:
                self._log_routing(group)
        except BaseException:  # a warning raised as an error too: a rejected group leaves the optimizer as it was
            self.param_groups.pop()
            raise
        self._note_compile_support()

    def _note_compile_support(self) -> None:
        """Whether the step's update must run uncompiled under torch.compile: on a torch whose compiler cannot trace a
        step that reads DTensor parameters (`torch_support.COMPILED_DTENSOR_STEPS_TORCH`), for optimizers of them."""
        self._uncompiled_update = (not compiles_dtensor_steps()
                                   and any(any_dtensor(group["params"]) for group in self.param_groups))

    def _log_routing(self, group: dict[str, Any]) -> None:
        """timm's `verbose`: where each parameter of a new group goes, and why (logged at INFO)."""
        for name, param in zip(param_names(group), group["params"]):
            if is_lazy(param):
                logger.info("parameter %s (not materialized yet, a lazy module's): routed at its first step", name)
                continue
            view = _view(group, param)
            if group["use_muon"] is not None:
                reason = f"use_muon={group['use_muon']} in its group"
            elif view is not None:
                reason = f"{view.batch} matrix(es) of {view.rows}x{view.cols}"
            else:
                reason = "not a matrix Muon trains (fewer than 2 dimensions, a side below 2, or aspect ratio > 128)"
            logger.info("parameter %s %s -> %s: %s", name, tuple(param.shape), "AdamW" if view is None else "Muon",
                        reason)

    def __repr__(self) -> str:
        """torch's listing of the groups, then what ns_dtype=None resolves to on each device, and why."""
        devices = {param.device for group in self.param_groups if group["ns_dtype"] is None
                   for param in group["params"] if self._uses_muon(group, param)}
        choices = [f"ns_dtype=None on {device}: {choice.dtype}, as {choice.reason}"
                   for device in sorted(devices, key=str) for choice in [ns_dtype_choice(device)]]
        listing = super().__repr__()
        return listing[:-1] + "".join(f"{choice}\n" for choice in choices) + listing[-1:]

    def _named_params(self) -> dict[str, Tensor]:
        return {name: param for group in self.param_groups
                for name, param in zip(group.get("param_names") or (), group["params"])}

    def _uses_muon(self, group: dict[str, Any], param: Tensor) -> bool:
        """Whether Muon steps `param` (not yet known of a lazy module's parameter before its first forward)."""
        return not is_lazy(param) and _view(group, param) is not None

    @staticmethod
    def _adamw_lr(group: dict[str, Any]) -> float | Tensor:
        return learning_rate(group["lr"]) * as_real(group["adamw_lr_scale"])

    def _check_step_inputs(self, group: dict[str, Any], option_keys: tuple[str, ...]
                           ) -> tuple[KeptOptions | None, tuple[list[MuonTensors], list[AdamWTensors]] | None]:
        """What a step of this group needs, checked before any group creates state or updates a parameter: a group
        value may have been changed since construction, and a gradient may be of a kind Muon refuses. Returns what
        steps keep from the group's options, or None where they keep nothing (`_checked_options`), and the group's
        items held from an earlier step where they still hold (`HeldItems`, whatever options other than the layout's
        changed; a gradient sparse, or of another dtype or shape than its parameter held, ends the hold)."""
        kept = self._checked_options(group, option_keys)
        # Not while tracing (dynamo up to torch 2.11 cannot trace id() of a dict): a compiled step gathers each time.
        held = None if torch.compiler.is_compiling() else self._held.get(id(group))
        held = None if held is None else held.items_for(group, self.state)
        if held is None:
            self._check_gradients(group)
            self._check_forced_muon(group)
            if not torch.compiler.is_compiling():
                # These read the state, which a compiled step's `_init_group` creates or converts eagerly as dynamo
                # traces: branching on it first, a retrace after the AdamW part's graph break diverged from the
                # first trace (SpeculationLogDivergence) when a parameter took its first gradient after compiling.
                self._check_state_shapes(group)
                self._check_normalization_state(group)
                self._check_spread_params(group)
        return kept, held

    def _checked_step_inputs(self, option_keys: tuple[str, ...]
                             ) -> list[tuple[KeptOptions | None, tuple[list[MuonTensors], list[AdamWTensors]] | None]]:
        """`_check_step_inputs` of every group. Outside torch.compile, a refusal puts back the groups whose keys
        `_checked_options` re-entered, so that a refused step leaves every group as it was, a later group's refusal
        included (a compiled step re-enters them before it traces them: `_reenter_groups_`)."""
        if torch.compiler.is_compiling():
            if any(map(needs_reentry, self.param_groups)):
                self._reenter_groups_()
            return [self._check_step_inputs(group, option_keys) for group in self.param_groups]
        self._groups_before_reentry: list[tuple[dict[str, Any], dict[str, Any]]] = []
        try:
            return [self._check_step_inputs(group, option_keys) for group in self.param_groups]
        except Exception:
            put_back_(self._groups_before_reentry)
            raise

    @staticmethod
    def _check_gradients(group: dict[str, Any]) -> None:
        """Gradients Muon can take: dense, real, of their floating-point parameter's shape and dtype (as autograd
        makes them; one put in through `.data` or set by hand could be neither, and would be refused only by an update
        part way through the step)."""
        for param in group["params"]:
            grad = param.grad
            if grad is None or not (grad.is_sparse or grad.is_complex() or not param.is_floating_point()
                                    or grad.dtype != param.dtype or grad.shape != param.shape):
                continue
            if grad.is_sparse:
                raise RuntimeError(f"Muon does not support sparse gradients (parameter of shape {tuple(param.shape)})")
            if grad.is_complex() or param.is_complex():
                raise RuntimeError(f"Muon does not support complex parameters (shape {tuple(param.shape)})")
            if not param.is_floating_point():
                raise RuntimeError(f"Invalid parameter: a {param.dtype} parameter of shape {tuple(param.shape)} has a "
                                   "gradient (expected a floating-point parameter)")
            raise RuntimeError(f"Invalid gradient: a {grad.dtype} gradient of shape {tuple(grad.shape)} for the "
                               f"{param.dtype} parameter of shape {tuple(param.shape)} (expected its shape and dtype)")

    def _check_state_shapes(self, group: dict[str, Any]) -> None:
        """State that fits each parameter that steps: one resized in place (`param.data = ...`) since its state was
        made would have its update refused by a kernel part way through the step, and state of a DTensor parameter
        placed otherwise (or a plain tensor) paired with its shards."""
        for name, param in zip(param_names(group), group["params"]):
            state = self.state.get(param)
            misshapen = None if not state or param.grad is None else misshapen_state(state, param.shape)
            if misshapen is not None:
                key, found, expected = misshapen
                raise RuntimeError(f"Invalid state: {key!r} of parameter {name} is {found}, expected {expected} for "
                                   f"the parameter's shape {tuple(param.shape)} (resized since its state was made? "
                                   "`del optimizer.state[param]` restarts it, or load a state of its new shape)")
            misplaced = None if not state or param.grad is None else misplaced_state(state, param)
            if misplaced is not None:
                key, found, expected = misplaced
                raise RuntimeError(f"Invalid state: {key!r} of parameter {name} is {found}, expected {expected}, as "
                                   "its parameter is laid out (each rank would step another block of it than its "
                                   "parameter's)")

    def _check_spread_params(self, group: dict[str, Any]) -> None:
        """DTensor parameters a distributed update can spread (`check_spread_param`): it runs group by group and
        chunk by chunk, so what it refuses part way through is asked of every parameter first."""
        for param in group["params"]:
            if param.grad is not None and is_dtensor(param) and self._uses_muon(group, param):
                check_spread_param(param)

    @staticmethod
    def _check_forced_muon(group: dict[str, Any]) -> None:
        """A group that forces its parameters into Muon (`use_muon=True`, also when set since they were added) holds
        only matrices or stacks of them."""
        if group["use_muon"] is not True:
            return
        for name, param in zip(param_names(group), group["params"]):
            if not is_lazy(param):  # checked at the step that finds it materialized
                check_forced_muon(name, param.shape)

    @torch.compiler.disable
    def _reenter_groups_(self) -> None:
        """A compiled step's re-entry of the groups that need it, run eagerly (a graph break, so a `fullgraph=True`
        step refuses such a group) and put back if any group refuses its options, as an eager step's: traced, the
        write into a group made dynamo write back every key it traced, its own `capturable=True` included."""
        before = [(group, dict(group)) for group in self.param_groups if needs_reentry(group)]
        try:
            for group, _ in before:
                reenter_(group)
            for group in self.param_groups:
                validate_group(group, at_step=True)
        except Exception:
            put_back_(before)
            raise

    def _checked_options(self, group: dict[str, Any], option_keys: tuple[str, ...]) -> KeptOptions | None:
        """The group's options checked (`validate_group`), unless they are the very objects the last step checked;
        what steps keep from them, or None where an option may change in place (a list, a tensor lr) or a
        torch.compile trace runs (whose guards watch the options)."""
        if torch.compiler.is_compiling():
            validate_group(group, at_step=True)
            return None
        options = operator.itemgetter(*option_keys)(group)  # a third of a generator's time: once per group a step
        kept = self._kept.get(id(group))
        if kept is not None and kept.holds(group, options):
            return kept
        if needs_reentry(group):
            self._groups_before_reentry.append((group, dict(group)))
            reenter_(group)
            options = operator.itemgetter(*option_keys)(group)
        validate_group(group, at_step=True)
        return KeptOptions.of(group, options)

    def _graph_capture_health_check(self) -> None:
        """torch's check that a captured step has capturable=True in every group, under its current name: the older
        `_cuda_graph_capture_health_check` warns when called, which a compiled step cannot trace."""
        # Asked of the class, whose answer a compiler folds (torch 2.11's cannot branch on a bound method's truth).
        if hasattr(Optimizer, "_accelerator_graph_capture_health_check"):
            self._accelerator_graph_capture_health_check()
        else:
            self._cuda_graph_capture_health_check()

    def _check_normalization_state(self, group: dict[str, Any]) -> None:
        """A second moment kept from an earlier run must have the shape this group's normalization needs (it changes
        between "neuron" and "element")."""
        if group["normalization"] is None:
            return
        for param in group["params"]:
            view = None if param.grad is None else _view(group, param)
            if view is None:
                continue
            saved = self.state.get(param, {}).get("update_sq")  # never made here: a refused step makes no state
            expected = second_moment_shape(param.shape, view, group["normalization"])
            if saved is not None and tuple(saved.shape) != expected:
                raise ValueError(f"Invalid normalization: {group['normalization']!r} needs a second moment of shape "
                                 f"{expected} for the parameter of shape {tuple(param.shape)}, but its state holds "
                                 f"{tuple(saved.shape)} (from another normalization: delete state['update_sq'] and "
                                 "state['update_step'] to start it afresh)")

    def _init_group(self, group: dict[str, Any], state_tensors: list[Tensor | None]) -> None:
        """The state of the group's parameters with gradients, made ready for this step (`_prepared_state`), and
        listed in `state_tensors` (`MUON_STATE`, `ADAMW_STATE`) for `_gather`. The name is torch's optimizers' own:
        torch.compile runs a method so named eagerly while it traces `step`, takes the state it leaves as fixed
        addresses, and the tensors it appends to a list argument as the graph's inputs; the state dict itself the
        tracer keeps as the first group's call left it, so a step of several groups reads its state from the lists
        (read from the dict, the first step of two groups under fullgraph=True raised a KeyError). A CUDA graph of the
        step then updates that state in place; created inside the graph instead, it would be among the graph's
        outputs, which the next replay overwrites."""
        muon_keys, adamw_keys = state_keys(group, MUON_STATE), state_keys(group, ADAMW_STATE)
        for param in group["params"]:
            if param.grad is not None:
                view = _view(group, param)
                state = self._prepared_state(group, param, view)
                keys = muon_keys if view is not None else adamw_keys
                state_tensors.extend(map(state.get, param_state_keys(keys, state)))

    def _gather(self, group: dict[str, Any], state_tensors: list[Tensor | None],
                hold: bool) -> tuple[list[MuonTensors], list[AdamWTensors]]:
        """The group's parameters with gradients, with their state as `_init_group` listed it; with `hold`, held for
        the next steps (`HeldItems`). With offload too: state is moved home (`keep_at_home`) only where it was made
        or loaded, as a new tensor, which ends the hold, and packing it at home (`offload.repack_homes`) keeps each
        tensor the same object."""
        muon_items: list[MuonTensors] = []
        adamw_items: list[AdamWTensors] = []
        entries: list[tuple[Tensor, torch.dtype, torch.Size, dict[str, Any] | None, tuple[str | None, ...],
                            tuple[Tensor | None, ...], MuonTensors | AdamWTensors | None]] = []
        # Not asked while torch.compile traces (`hold` False): dynamo warns at every cached function it traces.
        muon_keys, adamw_keys = ((state_keys(group, MUON_STATE), state_keys(group, ADAMW_STATE)) if hold
                                 else ((), ()))
        start = 0
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                entries.append((param, param.dtype, param.shape, None, (), (), None))
                continue
            view = _view(group, param)
            param_state = self.state[param] if hold else None
            if view is not None:
                keys, count = param_state_keys(muon_keys, param_state), len(MUON_STATE)
                momentum, skips, rounding_count, scales, second_moment, update_step = values = tuple(
                    state_tensors[start:start + count])
                item = MuonTensors(param, grad, momentum, skips, view, second_moment, update_step, rounding_count,
                                   scales)
                muon_items.append(item)
            else:
                keys, count = param_state_keys(adamw_keys, param_state), len(ADAMW_STATE)
                exp_avg, exp_avg_sq, step, skips, rounding_count, exp_avg_scales, exp_avg_sq_scales = values = tuple(
                    state_tensors[start:start + count])
                item = AdamWTensors(param, grad, exp_avg, exp_avg_sq, step, skips, rounding_count, exp_avg_scales,
                                    exp_avg_sq_scales)
                adamw_items.append(item)
            start += count
            entries.append((param, param.dtype, param.shape, param_state, keys, values, item))
        if hold:
            self._held[id(group)] = HeldItems(group["params"], tuple(map(group.get, LAYOUT_OPTIONS)), self.state,
                                              entries, muon_items, adamw_items)
        return muon_items, adamw_items

    def _prepared_state(self, group: dict[str, Any], param: Tensor, view: MatrixView | None) -> dict[str, Any]:
        """A parameter's state as this step needs it (`view`: its matrix view if Muon steps it, None for AdamW): created
        where missing, its moments in the group's state_dtype and contiguous, its counters in their own dtypes, and
        with offload, the moments in pinned host memory (where they are created or loaded, on its device). Returns
        it."""
        state = self.state[param]
        keep_own_dtypes(state, param.dtype)
        if "nonfinite_skips" not in state:
            state["nonfinite_skips"] = torch.zeros((), dtype=torch.int64, device=param.device)
        rounding_count = None
        if rounds_stochastically(group["state_dtype"]):
            if "rounding_count" not in state:
                state["rounding_count"] = torch.zeros((), dtype=torch.int64, device=param.device)
            rounding_count = state["rounding_count"]
        form = moment_form(param, group["state_dtype"])
        if view is not None:
            keep_moments(state, param, MUON_MOMENTS, form, rounding_count)
            if group["normalization"] is not None and "update_sq" not in state:
                state["update_sq"] = zeros_like_resized(
                    param, second_moment_shape(param.shape, view, group["normalization"]), moment_dtype(param.dtype))
                state["update_step"] = torch.zeros((), dtype=torch.float32, device=param.device)
        else:
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            keep_moments(state, param, ADAMW_MOMENTS, form, rounding_count)
        if self.offload is not None:
            keep_at_home(state, home_device(param, self.offload))
        return state

    def _muon_steps(self, parts: list[tuple[dict[str, Any], list[MuonTensors]]],
                    schedule: StagedUpdates | None) -> None:
        """Each group's Muon update (`_muon_step`), groups that share buckets in one call of each update; offloaded
        buckets go to `schedule`."""
        pending: _Pending = {}
        for group, items in parts:
            self._muon_step(group, items, pending, schedule)
        _run_pending(pending)

    def _muon_step(self, group: dict[str, Any], items: list[MuonTensors], pending: _Pending,
                   schedule: StagedUpdates | None) -> None:
        """One group's Muon update, added to `pending` (an update and the groups' settings and items it takes): its
        parameters spread over ranks for `distributed_muon_update`, its local ones for `staged_muon_update`, each
        under a key equal for groups whose updates differ only in lr and weight decay (layer-wise lr decay: a group
        per block), so that their same-shape matrices share buckets, and spread over ranks, the owners' plan and
        its collectives. GPT-2 small's structure at 1/96 width with a group per block took 1.76x torch.optim.Muon's
        step time a group at a time (2-core Xeon). Some groups go alone (`_shares_updates`)."""
        if not items:
            return
        settings = self._muon_settings(group, items[0].param.device)
        spread: list[MuonTensors] = []
        local: list[MuonTensors] = []
        for item in items:
            (spread if is_spread(item.param, self.process_group) else local).append(item)
        if spread:
            self._pend(pending, distributed_muon_update, spread, process_group=self.process_group,
                       comm_dtype=group["comm_dtype"], chunk_size=as_integer(group["chunk_size"]), schedule=schedule,
                       **settings)
        if local:
            self._pend(pending, staged_muon_update, local, workspace=self._workspace, schedule=schedule, **settings)

    def _muon_settings(self, group: dict[str, Any], device: torch.device) -> dict[str, Any]:
        """`_muon_settings` of the group, kept with its options where they are (`KeptOptions`)."""
        kept = None if torch.compiler.is_compiling() else self._kept.get(id(group))
        if kept is None:
            return _muon_settings(group, device)
        settings = kept.muon_settings.get(device)
        if settings is None:
            settings = kept.muon_settings[device] = _muon_settings(group, device)
        return settings

    def _pend(self, pending: _Pending, update: Callable[..., None], items: list[MuonTensors] | list[AdamWTensors],
              **settings: Any) -> None:
        """`items` for `update` with `settings`, with the items of other groups whose settings differ only in the
        rates, or alone: under a key no other takes (the count of keys so far; dynamo up to torch 2.11 cannot trace
        `id` of a list, which failed every compiled step with a tensor lr on an H100)."""
        key = (update, *_shared_update_key(settings)) if self._shares_updates(settings) else (len(pending),)
        pending.setdefault(key, (update, []))[1].append((settings, items))

    def _shares_updates(self, settings: dict[str, Any]) -> bool:
        """Whether a group's parameters may share update calls with other groups': not with a tensor lr (kept a
        tensor to the update), nor while a CUDA graph is captured from an eager step, whose replays would read the
        per-item decay factors from host memory freed after the capture (`functional._on_device`; a compiled step
        holds them as constants)."""
        if isinstance(settings["lr"], Tensor):
            return False
        # is_compiling first: the tracer folds it to True and reads nothing after it.
        return torch.compiler.is_compiling() or not (torch.cuda.is_available()
                                                     and torch.cuda.is_current_stream_capturing())

    # torch's fused AdamW kernel cannot go into a compiled graph (inductor cannot lower it; torch keeps it out of its
    # own): the whole AdamW part runs eagerly, one break per step, outside any loop a compiled step must keep.
    @torch.compiler.disable
    def _adamw_steps(self, groups: list[tuple[dict[str, Any], list[AdamWTensors]]],
                     schedule: StagedUpdates | None) -> None:
        """Each group's AdamW update (`_adamw_step`), groups that differ only in lr and weight decay in one update:
        GPT-2 small's structure at 1/384 width with a param group per block took 2.10-2.17 ms a step with an update
        per group, 2.00-2.04 shared (2-core Xeon); on a GPU each update is three Triton launches. Offloaded groups
        of parameters go to `schedule`."""
        try:
            pending: _Pending = {}
            for group, items in groups:
                self._adamw_step(group, items, pending, schedule)
            _run_pending(pending)
        finally:
            self._checked_gradients = None  # one step's worth: the next clip checks afresh

    def _adamw_step(self, group: dict[str, Any], items: list[AdamWTensors], pending: _Pending,
                    schedule: StagedUpdates | None) -> None:
        """One group's AdamW update, added to `pending` as `_muon_step` adds its Muon update."""
        weight_decay = group["adamw_weight_decay"]
        self._pend(pending, self._adamw_update, items, schedule=schedule, lr=self._adamw_lr(group),
                   betas=tuple(map(as_real, group["adamw_betas"])), eps=as_real(group["adamw_eps"]),
                   weight_decay=as_real(group["weight_decay"] if weight_decay is None else weight_decay))

    def _adamw_update(self, items: list[AdamWTensors], *, schedule: StagedUpdates | None, **settings: Any) -> None:
        """The AdamW update of items whose `lr` and `weight_decay` are one for all or one per item."""
        rates = Rates(items, settings["lr"], settings["weight_decay"])
        for device_items in by_device(items).values():
            device_settings = rates.settings_for(device_items, settings)  # by the items, before shards replace them
            # Whether each gradient is finite, on every rank for a DTensor: a question for the distributed layer,
            # unless clip_grad_norm_ found out while it read them; plain gradients are checked by the update itself.
            # The update is elementwise: each rank runs it on its own shards, as plain tensors.
            checked = self._checked_gradients
            grads = [item.grad for item in device_items]
            spread = any_dtensor(grads)
            found_inf = None if checked is None else checked.found_inf([item.param for item in device_items])
            if found_inf is None and spread:
                found_inf = found_inf_flags(grads)
            if spread:
                device_items = [_local_adamw_item(item) for item in device_items]
            staged_adamw_update(device_items, found_inf, schedule=schedule, **device_settings)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None,
             qk_logits: Mapping[Hashable, Tensor] | None = None) -> float | None:  # type: ignore[override]
        """One optimization step. `closure` re-evaluates the model and returns the loss.

        `qk_logits` (with `qk_clip` configured): layer key -> the largest attention logit of each query head seen in
        this step's forward pass, shape (num_heads,), as compared with the threshold (Kimi includes the softmax
        scale 1/sqrt(head_dim)). After the update, heads above `qk_clip_threshold` get their query and key rows
        scaled down so their logits would fall to it; see `qk_clip.py`. Under data parallelism the logits are
        reduced with MAX over the ranks first, so every rank must pass the same keys.
        """
        if self.process_group is _PROCESS_GROUP_NOT_SAVED:
            raise RuntimeError("Invalid process_group: this optimizer was copied or unpickled, and a process group "
                               "cannot be saved; set `optimizer.process_group = <the group>` (or None) before step()")
        self._graph_capture_health_check()
        qk_logits = {} if qk_logits is None else qk_logits
        check_qk_logits(self.qk_clip, qk_logits)  # before any update: bad input changes nothing
        self._check_clipped_layouts(qk_logits)
        threshold = check_threshold(self.qk_clip_threshold) if qk_logits else None  # an attribute, settable
        loss = None
        if closure is not None:  # under the caller's autocast, as torch's optimizers run it
            with torch.enable_grad():
                loss = closure()
        if self._uncompiled_update and torch.compiler.is_compiling():
            warnings.warn(f"Muon: torch {torch.__version__}'s compiler cannot trace a step over DTensor parameters, so "
                          f"under torch.compile the update runs uncompiled (torch >= "
                          f"{release_name(COMPILED_DTENSOR_STEPS_TORCH)} compiles it)", stacklevel=2)
            self._update_eagerly(qk_logits, threshold)
        else:
            self._update(qk_logits, threshold)
        return loss

    def _check_clipped_layouts(self, qk_logits: Mapping[Hashable, Tensor]) -> None:
        """QK-clip scales the head rows of projections stored (out, in); one in a group with param_layout
        "transposed" is stored (in, out), and the clip would scale its input columns instead."""
        if not qk_logits:  # every step asks: no work on the steps that clip nothing
            return
        stored_in_out = [group["params"] for group in self.param_groups if group["param_layout"] == "transposed"]
        for name in qk_logits:
            for field in ("query", "key"):
                weight = getattr(self.qk_clip[name], field)
                if any(param is weight for params in stored_in_out for param in params):
                    raise ValueError(f"Invalid qk_clip[{name!r}].{field}: its group has param_layout='transposed' "
                                     "(a weight stored (in, out)), and QK-clip scales the head rows of projections "
                                     "stored (out, in)")

    @torch.compiler.disable
    def _update_eagerly(self, qk_logits: Mapping[Hashable, Tensor], threshold: float | None) -> None:
        """`_update`, a graph break under torch.compile (see `_note_compile_support`)."""
        self._update(qk_logits, threshold)

    @without_autocast
    def _update(self, qk_logits: Mapping[Hashable, Tensor], threshold: float | None) -> None:
        """The step's update of every group, and the QK-clip after it."""
        option_keys = tuple(self.defaults)
        kept, held = zip(*self._checked_step_inputs(option_keys))
        # Not while tracing: dynamo in torch 2.11 cannot set an attribute of the optimizer (2.13's can), nor trace id()
        # of a dict. Kept entries stay valid across compiled steps: each holds only while its options are the same.
        hold = not torch.compiler.is_compiling()
        if hold:
            self._kept = {id(group): each for group, each in zip(self.param_groups, kept) if each is not None}
        state_tensors: list[list[Tensor | None]] = [[] for _ in self.param_groups]
        for group, tensors, items in zip(self.param_groups, state_tensors, held):
            if items is None:
                if hold:  # the held state goes before new state is made: after `state.clear()` a step held both
                    self._held.pop(id(group), None)
                self._init_group(group, tensors)
        gathered = [self._gather(group, tensors, hold) if items is None else items
                    for group, tensors, items in zip(self.param_groups, state_tensors, held)]
        # Offloaded updates run once both parts have issued theirs, so that all their state streams in one schedule.
        schedule = self._staged_updates if self.offload is not None else None
        self._muon_steps([(group, muon_items) for group, (muon_items, _) in zip(self.param_groups, gathered)], schedule)
        adamw_groups = [(group, adamw_items) for group, (_, adamw_items) in zip(self.param_groups, gathered)
                        if adamw_items]
        if adamw_groups:
            self._adamw_steps(adamw_groups, schedule)
        if schedule is not None:
            schedule.run()
        if qk_logits:
            clip_checked_(self.qk_clip, qk_logits, threshold, self.process_group)
        if hold:  # and the held items of groups no longer in the optimizer go
            self._held = {id(group): self._held[id(group)] for group in self.param_groups if id(group) in self._held}
            for each in self._held.values():
                each.release_gradients()
                if each.addresses is None:
                    each.note_addresses()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> Tensor:
        """`torch.nn.utils.clip_grad_norm_` over this optimizer's parameters: scales their gradients in place so
        that their total norm is at most `max_norm` (`math.inf`: only measure it), and returns the total norm.

        Plain tensors on one device are read once each, for their norm and for whether they are finite, and the
        next `step()` takes those flags for its AdamW-routed parameters instead of reading their gradients again; a
        gradient replaced or changed in place since is read again. For the L2 norm on the CPU (with the compiled
        ops) the total is accumulated in float64 (float32 result, float64 for float64 gradients); elsewhere it is
        torch's, from torch's per-gradient norms (`clipping.clip_by_tensor_norms_`). DTensor gradients, gradients on
        several devices and, where the compiled ops do not serve, `foreach=False` go to torch's function."""
        max_norm = check_max_norm(max_norm)
        params = [param for group in self.param_groups for param in group["params"] if param.grad is not None]
        grads = [param.grad for param in params]
        self._checked_gradients = None
        if reads_once(grads, norm_type):
            total, nonfinite = clip_grad_norm_(grads, max_norm, error_if_nonfinite)
        elif foreach is not False and tensor_norms_serve(grads):
            total, nonfinite = clip_by_tensor_norms_(grads, max_norm, float(norm_type), error_if_nonfinite)
        else:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
        self._checked_gradients = CheckedGradients(params, nonfinite)
        return total

    def nonfinite_skips(self) -> int:
        """How many parameter updates were skipped because a gradient had a NaN or Inf (syncs with the device)."""
        return int(sum(int(state["nonfinite_skips"]) for state in self.state.values() if "nonfinite_skips" in state))

    @contextlib.contextmanager
    def _hooks_held(self, *attributes: str) -> Iterator[tuple[OrderedDict, ...]]:
        """Torch's hooks of these kinds kept from running inside torch's method, which we wrap to run them ourselves
        where they belong; yields them. Put back as the same dict objects, so their removal handles still work."""
        held = tuple(getattr(self, attribute) for attribute in attributes)
        for attribute in attributes:
            setattr(self, attribute, OrderedDict())
        try:
            yield held
        finally:
            for attribute, hooks in zip(attributes, held):
                setattr(self, attribute, hooks)

    def state_dict(self) -> dict[str, Any]:
        # torch's, with the dtype options by name (`_DTYPE_OPTIONS`) before the post-hooks see it, so that a hook sees
        # what a checkpoint will hold.
        with self._hooks_held("_optimizer_state_dict_post_hooks") as (post_hooks,):
            state_dict = super().state_dict()
        state_dict = {**state_dict, "param_groups": list(map(dtypes_named, state_dict["param_groups"]))}
        for hook in post_hooks.values():
            adapted = hook(self, state_dict)
            if adapted is not None:
                state_dict = adapted
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The load pre-hooks run first, as in torch, so that a hook can adapt a checkpoint (rename parameters,
        # reshape state) before the matching and checks below see it; torch's own pass over them is then skipped.
        state_dict = state_dict.copy()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            adapted = hook(self, state_dict)
            if adapted is not None:
                state_dict = adapted
        check_group_sizes(state_dict["param_groups"], self.param_groups)
        # A checkpoint from before an option existed lacks its key: the option's default applies, as torch
        # optimizers' __setstate__ does. A saved group enters as a group given those keys between steps would at the
        # next step. Every loaded group is checked before anything is loaded.
        state_dict = {**state_dict, "param_groups": [reentered(dtypes_from_names(saved), self.defaults["lr"])
                                                     for saved in state_dict["param_groups"]]}
        state_dict = aligned_by_name(state_dict, self.param_groups)
        state_dict = {**state_dict, "state": {saved_id: codes_under_their_keys(saved)
                                              for saved_id, saved in state_dict["state"].items()}}
        state_dict = {**state_dict, "param_groups": [{**self.defaults, **saved}
                                                     for saved in state_dict["param_groups"]]}
        for saved, group in zip(state_dict["param_groups"], self.param_groups):
            validate_group(saved)
            self._check_forced_muon({**saved, "params": group["params"]})
        check_saved_state(state_dict, self.param_groups)
        # The post-hooks run last, as in torch, on the state as loaded here (torch's pass casts what
        # `restore_state_dtypes_` restores; a hook's change made before it was overwritten). Out of inference mode:
        # state made under it would be inference tensors, which no later step could update.
        with self._hooks_held("_optimizer_load_state_dict_pre_hooks",
                              "_optimizer_load_state_dict_post_hooks") as (_, post_hooks), torch.inference_mode(False):
            super().load_state_dict(state_dict)
            restore_state_dtypes_(self.state, state_dict, self.param_groups)
        for hook in post_hooks.values():
            hook(self)
