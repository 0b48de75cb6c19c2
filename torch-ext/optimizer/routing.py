"""Which parameters Muon orthogonalizes, and how each one is viewed as a stack of matrices."""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy
from torch.nn.utils import parametrize

ConvMode = Literal["flatten", "batched"]
ParamLayout = Literal["auto", "conv", "experts", "transposed"]
CONV_MODES: tuple[str, ...] = ("flatten", "batched")
PARAM_LAYOUTS: tuple[str, ...] = ("auto", "conv", "experts", "transposed")

# A matrix this much longer than it is wide is closer to a list of vectors than to a linear map; timm routes such
# shapes to AdamW by default, and so do we (forcing `use_muon=True` still orthogonalizes it).
MAX_ASPECT_RATIO = 128


@dataclass(frozen=True)
class MatrixView:
    """How one parameter is seen by Newton-Schulz: `batch` matrices of shape (rows, cols).

    `to_matrices` / `from_matrices` convert between the parameter's own layout and the (batch, rows, cols) stack.
    In that layout, a matrix row runs along `column_dims`, and `row_dim` says which row; the other dims only say
    which matrix.
    """

    batch: int
    rows: int
    cols: int
    spatial_batched: bool  # conv "batched" mode: one (out, in) matrix per kernel position
    row_dim: int
    column_dims: tuple[int, ...]
    transposed: bool = False  # stored (..., in, out): each matrix is the transpose of its last two dims

    @property
    def is_reshape(self) -> bool:
        """Whether the (batch, rows, cols) stack is the parameter's memory reshaped, so that one is a view of the
        other."""
        return not (self.spatial_batched or self.transposed)

    def batch_dims(self, ndim: int) -> tuple[int, ...]:
        """The parameter dims that only say which of the matrices an element is in."""
        return tuple(dim for dim in range(ndim) if dim != self.row_dim and dim not in self.column_dims)

    def to_matrices(self, tensor: Tensor) -> Tensor:
        if self.spatial_batched:
            return tensor.flatten(2).permute(2, 0, 1)
        if self.transposed:
            return tensor.reshape(self.batch, self.cols, self.rows).mT
        return tensor.reshape(self.batch, self.rows, self.cols)

    def from_matrices(self, matrices: Tensor, shape: torch.Size) -> Tensor:
        if self.spatial_batched:
            return matrices.permute(1, 2, 0).reshape(shape)
        if self.transposed:
            return matrices.mT.contiguous().reshape(shape)
        return matrices.reshape(shape)


def matrix_view(shape: torch.Size, layout: str = "auto", conv_mode: str = "flatten") -> MatrixView:
    """The matrix view of a parameter of `shape` (ndim >= 2).

    2D: one matrix. 3D: a bank of experts (E, out, in) unless `layout == "conv"` (a Conv1d weight).
    4D/5D (or `layout == "conv"`): a conv weight (out, in, *kernel), flattened to (out, in * k) or, in conv_mode
    "batched", one (out, in) matrix per kernel position. `layout == "experts"`: every leading dim is a batch dim.
    `layout == "transposed"`: as "experts", with each matrix stored as (in, out) (transformers' Conv1D, the expert
    weights of some MoE layers), so that its rows (output neurons) are the last dim.
    """
    if len(shape) < 2:
        raise ValueError(f"Muon needs a parameter with at least 2 dimensions, got shape {tuple(shape)}")
    if layout == "transposed":
        return MatrixView(int(torch.Size(shape[:-2]).numel()), shape[-1], shape[-2], False, len(shape) - 1,
                          (len(shape) - 2,), transposed=True)
    if len(shape) == 2:
        return MatrixView(1, shape[0], shape[1], False, 0, (1,))
    is_conv = layout == "conv" or (layout == "auto" and len(shape) >= 4)
    if not is_conv:
        return MatrixView(int(torch.Size(shape[:-2]).numel()), shape[-2], shape[-1], False, len(shape) - 2,
                          (len(shape) - 1,))
    out_channels, in_channels = shape[0], shape[1]
    kernel_size = int(torch.Size(shape[2:]).numel())
    if conv_mode == "batched":
        return MatrixView(kernel_size, out_channels, in_channels, True, 0, (1,))
    return MatrixView(1, out_channels, in_channels * kernel_size, False, 0, tuple(range(1, len(shape))))


def suits_muon(shape: torch.Size, layout: str = "auto", conv_mode: str = "flatten") -> bool:
    """Shape routing when a group does not say: matrices that are not degenerate go to Muon, the rest to AdamW."""
    if len(shape) < 2 or 0 in shape:
        return False
    view = matrix_view(shape, layout, conv_mode)
    short, long = min(view.rows, view.cols), max(view.rows, view.cols)  # not sorted(): dynamo cannot sort SymInts
    return short >= 2 and long <= MAX_ASPECT_RATIO * short


def muon_view(shape: torch.Size, use_muon: bool | None, layout: str = "auto",
              conv_mode: str = "flatten") -> MatrixView | None:
    """The matrix view Muon steps a parameter of `shape` in, or None where AdamW steps it: a group's `use_muon`,
    else `suits_muon`. Kept per shape and options outside torch.compile (whose tracer warns on a cached function):
    a step asks it of every parameter twice, and working it out took ~1 µs each on a 2-core Xeon."""
    if torch.compiler.is_compiling():
        return _muon_view(shape, use_muon, layout, conv_mode)
    return _kept_muon_view(shape, use_muon, layout, conv_mode)


def _muon_view(shape: torch.Size, use_muon: bool | None, layout: str, conv_mode: str) -> MatrixView | None:
    if use_muon is False or (use_muon is None and not suits_muon(shape, layout, conv_mode)):
        return None
    return matrix_view(shape, layout, conv_mode)


_kept_muon_view = functools.lru_cache(maxsize=4096)(_muon_view)


def check_forced_muon(name: str, shape: torch.Size) -> None:
    """A parameter a group forces into Muon (`use_muon=True`) must be a matrix or a stack of them."""
    if len(shape) < 2:
        raise ValueError(
            f"use_muon=True for parameter {name} of shape {tuple(shape)}: Muon orthogonalizes matrices and needs "
            "at least 2 dimensions; leave use_muon unset (or False) to train it with AdamW"
        )
    if 0 in shape:
        raise ValueError(f"use_muon=True for parameter {name} of shape {tuple(shape)}: it has no elements")


# --- model-aware default groups ------------------------------------------------------------------------------

_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)
_HEAD_NAMES = ("lm_head", "output", "head", "classifier")


def _trained_weights(module: nn.Module) -> list[Tensor]:
    """The tensors a module's weight is trained as: the weight, or where it is computed from others, those, which
    are what the optimizer sees (reading `module.weight` there computes a new tensor): a parametrization's
    originals (weight_norm, spectral_norm, orthogonal from torch.nn.utils.parametrizations), and a forward hook's
    `weight_*` parameters (torch.nn.utils.prune's `weight_orig`, the older torch.nn.utils.weight_norm's `weight_g`
    and `weight_v`)."""
    if parametrize.is_parametrized(module, "weight"):
        return list(module.parametrizations.weight.parameters())
    if "weight" in module._parameters:
        return [module.weight]
    return [param for name, param in module.named_parameters(recurse=False) if name.startswith("weight_")]


def _owner(module_name: str, module: nn.Module, modules: dict[str, nn.Module]) -> nn.Module:
    """The module whose parameters these are: for a parametrization's originals, the module it parametrizes."""
    if isinstance(module, parametrize.ParametrizationList):  # named "<owner>.parametrizations.<tensor name>"
        return modules[".".join(module_name.split(".")[:-2])]
    return module


def _is_output_head(name: str, module: nn.Module, embedding_weights: set[int], last_linear: nn.Module | None,
                    vocab_sizes: set[int]) -> bool:
    if not isinstance(module, nn.Linear):
        return False
    if any(id(weight) in embedding_weights for weight in _trained_weights(module)):  # tied with an input embedding
        return True
    if name.rsplit(".", 1)[-1] in _HEAD_NAMES:
        return True
    return module is last_linear and module.out_features in vocab_sizes


def _stores_in_out(module: nn.Module, param: Tensor) -> bool:
    """Matrices stored (in, out), as transformers keeps two kinds: its Conv1D (GPT-2 and its kin), a linear map whose
    weight is `nx` by `nf`, and the expert banks of its experts modules marked `is_transposed` (GPT-OSS's, (E, in,
    out)). Told by names and sizes, not by type, so that transformers need not be imported or installed."""
    if type(module).__name__ == "Conv1D" and param.ndim == 2:
        return (getattr(module, "nx", None), getattr(module, "nf", None)) == tuple(param.shape)
    return getattr(module, "is_transposed", None) is True and param.ndim >= 3


def _is_bias(param_name: str) -> bool:
    """A bias by its name, whatever its shape: an expert bank's biases (GPT-OSS's `gate_up_proj_bias`, (E, out)) and a
    relative position bias table (Swin's, (positions, heads)) are matrices by shape alone."""
    return "bias" in param_name.split("_")


def _is_learned_token(param_name: str) -> bool:
    """A module's own tensor (not a layer's `weight`) named as an embedding or a token: a ViT's position embeddings
    and class token, (1, N, D) and (1, 1, D), added to its activations, not multiplied by them."""
    return param_name != "weight" and ("embed" in param_name or param_name.endswith(("token", "tokens")))


def _declared_no_decay(model: nn.Module) -> tuple[str, ...]:
    """The names (fnmatch patterns) the model's `no_weight_decay()` gives, timm's convention for what is not a weight
    (position embeddings, class tokens, bias tables); none where it has no such method."""
    declared = getattr(model, "no_weight_decay", None)
    return tuple(str(name) for name in declared()) if callable(declared) else ()


def _classify(model: nn.Module) -> Iterator[tuple[str, Tensor, str]]:
    """Yields (name, parameter, role) with role in {"matrix", "matrix_conv1d", "matrix_transposed", "adamw",
    "adamw_no_decay"}: a matrix's route, Muon or AdamW, is its shape's under the group's options, decided at each
    step."""
    modules = dict(model.named_modules())
    embeddings = [m for m in modules.values() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    embedding_weights = {id(weight) for m in embeddings for weight in _trained_weights(m)}
    vocab_sizes = {m.num_embeddings for m in embeddings}
    linears = [m for m in modules.values() if isinstance(m, nn.Linear)]
    last_linear = linears[-1] if linears else None
    heads = {id(weight) for name, m in modules.items()
             if _is_output_head(name, m, embedding_weights, last_linear, vocab_sizes) for weight in _trained_weights(m)}
    no_decay = _declared_no_decay(model)
    for module_name, module in modules.items():
        owner = _owner(module_name, module, modules)
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if is_lazy(param):
                raise ValueError(
                    f"muon_param_groups: parameter {name} is not materialized yet (a lazy module's), so its role is "
                    "unknown: run one forward pass first, or give Muon model.parameters(), which routes each "
                    "parameter by its shape at its first step")
            declared = (getattr(param, "_no_weight_decay", False) is True  # mamba_ssm marks its A_log and D so
                        or any(fnmatch.fnmatchcase(name, pattern) for pattern in no_decay))
            if (isinstance(owner, _NORM_TYPES) or param.ndim < 2 or _is_bias(param_name)
                    or _is_learned_token(param_name) or declared):
                role = "adamw_no_decay"
            elif id(param) in embedding_weights or id(param) in heads:
                role = "adamw"
            elif isinstance(owner, (nn.Conv1d, nn.ConvTranspose1d)):  # 3D: read as (out, in * k), not as experts
                role = "matrix_conv1d"
            elif _stores_in_out(owner, param):
                role = "matrix_transposed"
            else:
                role = "matrix"
            yield name, param, role


def muon_param_groups(model: nn.Module, **overrides: Any) -> list[dict[str, Any]]:
    """Default parameter groups for `Muon`, decided from each parameter's module and name.

    Muon: hidden matrices (Linear, conv, 3D expert banks; transformers' Conv1D and expert banks its experts modules
    mark `is_transposed`, stored (in, out), with param_layout="transposed"), routed by their shape at each step
    under the group's conv_mode (a degenerate matrix view goes to AdamW). AdamW: `nn.Embedding` weights and the
    output head (a Linear named lm_head/output/head/classifier, one tied to an embedding, or the last Linear whose
    output size is a vocabulary size); AdamW without weight decay: norms, biases (by name, of any shape), a module's
    own embeddings and tokens (by name: pos_embed, cls_token), what the model's `no_weight_decay()` names (timm's
    convention) or a tensor's `_no_weight_decay = True` marks (mamba_ssm's) and other 1D/scalar parameters. A weight
    computed from others (a parametrization, a pruning or weight_norm hook) is trained as those, routed as the
    weight would be. `overrides` (any Muon option: lr, weight_decay, conv_mode, adamw_lr_scale, ...) are set on
    every group; the no-decay group keeps adamw_weight_decay=0; the routing keys are refused, since the groups are
    the routing. Shared (tied) parameters appear once. Frozen parameters (requires_grad=False) are left out, as
    timm's groups leave them (and the checkpoints of these groups expect): to train them once unfrozen, add their
    groups with `add_param_group`. Groups carry `param_names`, so state dicts are keyed readably.
    """
    routing_keys = sorted(set(overrides) & {"use_muon", "use_fallback", "param_layout"})
    if routing_keys:
        raise ValueError(f"muon_param_groups: {', '.join(routing_keys)} cannot be overridden, since the groups it "
                         "returns are the routing; set it on the returned groups instead")
    roles: dict[str, list[tuple[str, Tensor]]] = {}
    seen: set[int] = set()
    for name, param, role in _classify(model):
        if id(param) in seen or not param.requires_grad:
            continue
        seen.add(id(param))
        roles.setdefault(role, []).append((name, param))
    role_options: dict[str, dict[str, Any]] = {
        "matrix": {"use_muon": None, "param_layout": "auto"},
        "matrix_conv1d": {"use_muon": None, "param_layout": "conv"},
        "matrix_transposed": {"use_muon": None, "param_layout": "transposed"},
        "adamw": {"use_muon": False},
        "adamw_no_decay": {"use_muon": False, "adamw_weight_decay": 0.0},
    }
    return [
        {"params": roles[role], **overrides, **options}
        for role, options in role_options.items()
        if roles.get(role)
    ]
