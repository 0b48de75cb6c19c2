"""PyTorch's own error battery (`OptimizerInfo.optim_error_inputs_func` of AdamW and Muon in
torch/testing/_internal/common_optimizers.py), run on ours: the same exception type, raised at the same point, with a
message that matches torch's pattern, since that wording is what users search for. Cases for options we do not have
(`foreach`, `fused`) are left out; the ones where we deliberately differ are pinned below."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.testing._internal.common_optimizers import (ErrorOptimizerInput, OptimizerErrorEnum,
                                                       optim_error_inputs_func_adamw, optim_error_inputs_func_muon)

from conformance_support import Muon

# Our option for each torch option of the same meaning (AdamW's betas are the betas of our AdamW part).
OUR_NAME = {"betas": "adamw_betas"}
NOT_OURS = {"foreach", "fused", "differentiable", "capturable"}
# Deliberate differences, each pinned by a test below or in test_conformance_torch_muon.py.
DIFFERS = {"betas must be either both floats or both Tensors", "only support 2D parameters"}


def torch_error_cases() -> dict[str, ErrorOptimizerInput]:
    cases: dict[str, ErrorOptimizerInput] = {}
    for source in (optim_error_inputs_func_adamw, optim_error_inputs_func_muon):
        for case in source("cpu", torch.float32):
            kwargs = case.optimizer_error_input.kwargs
            if not NOT_OURS & set(kwargs) and case.optimizer_error_input.desc not in DIFFERS:
                cases.setdefault(f"{source.__name__.removeprefix('optim_error_inputs_func_')}: "
                                 f"{case.optimizer_error_input.desc}", case)
    return cases


CASES = torch_error_cases()


def construct_and_step(case: ErrorOptimizerInput) -> None:
    given = case.optimizer_error_input
    params = given.params if given.params is not None else [torch.nn.Parameter(torch.randn(2, 3))]
    kwargs: dict[str, Any] = {OUR_NAME.get(key, key): value for key, value in given.kwargs.items()}
    opt = Muon(params, **kwargs)
    if case.error_on == OptimizerErrorEnum.STEP_ERROR:
        opt.step()


def test_the_battery_is_there() -> None:
    assert len(CASES) >= 9, sorted(CASES)  # a torch upgrade that moved the cases must be looked at


@pytest.mark.parametrize("name", sorted(CASES))
def test_torchs_error_case_fails_as_torchs_does(name: str) -> None:
    case = CASES[name]
    if issubclass(case.error_type, Warning):
        with pytest.warns(case.error_type, match=case.error_regex):
            construct_and_step(case)
        return
    with pytest.raises(case.error_type, match=case.error_regex) as raised:
        construct_and_step(case)
    if case.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR:
        assert "step" not in {frame.name for frame in raised.traceback}


def test_betas_mixing_floats_and_tensors_are_taken_where_torch_refuses() -> None:
    # torch refuses because its foreach and capturable kernels take either kind, not both; our AdamW part reads
    # betas as numbers at each step, so a mix means what it says.
    param = torch.nn.Parameter(torch.randn(3))
    param.grad = torch.ones(3)
    reference = torch.nn.Parameter(param.detach().clone())
    reference.grad = torch.ones(3)
    with pytest.raises(ValueError, match="betas must be either both floats or both Tensors"):
        torch.optim.AdamW([reference], betas=(0.9, torch.tensor(0.99)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = Muon([param], lr=0.01, adamw_betas=(0.9, torch.tensor(0.99)))
        opt.step()
    expected = torch.optim.AdamW([reference], lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
    expected.step()
    torch.testing.assert_close(param, reference)
