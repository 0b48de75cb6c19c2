"""Muon for PyTorch: Newton-Schulz orthogonalized momentum for matrices, AdamW for the rest."""

from .coefficients import polar_express_coefficients
from .muon import Muon
from .native import ops_summary
from .newton_schulz import zeropower
from .routing import muon_param_groups

__all__ = ["Muon", "muon_param_groups", "ops_summary", "polar_express_coefficients", "zeropower"]
