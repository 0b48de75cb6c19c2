"""The Newton-Schulz dtype each device runs by default, decided from the CPU's matrix instructions (faked here for
every machine kind: AMX, AVX512-BF16 only on AMD and on Intel, neither, non-x86; and capped by ONEDNN_MAX_CPU_ISA) or
the GPU's compute capability; the warning for an
explicit dtype the CPU multiplies slowly; the optimizer's repr saying what None resolves to."""

from __future__ import annotations

import platform
import warnings
from pathlib import Path

import pytest
import torch

from kernel_under_test import optimizer, submodule

precision = submodule(optimizer, "precision")


def fake_cpu(monkeypatch: pytest.MonkeyPatch, *units: str, vendor: str = "AuthenticAMD") -> None:
    monkeypatch.setattr(precision, "cpu_matrix_units", lambda: frozenset(units))
    monkeypatch.setattr(precision, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(precision, "_warned", set())


def linux_cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo here")
    line = next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags"))
    return set(line.split(":", 1)[1].split())


@pytest.mark.parametrize("units, vendor, expected", [
    (("amx_bf16", "avx512_bf16"), "GenuineIntel", torch.bfloat16),  # Sapphire Rapids
    (("amx_bf16", "avx512_bf16", "amx_fp16", "avx512_fp16"), "GenuineIntel", torch.bfloat16),  # Granite Rapids
    (("avx512_bf16",), "AuthenticAMD", torch.bfloat16),  # Zen 4/5
    (("avx512_bf16",), "GenuineIntel", torch.float32),  # Cooper Lake; Sapphire Rapids with AMX off
    (("avx512_bf16", "avx512_fp16"), "GenuineIntel", torch.float32),  # the same with oneDNN capped below AMX
    ((), "AuthenticAMD", torch.float32),  # AVX2-only CPUs
    ((), "", torch.float32),  # non-x86 CPUs
    (("avx512_bf16",), "", torch.float32),  # an unnamed vendor: only AMD's cores were measured faster in bf16
])
def test_cpu_rule(monkeypatch: pytest.MonkeyPatch, units: tuple[str, ...], vendor: str, expected: torch.dtype) -> None:
    fake_cpu(monkeypatch, *units, vendor=vendor)
    choice = optimizer.ns_dtype_choice("cpu")
    assert choice.dtype == expected == optimizer.default_ns_dtype(torch.device("cpu"))
    assert ("AMX bf16 tiles" in choice.reason) == ("amx_bf16" in units)  # it says why
    assert ("AVX512-BF16" in choice.reason) == ("amx_bf16" not in units)
    assert ("on AMD cores" in choice.reason) == ("avx512_bf16" in units and "amx_bf16" not in units
                                                 and vendor == "AuthenticAMD")


def test_units_are_what_onednn_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    # ONEDNN_MAX_CPU_ISA keeps torch's 16-bit products off the instructions above the named set (on this project's
    # AMX Xeon, =AVX512_CORE_BF16 made bf16 2048x2048 products 11x slower): the rule must not count on those.
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported", "_is_amx_fp16_supported"):
        monkeypatch.setattr(torch.cpu, probe, lambda: True)
    monkeypatch.setattr(precision, "_linux_cpu_flags", lambda: {"avx512_fp16"})
    everything = frozenset(precision.CPU_MATRIX_UNITS)
    for variable, value, expected in [
        (None, None, everything), ("ONEDNN_MAX_CPU_ISA", "ALL", everything),
        ("ONEDNN_MAX_CPU_ISA", "no_such_isa", everything),  # oneDNN ignores names it does not know
        ("ONEDNN_MAX_CPU_ISA", "avx512_core_amx", everything - {"amx_fp16"}),
        ("ONEDNN_MAX_CPU_ISA", "AVX10_1_512", {"avx512_bf16", "avx512_fp16"}),
        ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16", {"avx512_bf16"}), ("DNNL_MAX_CPU_ISA", "AVX2", set()),
    ]:
        for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
            monkeypatch.delenv(name, raising=False)
        if variable is not None:
            monkeypatch.setenv(variable, value)
        precision.cpu_matrix_units.cache_clear()
        try:
            assert precision.cpu_matrix_units() == expected, (variable, value)
        finally:
            precision.cpu_matrix_units.cache_clear()


def test_the_vendor_comes_from_platform_without_cpuinfo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "_linux_cpuinfo_lines", lambda: [])
    monkeypatch.setattr(platform, "processor", lambda: "AMD64 Family 25 Model 17 Stepping 1, AuthenticAMD")
    precision.cpu_vendor.cache_clear()
    try:
        assert precision.cpu_vendor() == "AuthenticAMD"
    finally:
        precision.cpu_vendor.cache_clear()


def test_non_x86_cpus_report_no_x86_units(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    precision.cpu_matrix_units.cache_clear()
    try:
        assert precision.cpu_matrix_units() == frozenset()
        assert optimizer.default_ns_dtype("cpu") == torch.float32
    finally:
        precision.cpu_matrix_units.cache_clear()


def test_this_cpus_units_are_what_the_kernel_reports() -> None:
    # Linux names the same instruction sets in /proc/cpuinfo; torch's probes (and ours) must agree with it.
    if platform.machine() != "x86_64":
        pytest.skip("x86 flags only")
    if precision.onednn_isa_cap():
        pytest.skip("oneDNN capped in this environment")
    flags = linux_cpu_flags()
    assert precision.cpu_matrix_units() == frozenset(set(precision.CPU_MATRIX_UNITS) & flags)
    vendor = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("vendor_id"))
    assert precision.cpu_vendor() == vendor


def test_the_choice_is_the_same_every_time() -> None:
    # Decided from instruction sets, not timed: the same machine always gets the same dtype (and so the same results).
    assert len({optimizer.ns_dtype_choice("cpu") for _ in range(20)}) == 1


@pytest.mark.parametrize("capability, expected", [((7, 5), torch.float16), ((8, 0), torch.bfloat16),
                                                  ((9, 0), torch.bfloat16), ((12, 0), torch.bfloat16)])
def test_gpu_rule(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], expected: torch.dtype) -> None:
    # A T4 (7.5) has float16 tensor cores only; bfloat16 products there run on the slow non-tensor-core path.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert optimizer.default_ns_dtype(torch.device("cuda", 1)) == expected
    assert f"{capability[0]}.{capability[1]}" in optimizer.ns_dtype_choice("cuda").reason or expected == torch.bfloat16


def test_other_accelerators_get_bfloat16() -> None:
    assert optimizer.default_ns_dtype("xpu") == torch.bfloat16


def test_the_step_runs_newton_schulz_in_the_chosen_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    # With bf16 units faked, ns_dtype=None must give exactly what an explicit bfloat16 gives on a stack of two
    # matrices, and differ from fp32; a lone small matrix runs in float32 (`matrix_ns_dtype`).
    fake_cpu(monkeypatch, "avx512_bf16")
    results = {}
    for shapes in ([(16, 24), (16, 24)], [(16, 24)]):
        for ns_dtype in (None, torch.bfloat16, torch.float32):
            params = [torch.zeros(shape) for shape in shapes]
            generator = torch.Generator().manual_seed(0)
            for param in params:
                param.grad = torch.randn(param.shape, generator=generator)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # bf16 is fast on this (faked) CPU: no warning
                optimizer.Muon(params, lr=0.1, weight_decay=0.0, ns_dtype=ns_dtype).step()
            results[len(shapes), ns_dtype] = torch.cat(params)
    assert torch.equal(results[2, None], results[2, torch.bfloat16])
    assert not torch.equal(results[2, None], results[2, torch.float32])
    assert torch.equal(results[1, None], results[1, torch.float32])
    assert not torch.equal(results[1, None], results[1, torch.bfloat16])


@pytest.mark.parametrize("default, device, shape, expected", [
    (torch.bfloat16, "cpu", (10, 256), torch.float32),  # the MNIST MLP's classifier
    (torch.bfloat16, "cpu", (1, 10, 256), torch.float32),  # an optimizer's bucket of one
    (torch.bfloat16, "cpu", (2, 10, 256), torch.bfloat16),  # a stack: one batched call for both
    (torch.bfloat16, "cpu", (256, 784), torch.bfloat16),
    (torch.float32, "cpu", (10, 256), torch.float32),
    (torch.bfloat16, "cuda", (10, 256), torch.bfloat16),
    (torch.float16, "cuda", (10, 256), torch.float16),
])
@pytest.mark.parametrize("units", [("amx_bf16", "avx512_bf16"), ("avx512_bf16",)])
def test_a_lone_small_matrix_iterates_in_float32_on_a_cpu(monkeypatch: pytest.MonkeyPatch, units: tuple[str, ...],
                                                          default: torch.dtype, device: str, shape: tuple[int, ...],
                                                          expected: torch.dtype) -> None:
    fake_cpu(monkeypatch, *units)
    assert precision.matrix_ns_dtype(default, torch.device(device), shape) == expected


def test_matrix_ns_dtype_takes_a_device_named_by_a_string(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpu(monkeypatch, "avx512_bf16")
    assert precision.matrix_ns_dtype(torch.bfloat16, "cpu", (10, 256)) == torch.float32
    assert precision.matrix_ns_dtype(torch.bfloat16, "cuda", (10, 256)) == torch.bfloat16


@pytest.mark.parametrize("units, below, above", [
    (("amx_bf16", "avx512_bf16"), 203, 204),  # 3 * 203^3 multiply-adds a step: under 3 * 2^23; 204: over
    (("avx512_bf16",), 161, 162),  # under and over 3 * 2^22: AMD's bf16 products stay ahead down to smaller sizes
])
def test_where_float32_takes_over_depends_on_the_cpus_16_bit_unit(monkeypatch: pytest.MonkeyPatch,
                                                                  units: tuple[str, ...], below: int,
                                                                  above: int) -> None:
    fake_cpu(monkeypatch, *units)
    cpu = torch.device("cpu")
    assert precision.matrix_ns_dtype(torch.bfloat16, cpu, (below, below)) == torch.float32
    assert precision.matrix_ns_dtype(torch.bfloat16, cpu, (above, above)) == torch.bfloat16
    assert f"2^{precision.small_matrix_macs().bit_length() - 1} " in precision.ns_dtype_choice(cpu).reason


@pytest.mark.parametrize("units, small, large", [
    # The README's examples of lone matrices that run in float32, each way round, and wider ones that do not. The
    # rule counts a step's mean multiply-adds per product, (2 s² l + s³) / 3 for short side s and long side l: 128x512
    # 6.3M and 160x512 10.1M against AMX's 2^23 (8.4M); 128x256 3.5M and 128x512 6.3M against AVX512-BF16's 2^22.
    (("amx_bf16", "avx512_bf16"), [(10, 256), (128, 512), (512, 128)], [(160, 512), (512, 160)]),
    (("avx512_bf16",), [(128, 256), (256, 128)], [(128, 512), (512, 128)]),
])
def test_where_float32_takes_over_on_rectangular_matrices(monkeypatch: pytest.MonkeyPatch, units: tuple[str, ...],
                                                         small: list[tuple[int, int]],
                                                         large: list[tuple[int, int]]) -> None:
    fake_cpu(monkeypatch, *units)
    cpu = torch.device("cpu")
    for shape in small:
        assert precision.matrix_ns_dtype(torch.bfloat16, cpu, shape) == torch.float32, shape
    for shape in large:
        assert precision.matrix_ns_dtype(torch.bfloat16, cpu, shape) == torch.bfloat16, shape


@pytest.mark.parametrize("dtype, units, warns", [
    (torch.float16, (), True), (torch.float16, ("avx512_bf16",), True), (torch.float16, ("amx_fp16",), False),
    (torch.float16, ("avx512_fp16",), False), (torch.bfloat16, (), True), (torch.bfloat16, ("avx512_bf16",), False),
    (torch.float32, (), False),
])
def test_an_explicit_slow_dtype_is_honoured_and_warns_once(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                                           units: tuple[str, ...], warns: bool) -> None:
    fake_cpu(monkeypatch, *units)
    for attempt in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = optimizer.Muon([torch.randn(4, 4)], ns_dtype=dtype)
        assert opt.param_groups[0]["ns_dtype"] == dtype
        messages = [str(warning.message) for warning in caught if warning.category is UserWarning]
        if not warns or attempt == 1:
            assert messages == []
            continue
        assert len(messages) == 1 and caught[0].filename == __file__  # pointed at the caller, not at torch.optim
        faster = optimizer.default_ns_dtype("cpu")
        assert f"ns_dtype={dtype} on cpu" in messages[0] and f"would use {faster}" in messages[0]


@pytest.mark.parametrize("dtype, units, warns", [
    (torch.float16, (), True), (torch.bfloat16, (), True), (torch.bfloat16, ("avx512_bf16",), False),
    (torch.float32, (), False)])
def test_zeropowers_explicit_slow_dtype_warns_once_as_ns_dtype_does(monkeypatch: pytest.MonkeyPatch,
                                                                     dtype: torch.dtype, units: tuple[str, ...],
                                                                     warns: bool) -> None:
    fake_cpu(monkeypatch, *units)
    matrix = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    for attempt in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = optimizer.zeropower(matrix, dtype=dtype)
            optimizer.zeropower(matrix)  # the default never warns
        assert result.dtype == matrix.dtype and torch.isfinite(result).all()
        messages = [str(warning.message) for warning in caught if warning.category is UserWarning]
        if not warns or attempt == 1:
            assert messages == []
            continue
        assert len(messages) == 1 and caught[0].filename == __file__  # pointed at the caller, not at torch.no_grad
        assert f"dtype={dtype} on cpu" in messages[0] and "ns_dtype" not in messages[0]
        assert f"dtype=None would use {optimizer.default_ns_dtype('cpu')}" in messages[0]


def test_adamw_only_groups_do_not_warn(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpu(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.Muon([torch.randn(8)], ns_dtype=torch.float16)


def test_repr_says_what_none_resolves_to_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpu(monkeypatch, "avx512_bf16")
    text = repr(optimizer.Muon([torch.randn(4, 4), torch.randn(4)]))
    assert text.startswith("Muon (") and text.endswith(")")
    assert "ns_dtype=None on cpu: torch.bfloat16, as the CPU has AVX512-BF16" in text
    assert "ns_dtype=None" not in repr(optimizer.Muon([torch.randn(4, 4)], ns_dtype=torch.float32))


@pytest.mark.parametrize("units, shape, expected", [
    (("avx512_bf16",), (2, 24, 40), torch.bfloat16), (("avx512_bf16",), (24, 40), torch.float32),
    ((), (2, 24, 40), torch.float32)])
def test_zeropower_without_a_dtype_runs_in_the_default(monkeypatch: pytest.MonkeyPatch, units: tuple[str, ...],
                                                       shape: tuple[int, ...], expected: torch.dtype) -> None:
    # The bf16 default's accuracy against the SVD polar factor is the explicit bf16 path's, bounded in
    # test_newton_schulz.py (test_polar_express_in_low_precision_stays_near_the_polar_factor), the GPU bf16 bound.
    fake_cpu(monkeypatch, *units)
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    assert torch.equal(optimizer.zeropower(G), optimizer.zeropower(G, dtype=expected))
