"""The torch releases the package accepts: older ones are refused at import, naming the torch found and the one
needed (README, "Which torch"); and what torch 2.9 does otherwise than later releases, which the step refuses or
avoids (tests/distributed: test_distributed_plan's strided runs, the compiled FSDP2 case)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from kernel_under_test import optimizer, submodule

torch_support = submodule(optimizer, "torch_support")


@pytest.mark.parametrize("version, release", [("2.9.1", (2, 9)), ("2.15.0+cu132", (2, 15)),
                                              ("2.11.0a0+git1234abc", (2, 11)), ("10.0.0", (10, 0))])
def test_a_version_string_gives_its_release(version: str, release: tuple[int, int]) -> None:
    assert torch_support.torch_release(version) == release


def test_the_running_torch_is_accepted() -> None:
    torch_support.check_torch()  # the package imported above under it; the call must agree


@pytest.mark.parametrize("version", ["2.8.0", "2.7.1+cu126", "1.13.1"])
def test_an_older_torch_is_refused_at_import_naming_it(version: str) -> None:
    with pytest.raises(ImportError, match=re.escape(f"needs torch >= 2.9, but this is torch {version}:")):
        torch_support.check_torch(version)


@pytest.mark.parametrize("version", ["2.9.1", "2.10.0", "2.11.0", "2.15.0+cu132"])
def test_a_supported_torch_is_accepted(version: str) -> None:
    torch_support.check_torch(version)


@pytest.mark.parametrize("version, placed", [("2.9.1", False), ("2.9.0+cu128", False), ("2.10.0", True),
                                             ("2.15.0+cu132", True)])
def test_torch_2_9_alone_misplaces_uneven_strided_shards_and_cannot_compile_dtensor_steps(version: str,
                                                                                          placed: bool) -> None:
    assert torch_support.places_uneven_strided_shards(version) is placed
    assert torch_support.compiles_dtensor_steps(version) is placed


def test_an_unrecognized_version_is_refused_naming_it() -> None:
    with pytest.raises(RuntimeError, match="'nightly'"):
        torch_support.torch_release("nightly")


def test_no_type_check_in_the_package_names_a_union_which_torch_2_9_cannot_compile() -> None:
    # `isinstance(x, tuple | list)` in a step's checks broke every torch.compile'd step on torch 2.9 (its compiler
    # cannot make a `types.UnionType`); the tests' torch compiles it, so only this reading of the source catches it.
    package = Path(__file__).resolve().parents[1] / "torch-ext" / "optimizer"
    unions = [f"{path.relative_to(package)}:{node.lineno}" for path in sorted(package.rglob("*.py"))
              for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass")
              and len(node.args) == 2 and isinstance(node.args[1], ast.BinOp)
              and isinstance(node.args[1].op, ast.BitOr)]
    assert not unions, unions
