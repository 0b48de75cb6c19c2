"""Which parameters go to Muon: shape rules and the model-aware default groups."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

from kernel_under_test import optimizer


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.mlp = nn.Linear(width, 4 * width, bias=False)
        self.experts = nn.Parameter(torch.randn(4, width, width))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 50, width: int = 16, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.stem = nn.Conv1d(width, width, 3)
        self.final_norm = nn.RMSNorm(width)
        self.decoder = nn.Linear(width, vocab, bias=False)  # not named lm_head: found as the vocabulary projection
        if tie:
            self.decoder.weight = self.embed.weight


def roles(model: nn.Module, **overrides: object) -> dict[str, tuple[bool, str | None, float | None]]:
    """Per parameter of the default groups: whether a step of Muon over them orthogonalizes it (its state holds a
    momentum buffer), its group's param_layout where not "auto", and its group's adamw_weight_decay where set."""
    groups = optimizer.muon_param_groups(model, lr=0.1, **overrides)
    opt = optimizer.Muon(groups)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    opt.step()
    return {name: ("momentum_buffer" in opt.state[param], None if group["param_layout"] == "auto" else
                   group["param_layout"], group.get("adamw_weight_decay"))
            for group in opt.param_groups for name, param in zip(group["param_names"], group["params"])}


def test_default_groups_send_embeddings_head_norms_biases_to_adamw() -> None:
    found = roles(TinyLM())
    assert found["embed.weight"] == (False, None, None)
    assert found["decoder.weight"] == (False, None, None)
    assert found["final_norm.weight"] == (False, None, 0.0)
    for block in ("blocks.0", "blocks.1"):
        assert found[f"{block}.norm.weight"][0] is False and found[f"{block}.qkv.bias"] == (False, None, 0.0)
        assert found[f"{block}.qkv.weight"] == (True, None, None)
        assert found[f"{block}.mlp.weight"] == (True, None, None)
        assert found[f"{block}.experts"] == (True, None, None)
    assert found["stem.weight"] == (True, "conv", None)
    assert len(found) == sum(1 for _ in TinyLM().named_parameters())


@pytest.mark.parametrize("name", ["lm_head", "output", "head", "classifier"])
def test_a_linear_named_as_a_head_goes_to_adamw(name: str) -> None:
    # README: the output head is "a Linear named lm_head/output/head/classifier, one tied to an embedding, or the
    # last Linear whose output size is a vocabulary size": here only its name says so (no embedding, and a Linear
    # after it), nested in a submodule.
    model = nn.Module()
    model.body = nn.Linear(16, 32)
    model.top = nn.Module()
    model.top.add_module(name, nn.Linear(32, 10))
    model.after = nn.Linear(10, 12)
    found = roles(model)
    assert found[f"top.{name}.weight"] == (False, None, None)
    assert found["body.weight"] == (True, None, None) and found["after.weight"] == (True, None, None)


class Conv1D(nn.Module):
    """transformers' Conv1D as GPT-2 uses it (transformers.pytorch_utils): a linear map y = x W + b, W stored (nx, nf),
    i.e. (in, out)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))


def test_a_transformers_conv1d_weight_is_a_matrix_stored_in_out() -> None:
    model = nn.Module()
    model.c_attn = Conv1D(48, 16)
    model.look_alike = Conv1D(48, 16)
    model.look_alike.nx = 15  # a module of that name whose weight is not (nx, nf): nothing says how it is stored
    found = roles(model)
    assert found["c_attn.weight"] == (True, "transposed", None)
    assert found["look_alike.weight"] == (True, None, None)
    assert found["c_attn.bias"] == (False, None, 0.0)


class Experts(nn.Module):
    """transformers' experts module as GPT-OSS has it (`use_experts_implementation(is_transposed=...)`): banks
    stored (E, in, out) where it says `is_transposed`, and a bias bank (E, out) per projection."""

    def __init__(self, is_transposed: bool) -> None:
        super().__init__()
        self.is_transposed = is_transposed
        self.gate_up_proj = nn.Parameter(torch.randn(4, 16, 48))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(4, 48))


@pytest.mark.parametrize("is_transposed", [True, False])
def test_an_expert_bank_marked_transposed_is_stored_in_out_and_its_bias_bank_goes_to_adamw(
        is_transposed: bool) -> None:
    found = roles(nn.ModuleDict({"experts": Experts(is_transposed)}))
    assert found["experts.gate_up_proj"] == (True, "transposed" if is_transposed else None, None)
    # (4, 48) is a matrix by shape (it went to Muon, orthogonalized); by name it is a bank of biases.
    assert found["experts.gate_up_proj_bias"] == (False, None, 0.0)


class TinyViT(nn.Module):
    """A ViT's own tensors beside its layers: position embeddings and tokens added to the activations, a relative
    position bias table, and an SSM's state matrices, which only the model's `no_weight_decay()` (timm's convention,
    fnmatch patterns) or a mark on the tensor (mamba_ssm's) can say are not a layer's weight."""

    def __init__(self, declares: bool) -> None:
        super().__init__()
        self.declares = declares
        self.patch_embed = nn.Conv2d(3, 16, 4)  # a layer: its weight multiplies, so it stays a matrix
        self.pos_embed = nn.Parameter(torch.randn(1, 17, 16))  # (17, 16) by shape: an expert bank of one matrix
        self.cls_token = nn.Parameter(torch.randn(1, 1, 16))
        self.register_tokens = nn.Parameter(torch.randn(1, 4, 16))
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.blocks[0].relative_position_bias_table = nn.Parameter(torch.randn(9, 4))
        self.blocks[1].A_log = nn.Parameter(torch.randn(16, 8))
        self.blocks[1].B_log = nn.Parameter(torch.randn(16, 8))
        if declares:
            self.blocks[1].B_log._no_weight_decay = True  # mamba_ssm's mark on its A_log and D

    def no_weight_decay(self) -> set[str]:
        return {"*.A_log"} if self.declares else set()


@pytest.mark.parametrize("declares", [True, False])
def test_a_models_own_embeddings_tokens_bias_tables_and_what_it_declares_go_to_adamw(declares: bool) -> None:
    found = roles(TinyViT(declares))
    for name in ("pos_embed", "cls_token", "register_tokens", "blocks.0.relative_position_bias_table"):
        assert found[name] == (False, None, 0.0), name
    for name in ("blocks.1.A_log", "blocks.1.B_log"):
        assert found[name] == ((False, None, 0.0) if declares else (True, None, None)), name
    assert found["patch_embed.weight"] == (True, None, None) and found["blocks.1.weight"] == (True, None, None)


@pytest.mark.parametrize("conv", [nn.Conv1d(64, 64, 1, groups=64), nn.Conv1d(512, 512, 3, groups=512),
                                  nn.ConvTranspose1d(64, 64, 1, groups=64)], ids=["depthwise-k1", "aspect-171", "T"])
def test_a_degenerate_conv1d_weight_goes_to_adamw(conv: nn.Module) -> None:
    # (64, 1) and (512, 3) as matrices: the shape rule that sends such a Conv2d to AdamW, skipped for Conv1d before.
    found = roles(nn.Sequential(conv))
    assert found["0.weight"] == (False, "conv", None)


@pytest.mark.parametrize(("conv", "to_muon"), [
    (nn.Conv2d(32, 32, 3, groups=32), {"flatten": True, "batched": False}),  # (32, 9) flattened, 9 x (32, 1) batched
    (nn.Conv1d(32, 32, 5, groups=32), {"flatten": True, "batched": False}),
    (nn.Conv2d(200, 2, 3), {"flatten": False, "batched": True}),  # (2, 1800): aspect 900; 9 x (2, 200): 100
], ids=["depthwise-2d", "depthwise-1d", "wide"])
@pytest.mark.parametrize("conv_mode", ["flatten", "batched"])
def test_a_conv_weight_is_routed_by_the_view_of_the_conv_mode_it_steps_in(conv: nn.Module, to_muon: dict[str, bool],
                                                                          conv_mode: str) -> None:
    """Decided under the flatten view and forced (use_muon=True), a depthwise conv's (C, 1) matrices were
    orthogonalized into sign-like unit columns under conv_mode="batched"."""
    assert roles(nn.Sequential(conv), conv_mode=conv_mode)["0.weight"][0] is to_muon[conv_mode]


@pytest.mark.parametrize("key", ["use_muon", "use_fallback", "param_layout"])
def test_routing_keys_are_refused_as_overrides(key: str) -> None:
    value = {"use_muon": True, "use_fallback": False, "param_layout": "experts"}[key]
    with pytest.raises(ValueError, match=f"muon_param_groups: {key} cannot be overridden"):
        optimizer.muon_param_groups(TinyLM(), **{key: value})


def test_a_lazy_modules_parameters_are_refused_until_materialized() -> None:
    """Before its first forward a lazy weight has no shape (it read as 1D: every weight went to AdamW without
    weight decay); afterwards it is routed as the module it became."""
    model = nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.LazyLinear(8))
    with pytest.raises(ValueError, match="parameter 0.weight is not materialized yet"):
        optimizer.muon_param_groups(model)
    model(torch.randn(2, 12))
    found = roles(model)
    assert found["0.weight"] == (True, None, None) and found["0.bias"] == (False, None, 0.0)


@pytest.mark.parametrize("reparametrize", ["prune", "weight_norm hook"])
def test_a_weight_computed_by_a_forward_hook_is_routed_as_its_module_is(reparametrize: str) -> None:
    """Pruning and the older weight_norm train `weight_orig` / `weight_g` and `weight_v`, not `module.weight` (a
    tensor the hook computes): the head and the embedding went to Muon."""
    model = TinyLM()
    for module in (model.embed, model.decoder, model.blocks[0].qkv):
        if reparametrize == "prune":
            prune.l1_unstructured(module, "weight", amount=0.5)
        else:
            with pytest.warns(FutureWarning):
                nn.utils.weight_norm(module)
    found = roles(model)
    trained = ("weight_orig",) if reparametrize == "prune" else ("weight_g", "weight_v")
    for name in trained:
        assert found[f"embed.{name}"][0] is False and found[f"decoder.{name}"][0] is False
    assert found["blocks.0.qkv.weight_orig" if reparametrize == "prune" else "blocks.0.qkv.weight_v"][0] is True


PARAMETRIZATIONS = {"weight_norm": nn.utils.parametrizations.weight_norm,
                    "spectral_norm": nn.utils.parametrizations.spectral_norm,
                    "orthogonal": nn.utils.parametrizations.orthogonal}


@pytest.mark.parametrize("parametrization", PARAMETRIZATIONS)
def test_a_parametrized_weight_is_routed_as_its_module_is(parametrization: str) -> None:
    # The originals a parametrization computes the weight from belong to a ParametrizationList, not to the Linear or
    # Embedding: the head and the embedding went to Muon, and a Conv1d's 3D original was read as an expert bank.
    model = TinyLM()
    parametrize = PARAMETRIZATIONS[parametrization]
    modules = [model.decoder, model.blocks[0].qkv]
    if parametrization == "weight_norm":  # the others need a weight that is one matrix
        modules += [model.embed, model.stem]
    for module in modules:
        parametrize(module)
    found = roles(model)
    matrices = {name: role for name, role in found.items() if ".parametrizations.weight.original" in name}
    for name, (use_muon, layout, _) in matrices.items():
        module = name.split(".parametrizations.")[0]
        if name.endswith("original0"):  # weight_norm's magnitude: a (rows, 1) column, by the shape rule
            assert use_muon is False, name
        elif module in ("decoder", "embed"):
            assert use_muon is False, name
        else:
            assert use_muon is True and layout == ("conv" if module == "stem" else None), name
    assert len(matrices) == (8 if parametrization == "weight_norm" else 2)
    assert len(found) == sum(1 for _ in model.named_parameters())


def test_frozen_parameters_are_left_out_and_join_through_add_param_group() -> None:
    """As timm's groups: a checkpoint of these groups lists no frozen parameter. A backbone unfrozen later joins
    through add_param_group and then trains as in groups built unfrozen."""
    def trained(frozen_at_build: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = TinyLM()
        model.blocks.requires_grad_(not frozen_at_build)
        opt = optimizer.Muon(optimizer.muon_param_groups(model, lr=0.02))
        names = {name for group in opt.param_groups for name in group["param_names"]}
        assert any(name.startswith("blocks.") for name in names) is not frozen_at_build
        if frozen_at_build:
            model.blocks.requires_grad_(True)
            for group in optimizer.muon_param_groups(model.blocks, lr=0.02):
                opt.add_param_group(group)
        for param in model.parameters():
            param.grad = torch.ones_like(param)
        opt.step()
        return [param.detach() for param in model.parameters()]

    for joined, unfrozen in zip(trained(True), trained(False), strict=True):
        assert torch.equal(joined, unfrozen)


def test_tied_head_appears_once_with_adamw() -> None:
    model = TinyLM(tie=True)
    groups = optimizer.muon_param_groups(model)
    listed = [p for group in groups for _, p in group["params"]]
    assert sum(p is model.embed.weight for p in listed) == 1
    assert roles(model)["embed.weight"][0] is False


def test_overrides_reach_every_group_and_the_optimizer_accepts_them() -> None:
    model = TinyLM()
    groups = optimizer.muon_param_groups(model, lr=0.05, adamw_weight_decay=0.3)
    assert all(group["lr"] == 0.05 for group in groups)
    decays = sorted(group["adamw_weight_decay"] for group in groups if group["use_muon"] is False)
    assert decays == [0.0, 0.3]
    optimizer.Muon(groups)


@pytest.mark.parametrize("shape, to_muon", [((2, 256), True), ((256, 2), True), ((2, 257), False), ((257, 2), False),
                                            ((3, 2, 256), True), ((3, 2, 257), False)])
def test_shape_routing_takes_aspect_ratios_up_to_128(shape: tuple[int, ...], to_muon: bool) -> None:
    # README: "a parameter goes to Muon when its matrices have both sides at least 2 and an aspect ratio of at most
    # 128"; 128 itself is in, either way round.
    param = torch.randn(shape)
    param.grad = torch.ones_like(param)
    opt = optimizer.Muon([param])
    opt.step()
    assert ("momentum_buffer" in opt.state[param]) == to_muon


def test_shape_routing_without_groups() -> None:
    matrix, vector, thin, scalar, conv = (torch.randn(8, 8), torch.randn(8), torch.randn(1, 64),
                                          torch.randn(()), torch.randn(4, 2, 3, 3))
    extreme = torch.randn(2, 300)  # aspect ratio 150 > 128: a list of vectors, not a map
    params = [matrix, vector, thin, scalar, conv, extreme]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = optimizer.Muon(params)
    opt.step()
    muon_routed = [p for p in params if "momentum_buffer" in opt.state[p]]
    assert [p.shape for p in muon_routed] == [matrix.shape, conv.shape]


def test_muon_takes_a_lazy_modules_parameters_and_routes_them_at_their_first_step() -> None:
    """As torch's optimizers do: the shape is known once a forward pass has materialized them (reading it before
    raised in the constructor with ns_dtype or verbose set, and in repr)."""
    model = nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.LazyLinear(8))
    opt = optimizer.Muon([dict(params=list(model[0].parameters())),
                          dict(params=list(model[2].parameters()), use_muon=True, ns_dtype=torch.float32,
                               verbose=True)])
    assert "Muon (" in repr(opt)
    with pytest.raises(ValueError, match=r"use_muon=True for parameter #1 of shape \(8,\)"):
        model(torch.randn(2, 12)).sum().backward()
        opt.step()
    weight, bias = model[0].parameters()
    before = weight.detach().clone()
    opt.param_groups[1]["params"] = [model[2].weight]
    opt.step()
    assert "momentum_buffer" in opt.state[weight] and "exp_avg" in opt.state[bias]
    assert "momentum_buffer" in opt.state[model[2].weight] and not torch.equal(weight, before)
