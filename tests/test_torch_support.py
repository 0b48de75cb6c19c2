"""The torch releases the package accepts: older ones are refused at import, and distributed use below the
distributed floor, each naming the torch found and the one needed (README, "Which torch")."""

from __future__ import annotations

import re

import pytest
import torch
from kernel_under_test import optimizer, submodule

torch_support = submodule(optimizer, "torch_support")


@pytest.mark.parametrize("version, release", [("2.9.1", (2, 9)), ("2.15.0+cu132", (2, 15)),
                                              ("2.11.0a0+git1234abc", (2, 11)), ("10.0.0", (10, 0))])
def test_a_version_string_gives_its_release(version: str, release: tuple[int, int]) -> None:
    assert torch_support.torch_release(version) == release


def test_the_running_torch_is_accepted() -> None:
    torch_support.check_torch()  # the package imported above under it; the call must agree
    torch_support.check_distributed_torch("DTensor parameters")


@pytest.mark.parametrize("version", ["2.8.0", "2.7.1+cu126", "1.13.1"])
def test_an_older_torch_is_refused_at_import_naming_it(version: str) -> None:
    with pytest.raises(ImportError, match=re.escape(f"needs torch >= 2.9, but this is torch {version}:")):
        torch_support.check_torch(version)


@pytest.mark.parametrize("version", ["2.9.1", "2.10.0", "2.11.0", "2.15.0+cu132"])
def test_a_supported_torch_is_accepted(version: str) -> None:
    torch_support.check_torch(version)


def test_distributed_use_below_its_floor_is_refused_naming_what_and_the_versions() -> None:
    expected = r"DTensor parameters: supported from torch 2\.10 on .* this is torch 2\.9\.1"
    with pytest.raises(RuntimeError, match=expected):
        torch_support.check_distributed_torch("DTensor parameters", "2.9.1")
    torch_support.check_distributed_torch("DTensor parameters", "2.10.0")


def test_an_unrecognized_version_is_refused_naming_it() -> None:
    with pytest.raises(RuntimeError, match="'nightly'"):
        torch_support.torch_release("nightly")


def test_a_process_group_on_an_older_torch_is_refused_before_the_optimizer_exists(monkeypatch) -> None:
    muon = submodule(optimizer, "muon")
    monkeypatch.setattr(muon, "check_distributed_torch",
                        lambda what: torch_support.check_distributed_torch(what, "2.9.1"))
    with pytest.raises(RuntimeError, match="a process_group: supported from torch 2.10 on"):
        optimizer.Muon([torch.nn.Parameter(torch.randn(4, 4))], process_group=object())
