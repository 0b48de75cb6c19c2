"""Muon for PyTorch: Newton-Schulz orthogonalized momentum for matrices, AdamW for the rest."""

from . import torch_support  # noqa: F401  first: it refuses an older torch than the package runs on
from .coefficients import polar_express_coefficients
from .dispatch import gram, kernel_choice
from .distributed.cost_model import DeviceModel, StepPlan, plan_step
from .muon import Muon
from .native import ops_summary
from .newton_schulz import zeropower
from .precision import NsDtypeChoice, default_ns_dtype, matrix_ns_dtype, ns_dtype_choice
from .qk_clip import QKClipLayer, qk_clip_
from .routing import muon_param_groups

__all__ = [
    "DeviceModel", "Muon", "NsDtypeChoice", "QKClipLayer", "StepPlan", "default_ns_dtype", "gram", "kernel_choice",
    "matrix_ns_dtype", "muon_param_groups", "ns_dtype_choice", "ops_summary", "plan_step", "polar_express_coefficients",
    "qk_clip_", "zeropower",
]
