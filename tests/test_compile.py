"""torch.compile traces the optimizer: zeropower and a Muon step compile to one graph (no break in the
Newton-Schulz loop, the compiled symmetric op included) and give the eager result; with AdamW parameters the only
break is the AdamW part, which runs torch's fused kernel eagerly as torch does; a capturable step has no host read
(and, on a GPU, replays as a CUDA graph); a compiled model trains with it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, ContextManager

import pytest
import torch
from torch import nn
from torch._dynamo.testing import EagerAndRecordGraphs

from kernel_under_test import optimizer, submodule
from triton_under_test import DEVICE, needs_kernels

dispatch = submodule(optimizer, "dispatch")
ROWS = dispatch.CPU_MIN_ROWS + 8  # large enough for the compiled CPU symmetric op
# A CUDA variant (a machine with a CUDA torch) compiles no CPU kernels: there CPU products stay with torch.
CPU_OP_CALLS_PER_STEP = 2 if submodule(optimizer, "native").has_compiled_symmetric_gram("cpu") else 0
# Compiled and eager steps are compared to float32 rounding, so Newton-Schulz runs in float32 on every machine: the
# default is bfloat16 on CPUs with bf16 matrix units, where inductor's products round differently from eager ones.
FLOAT32_NS = {"ns_dtype": torch.float32}


def fresh_compile_state() -> None:
    torch._dynamo.reset()  # each test counts its own graphs and breaks


def seeded_grads(params: list[torch.Tensor], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator).to(param)  # its dtype and device


def assert_steps_match(step, eager: "optimizer.Muon", params: list[torch.Tensor],
                       eager_params: list[torch.Tensor], steps: int = 3,
                       around_step: Callable[[int], ContextManager] = lambda seed: contextlib.nullcontext()) -> None:
    """`steps` steps of a compiled `step` and of `eager` on the same gradients end at the same parameters; the
    compiled step `seed` runs inside `around_step(seed)`."""
    for seed in range(steps):
        seeded_grads(params, seed)
        seeded_grads(eager_params, seed)
        with around_step(seed):
            step()
        eager.step()
    for ours, theirs in zip(params, eager_params):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_zeropower_compiles_to_one_graph_with_the_compiled_op() -> None:
    fresh_compile_state()
    G = torch.randn(ROWS, ROWS + 200, generator=torch.Generator().manual_seed(0))
    orthogonalize = lambda g: optimizer.zeropower(g, 5, dtype=torch.float32)  # noqa: E731
    explanation = torch._dynamo.explain(orthogonalize)(G)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
    targets = [str(node.target) for graph in explanation.graphs for node in graph.graph.nodes]
    assert sum("symmetric_gram_" in target for target in targets) == 5 * CPU_OP_CALLS_PER_STEP  # X Xᵀ, then bA + cA²
    compiled = torch.compile(orthogonalize, fullgraph=True)(G)
    torch.testing.assert_close(compiled, orthogonalize(G), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_zeropower_on_the_triton_kernels_compiles_to_one_graph() -> None:
    # Each Triton product is one opaque op of the graph (triton_ops.py). Traced into, the launcher broke the graph on
    # an H100, and the frames resumed after the breaks recompiled for each coefficient up to dynamo's limit.
    fresh_compile_state()
    G = torch.randn(40, 72, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    orthogonalize = lambda g: optimizer.zeropower(g, 5, dtype=torch.float32, backend="triton")  # noqa: E731
    explanation = torch._dynamo.explain(orthogonalize)(G)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
    targets = [str(node.target) for graph in explanation.graphs for node in graph.graph.nodes]
    assert [sum(f"_triton.{name}." in target for target in targets) for name in ("xxt", "ba_plus_caa")] == [5, 5]
    compiled = torch.compile(orthogonalize, fullgraph=True)(G)
    torch.testing.assert_close(compiled, orthogonalize(G), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_a_compiled_step_on_the_triton_kernels_is_one_graph_and_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    # As an H100 steps a Llama-3-8B layer (its 4096-row products on the Triton kernels): under fullgraph=True, no
    # break and no recompile from one Newton-Schulz coefficient to the next.
    monkeypatch.setattr(dispatch, "kernel_choice", lambda shape, dtype, device: "triton")
    fresh_compile_state()
    params = [torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(DEVICE)
              for i, shape in enumerate([(24, 16), (16, 24), (24, 16)])]
    eager_params = [param.clone() for param in params]
    opt = optimizer.Muon(params, lr=0.02, **FLOAT32_NS)
    eager = optimizer.Muon(eager_params, lr=0.02, **FLOAT32_NS)
    assert_steps_match(torch.compile(opt.step, fullgraph=True), eager, params, eager_params)


@pytest.mark.parametrize("units", [("amx_bf16", "avx512_bf16"), ("avx512_bf16",)])
def test_bfloat16_zeropower_compiles_to_one_graph_whichever_kernel_the_cpu_takes(monkeypatch: pytest.MonkeyPatch,
                                                                                 units: tuple[str, ...]) -> None:
    # The 16-bit CPU choice reads the CPU's units, whose probe the compiler cannot trace (faked here as untraceable as
    # the real one): a constant to the trace, not a break, whichever way it goes.
    monkeypatch.setattr(dispatch, "cpu_matrix_units", torch.compiler.disable(lambda: frozenset(units)))
    fresh_compile_state()
    G = torch.randn(ROWS, ROWS + 200, generator=torch.Generator().manual_seed(0))
    explanation = torch._dynamo.explain(lambda g: optimizer.zeropower(g, 5, dtype=torch.bfloat16))(G)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
    targets = [str(node.target) for graph in explanation.graphs for node in graph.graph.nodes]
    assert sum("symmetric_gram_" in target for target in targets) == (0 if "amx_bf16" in units else
                                                                      5 * CPU_OP_CALLS_PER_STEP)


class _MuonSettingNothingWhileTraced(optimizer.Muon):
    """Muon that refuses to set an attribute of itself inside a trace: dynamo in torch 2.11 (an H100's, 2026-11-26)
    cannot, where 2.13's, here, can, so a step that does traces here and fails there."""

    def __setattr__(self, name: str, value: object) -> None:
        if torch.compiler.is_compiling():
            raise RuntimeError(f"a traced step sets the optimizer's {name}")
        super().__setattr__(name, value)


def test_a_compiled_muon_step_is_one_graph_and_equals_eager() -> None:
    fresh_compile_state()
    shapes = [(24, 16), (16, 24), (3, 8, 12), (ROWS, 16)]  # a batch of two, an expert bank, one on the CPU op
    params = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i, shape in enumerate(shapes)]
    eager_params = [param.clone() for param in params]
    opt = _MuonSettingNothingWhileTraced(params, lr=0.02, **FLOAT32_NS)
    eager = optimizer.Muon(eager_params, lr=0.02, **FLOAT32_NS)
    assert_steps_match(torch.compile(opt.step, fullgraph=True), eager, params, eager_params)  # fullgraph: no break


def test_a_compiled_step_on_the_gram_iteration_is_one_graph_and_equals_eager() -> None:
    # ns_algorithm="auto" takes it for large wide matrices on GPUs in 16-bit, and for wide float32 ones everywhere.
    fresh_compile_state()
    params = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i, shape in enumerate(
        [(48, 160), (48, 160), (160, 48)])]
    eager_params = [param.clone() for param in params]
    opt = _MuonSettingNothingWhileTraced(params, lr=0.02, ns_algorithm="gram", **FLOAT32_NS)
    eager = optimizer.Muon(eager_params, lr=0.02, ns_algorithm="gram", **FLOAT32_NS)
    assert_steps_match(torch.compile(opt.step, fullgraph=True), eager, params, eager_params)


@pytest.mark.parametrize("options", [{}, {"normalization": "neuron"}, {"state_dtype": torch.bfloat16},
                                     {"state_dtype": "int8"}], ids=["plain", "NorMuon", "bf16 state", "int8 state"])
def test_a_compiled_step_of_groups_differing_in_lr_and_weight_decay_equals_the_eager_step(options: dict) -> None:
    # The two groups' same-shape matrices share a stack, each taking its group's lr and weight decay: in the compiled
    # step the decay factors are a constant of the graph. The first step makes the state of both groups.
    fresh_compile_state()
    params = [torch.randn(24, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    eager_params = [param.clone() for param in params]

    def grouped(tensors: list[torch.Tensor]) -> list[dict]:
        return [dict(params=tensors[:2]), dict(params=tensors[2:], lr=0.01, weight_decay=0.3)]
    opt = optimizer.Muon(grouped(params), lr=0.02, **FLOAT32_NS, **options)
    eager = optimizer.Muon(grouped(eager_params), lr=0.02, **FLOAT32_NS, **options)
    assert_steps_match(torch.compile(opt.step, fullgraph=True), eager, params, eager_params)


def test_with_adamw_parameters_the_only_break_is_the_eager_adamw_update() -> None:
    # torch's fused AdamW kernel cannot go into a graph (torch keeps it out of its own): our AdamW part runs eagerly.
    fresh_compile_state()
    params = [torch.randn(24, 16), torch.randn(16), torch.randn(())]
    eager_params = [param.clone() for param in params]
    opt = optimizer.Muon(params, lr=0.02, **FLOAT32_NS)
    eager = optimizer.Muon(eager_params, lr=0.02, **FLOAT32_NS)
    seeded_grads(params, 0)
    explanation = torch._dynamo.explain(opt.step)()
    reasons = [str(reason.reason) for reason in explanation.break_reasons]
    assert len(reasons) == 1 and "_adamw_steps" in reasons[0], reasons
    torch._dynamo.reset()
    params_again = [param.clone() for param in eager_params]  # explain() stepped `opt`: start over from the twin
    opt = optimizer.Muon(params_again, lr=0.02, **FLOAT32_NS)
    assert_steps_match(torch.compile(opt.step), eager, params_again, eager_params)


SCHEDULE = (0.02, 0.01, 0.005, 0.001)


def scheduled_lr(lr: torch.Tensor, eager: "optimizer.Muon") -> Callable[[int], ContextManager]:
    """Moves the compiled step's tensor lr and the eager twin's float lr along SCHEDULE; from the third step on a
    recompile is an error (the first step creates the state, which the second step's graph differs by)."""
    @contextlib.contextmanager
    def scheduled(seed: int) -> Iterator[None]:
        lr.fill_(SCHEDULE[seed])
        eager.param_groups[0]["lr"] = SCHEDULE[seed]
        with torch._dynamo.config.patch(error_on_recompile=seed >= 2):
            yield
    return scheduled


@pytest.mark.parametrize("with_adamw", [False, True])
def test_a_tensor_lr_is_traced_so_a_schedule_moving_it_does_not_recompile(with_adamw: bool) -> None:
    fresh_compile_state()
    shapes = [(24, 16), (ROWS, 16)] + [(16,)] * with_adamw
    params = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i, shape in enumerate(shapes)]
    eager_params = [param.clone() for param in params]
    lr = torch.tensor(0.02)
    opt = optimizer.Muon(params, lr=lr, **FLOAT32_NS)
    eager = optimizer.Muon(eager_params, lr=0.02, **FLOAT32_NS)
    step = torch.compile(opt.step, fullgraph=not with_adamw)  # the AdamW part runs eagerly
    assert_steps_match(step, eager, params, eager_params, len(SCHEDULE), scheduled_lr(lr, eager))


@pytest.mark.parametrize("normalization", [None, "neuron", "element"])
def test_a_capturable_step_is_one_graph_with_no_host_read(normalization: str | None) -> None:
    """capturable=True (timm's and torch's option for CUDA-graph capture): the whole step, a normalization's second
    moments and the RMS rule included, traces into one graph with no host read of a tensor value (fullgraph: an
    .item() or a branch on a tensor would break it), and a moving tensor lr does not recompile it."""
    fresh_compile_state()
    shapes = [(24, 16), (3, 8, 12), (ROWS, 16)]
    # float64: AdaMuon's first update is sign(O) (v = O² then), so in float32 an entry of O within rounding of zero
    # may take either sign in the compiled and the eager step (seen: 1 of 8320 entries).
    params = [torch.randn(shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
              for i, shape in enumerate(shapes)]
    eager_params = [param.clone() for param in params]
    lr = torch.tensor(0.02)
    options = dict(normalization=normalization, ns_dtype=torch.float64)
    opt = optimizer.Muon(params, lr=lr, capturable=True, **options)
    eager = optimizer.Muon(eager_params, lr=0.02, **options)
    step = torch.compile(opt.step, fullgraph=True)
    assert_steps_match(step, eager, params, eager_params, len(SCHEDULE), scheduled_lr(lr, eager))


@pytest.mark.parametrize("state_dtype", [None, "int8"])
def test_the_compiler_makes_the_state_before_it_traces_the_step(state_dtype: str | None) -> None:
    """torch.compile runs `_init_group` eagerly, as it does torch's optimizers': the first step's graph creates no
    state tensor. Made inside it, the state would be among a CUDA graph's outputs, which its next replay overwrites
    (the H200 caught that: 'accessing tensor output of CUDAGraphs that has been overwritten')."""
    fresh_compile_state()
    params = [torch.randn(shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
              for i, shape in enumerate([(24, 16), (3, 8, 12)])]
    opt = optimizer.Muon(params, lr=torch.tensor(0.02), capturable=True, normalization="neuron",
                         state_dtype=state_dtype, ns_dtype=torch.float64)
    seeded_grads(params, 0)
    backend = EagerAndRecordGraphs()
    torch.compile(opt.step, backend=backend, fullgraph=True)()
    targets = [str(node.target) for graph in backend.graphs for node in graph.graph.nodes]
    assert not [target for target in targets if "zeros" in target], targets  # state starts as zeros
    momentum = "momentum_buffer" if state_dtype is None else "momentum_buffer_codes"
    assert all(momentum in opt.state[param] and "update_sq" in opt.state[param] for param in params)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_capturable_step_replays_as_a_cuda_graph() -> None:
    """mode="reduce-overhead" records the step as a CUDA graph and replays it: with capturable=True the replays
    (with AdamW parameters too: its eager part is outside the graph) match the eager step as lr moves."""
    fresh_compile_state()
    shapes = [(64, 48), (3, 16, 24), (48,)]
    params = [torch.randn(shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64).cuda()
              for i, shape in enumerate(shapes)]
    eager_params = [param.clone() for param in params]
    lr = torch.tensor(0.02, device="cuda")
    options = dict(normalization="neuron", ns_dtype=torch.float64)
    opt = optimizer.Muon(params, lr=lr, capturable=True, **options)
    eager = optimizer.Muon(eager_params, lr=0.02, **options)
    step = torch.compile(opt.step, mode="reduce-overhead")
    assert_steps_match(step, eager, params, eager_params, len(SCHEDULE), scheduled_lr(lr, eager))


def test_a_compiled_model_trains_with_muon() -> None:
    fresh_compile_state()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    compiled = torch.compile(model)
    opt = optimizer.Muon(optimizer.muon_param_groups(model), lr=0.02)
    inputs = torch.randn(64, 16)
    targets = inputs.flip(-1)  # a fixed linear map the model can learn
    losses = []
    for _ in range(20):
        loss = nn.functional.mse_loss(compiled(inputs), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def _matrix_and_vector_params(late_shape: tuple[int, ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randn(shape, generator=generator) for shape in ((16, 32), (32,), late_shape)]


@pytest.mark.parametrize("late", ["first_gradient", "add_param_group"])
def test_a_parameter_whose_state_starts_after_compiling_steps_as_eager(late: str) -> None:
    # With AdamW parameters (the step's one graph break), checks that branched on the state before `_init_group`
    # made it diverged from the retrace after the break: dynamo's SpeculationLogDivergence at the first compiled step
    # with a gradient for a parameter that had none (a frozen layer unfrozen, a group added).
    fresh_compile_state()
    params = _matrix_and_vector_params((8, 24))
    eager_params = [param.clone() for param in params]
    groups = lambda tensors: tensors if late == "first_gradient" else tensors[:2]  # noqa: E731
    ours, eager = (optimizer.Muon(groups(tensors), lr=0.02, **FLOAT32_NS) for tensors in (params, eager_params))
    step = torch.compile(ours.step)
    for seed in range(4):
        if seed == 2 and late == "add_param_group":
            ours.add_param_group({"params": params[2:]})
            eager.add_param_group({"params": eager_params[2:]})
        for tensors in (params, eager_params):
            seeded_grads(tensors, seed)
            if seed < 2:
                tensors[2].grad = None
        step()
        eager.step()
    for param, eager_param in zip(params, eager_params):
        torch.testing.assert_close(param, eager_param, rtol=1e-5, atol=1e-6)


def steps_match_with_groups_set(shape: tuple[int, int], set_group: Callable[[dict[str, Any], int], None],
                                steps: int = 3) -> "optimizer.Muon":
    """A compiled step and an eager one over the same matrix and vector, `set_group(group, seed)` applied to each
    one's group before step `seed`, end at the same parameters; returns the compiled step's optimizer."""
    fresh_compile_state()
    params = _matrix_and_vector_params(shape)
    eager_params = [param.clone() for param in params]
    ours, eager = (optimizer.Muon(tensors, lr=0.02, **FLOAT32_NS) for tensors in (params, eager_params))

    @contextlib.contextmanager
    def groups_set(seed: int) -> Iterator[None]:
        for opt in (ours, eager):
            set_group(opt.param_groups[0], seed)
        yield

    assert_steps_match(torch.compile(ours.step), eager, params, eager_params, steps=steps, around_step=groups_set)
    return ours


@pytest.mark.parametrize("change", [{"state_dtype": "int8"}, {"state_dtype": torch.bfloat16},
                                    {"normalization": "neuron"}], ids=["int8", "bf16", "neuron"])
def test_a_state_changing_option_set_between_compiled_steps_steps_as_eager(change: dict) -> None:
    # The state the option converts or creates is made by `_init_group` as dynamo traces; a state check before it
    # broke the trace (int8: a KeyError in dynamo's guards on the moved moment).
    def changed_before_the_third_step(group: dict[str, Any], seed: int) -> None:
        if seed == 2:
            group.update(change)

    steps_match_with_groups_set((8, 256), changed_before_the_third_step, steps=4)


def test_a_key_set_once_between_compiled_steps_stays_resolved_when_lr_moves() -> None:
    """Resolved against each step's lr (re-entered copies, the group never written), adamw_lr set once pinned
    AdamW's lr when lr was cut by hand later, where the eager step's kept scale follows it."""
    def set_once_then_lr_cut(group: dict[str, Any], seed: int) -> None:
        if seed == 0:
            group["adamw_lr"] = 0.01
        if seed == 2:
            group["lr"] /= 10

    steps_match_with_groups_set((8, 24), set_once_then_lr_cut, steps=4)


def test_a_key_set_between_compiled_steps_is_resolved_as_the_eager_step_resolves_it() -> None:
    """ZeroRedundancyOptimizer sets adamw_lr before every step. Traced, the group's re-entry made dynamo, which traces
    the groups with `capturable=True` in them, write that value back with its keys (eager steps after it stopped
    checking a tensor lr's value); reading re-entered copies instead resolved adamw_lr against each step's lr."""
    def adamw_lr_set(group: dict[str, Any], seed: int) -> None:
        group["adamw_lr"] = 0.004 + 0.001 * seed

    group = steps_match_with_groups_set((8, 24), adamw_lr_set).param_groups[0]
    assert group["capturable"] is False and "adamw_lr" not in group and group["adamw_lr_scale"] == 0.006 / 0.02


def test_a_float_lr_moved_by_a_scheduler_keeps_one_graph() -> None:
    # math.isfinite on the float lr dynamo made dynamic broke the graph under fullgraph=True. (Each new value still
    # recompiles, as the README says: a tensor lr does not.)
    fresh_compile_state()
    params = _matrix_and_vector_params((8, 24))[:1]
    eager_params = [param.clone() for param in params]
    ours, eager = (optimizer.Muon(tensors, lr=0.02, **FLOAT32_NS) for tensors in (params, eager_params))
    step = torch.compile(ours.step, fullgraph=True)  # before the schedulers wrap the step, which dynamo skips
    schedules = [torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9) for opt in (ours, eager)]
    for seed in range(3):
        seeded_grads(params, seed)
        seeded_grads(eager_params, seed)
        step()
        eager.step()
        for schedule in schedules:
            schedule.step()
    torch.testing.assert_close(params[0], eager_params[0], rtol=1e-5, atol=1e-6)
