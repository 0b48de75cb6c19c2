"""QK-clip against its definition: the attention logits recomputed from the clipped weights (float64, q = x Wq^T + bq
and k = x Wk^T + bk per head) fall to the threshold for clipped heads and stay exactly as they were for the others."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from kernel_under_test import optimizer, submodule

Muon, QKClipLayer = optimizer.Muon, optimizer.QKClipLayer
TOKENS, MODEL_DIM, HEAD_DIM = 12, 24, 4
# The clipped weights are the fp32 originals times fp32 sqrt(gamma) factors: each factor is off by at most half an
# ulp (6e-8 relative), so a head's recomputed logit is within a few 1e-7 of threshold * S / S_max in relative
# terms; 1e-5 leaves margin and still fails any wrong scale (a missing sqrt is off by a factor of ~S / threshold).
RELATIVE_TOL = 1e-5


def max_logits(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, num_heads: int, num_kv_heads: int,
               bq: torch.Tensor | None = None, bk: torch.Tensor | None = None) -> torch.Tensor:
    """Per query head, the largest scaled dot product q_i . k_j / sqrt(head_dim) over all token pairs (float64)."""
    x, wq, wk = x.double(), wq.double(), wk.double()
    q = x @ wq.T + (0 if bq is None else bq.detach().double())
    k = x @ wk.T + (0 if bk is None else bk.detach().double())
    q = q.view(TOKENS, num_heads, HEAD_DIM).transpose(0, 1)
    k = k.view(TOKENS, num_kv_heads, HEAD_DIM).transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, dim=0)
    return (q @ k.transpose(1, 2) / math.sqrt(HEAD_DIM)).amax(dim=(1, 2))


def attention_weights(num_heads: int, num_kv_heads: int, seed: int, bias: bool = False):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, MODEL_DIM, generator=generator)
    wq = nn.Parameter(torch.randn(num_heads * HEAD_DIM, MODEL_DIM, generator=generator))
    wk = nn.Parameter(torch.randn(num_kv_heads * HEAD_DIM, MODEL_DIM, generator=generator))
    bq = nn.Parameter(torch.randn(num_heads * HEAD_DIM, generator=generator)) if bias else None
    bk = nn.Parameter(torch.randn(num_kv_heads * HEAD_DIM, generator=generator)) if bias else None
    return x, wq, wk, bq, bk


def clip_once(num_heads: int, num_kv_heads: int, bias: bool = False, seed: int = 0):
    """Measures the logits, picks the threshold between the heads (about half exceed it) and clips with a step
    whose parameters have no gradients (so the step itself changes nothing). Returns (before, after, threshold)."""
    x, wq, wk, bq, bk = attention_weights(num_heads, num_kv_heads, seed, bias)
    before = max_logits(x, wq.detach(), wk.detach(), num_heads, num_kv_heads, bq, bk)
    threshold = float(before.median())
    layer = QKClipLayer(wq, wk, num_heads=num_heads, head_dim=HEAD_DIM, num_kv_heads=num_kv_heads,
                        query_bias=bq, key_bias=bk)
    params = [p for p in (wq, wk, bq, bk) if p is not None]
    opt = Muon(params, lr=0.1, qk_clip={0: layer}, qk_clip_threshold=threshold)
    opt.step(qk_logits={0: before.float()})
    after = max_logits(x, wq.detach(), wk.detach(), num_heads, num_kv_heads, bq, bk)
    return before, after, threshold


@pytest.mark.parametrize("bias", [False, True])
def test_mha_clipped_heads_fall_to_the_threshold_and_others_are_unchanged(bias: bool) -> None:
    before, after, threshold = clip_once(num_heads=6, num_kv_heads=6, bias=bias)
    clipped = before > threshold
    assert 0 < clipped.sum() < len(before)
    # Per head the logit scales by exactly threshold / S, so each clipped head lands on the threshold.
    torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], threshold), rtol=RELATIVE_TOL, atol=0)
    assert torch.equal(after[~clipped], before[~clipped])


@pytest.mark.parametrize("bias", [False, True])  # a key bias has the key heads' rows, fewer than the query's
def test_gqa_every_clipped_head_ends_under_the_threshold(bias: bool) -> None:
    heads, kv_heads = 8, 2
    before, after, threshold = clip_once(num_heads=heads, num_kv_heads=kv_heads, bias=bias, seed=3)
    group = heads // kv_heads
    clipped = before > threshold
    assert (after[clipped] <= threshold * (1 + RELATIVE_TOL)).all(), (after, threshold)
    for kv in range(kv_heads):
        members = slice(kv * group, (kv + 1) * group)
        if clipped[members].any():
            # The group's largest logit sets the key scale, so that head lands exactly on the threshold...
            top = before[members].argmax()
            torch.testing.assert_close(after[members][top], torch.tensor(threshold, dtype=torch.float64),
                                       rtol=RELATIVE_TOL, atol=0)
            # ...and heads of the group that were under it only shrink (their key rows are shared).
            assert (after[members][~clipped[members]] <= before[members][~clipped[members]]).all()
        else:
            assert torch.equal(after[members], before[members])


def test_gqa_groups_without_a_clipped_head_are_untouched() -> None:
    x, wq, wk, _, _ = attention_weights(4, 2, seed=5)
    before = max_logits(x, wq.detach(), wk.detach(), 4, 2)
    group_max = before.view(2, 2).amax(dim=1)
    hot = int(group_max.argmax())
    cold = slice(2 * (1 - hot), 2 * (1 - hot) + 2)
    threshold = float(group_max.mean())  # between the two groups' maxima: only the hot group has a clipped head
    original = wq.detach().clone(), wk.detach().clone()
    opt = Muon([wq, wk], qk_clip={"layer": QKClipLayer(wq, wk, 4, HEAD_DIM, num_kv_heads=2)},
               qk_clip_threshold=threshold)
    opt.step(qk_logits={"layer": before.float()})
    after = max_logits(x, wq.detach(), wk.detach(), 4, 2)
    assert torch.equal(after[cold], before[cold])
    cold_query_rows = slice(cold.start * HEAD_DIM, cold.stop * HEAD_DIM)
    cold_key_rows = slice((1 - hot) * HEAD_DIM, (2 - hot) * HEAD_DIM)
    assert torch.equal(wq.detach()[cold_query_rows], original[0][cold_query_rows])
    assert torch.equal(wk.detach()[cold_key_rows], original[1][cold_key_rows])
    assert not torch.equal(wk.detach(), original[1])


def test_clip_follows_the_update_and_names_resolve() -> None:
    """With gradients, the step is the plain Muon step followed by the clip: heads under the threshold match an
    optimizer without QK-clip bit for bit; a clipped head's rows are those rows times sqrt(threshold / S)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"q": nn.Linear(MODEL_DIM, 2 * HEAD_DIM, bias=False),
                           "k": nn.Linear(MODEL_DIM, 2 * HEAD_DIM, bias=False)})
    twin = nn.ModuleDict({name: nn.Linear(MODEL_DIM, 2 * HEAD_DIM, bias=False) for name in ("q", "k")})
    twin.load_state_dict(model.state_dict())
    for module in (model, twin):
        for param in module.parameters():
            param.grad = torch.ones_like(param)
    threshold, logits = 100.0, torch.tensor([400.0, 50.0])
    ours = Muon(model.named_parameters(), lr=0.02,
                qk_clip={0: QKClipLayer("q.weight", "k.weight", num_heads=2, head_dim=HEAD_DIM)},
                qk_clip_threshold=threshold)
    plain = Muon(twin.parameters(), lr=0.02)
    ours.step(qk_logits={0: logits})
    plain.step()
    half = 0.5  # sqrt(100 / 400)
    for name in ("q", "k"):
        mine, theirs = model[name].weight.detach(), twin[name].weight.detach()
        torch.testing.assert_close(mine[:HEAD_DIM], theirs[:HEAD_DIM] * half, rtol=0, atol=0)
        assert torch.equal(mine[HEAD_DIM:], theirs[HEAD_DIM:])


def test_non_finite_logits_clip_nothing() -> None:
    x, wq, wk, _, _ = attention_weights(2, 2, seed=1)
    original = (wq.detach().clone(), wk.detach().clone())
    opt = Muon([wq, wk], qk_clip={0: QKClipLayer(wq, wk, 2, HEAD_DIM)}, qk_clip_threshold=1.0)
    opt.step(qk_logits={0: torch.tensor([math.inf, math.nan])})
    assert torch.equal(wq.detach(), original[0]) and torch.equal(wk.detach(), original[1])


def test_invalid_configuration_names_the_culprit() -> None:
    _, wq, wk, _, _ = attention_weights(2, 2, seed=0)
    layer = QKClipLayer(wq, wk, 2, HEAD_DIM)
    with pytest.raises(ValueError, match="qk_clip_threshold"):
        Muon([wq, wk], qk_clip={0: layer}, qk_clip_threshold=0.0)
    with pytest.raises(ValueError, match=r"qk_clip\[0\].key: shape \(7, 24\)"):
        Muon([wq, wk], qk_clip={0: QKClipLayer(wq, torch.zeros(7, MODEL_DIM), 2, HEAD_DIM)})
    with pytest.raises(ValueError, match="num_kv_heads"):
        Muon([wq, wk], qk_clip={0: QKClipLayer(wq, wk, 2, HEAD_DIM, num_kv_heads=3)})
    with pytest.raises(ValueError, match="'missing.weight' is not the name"):
        Muon([wq, wk], qk_clip={0: QKClipLayer("missing.weight", wk, 2, HEAD_DIM)})
    opt = Muon([wq, wk], qk_clip={0: layer})
    wq.grad = torch.ones_like(wq)
    original = wq.detach().clone()
    with pytest.raises(ValueError, match="qk_logits key 1"):
        opt.step(qk_logits={1: torch.ones(2)})
    assert torch.equal(wq.detach(), original) and not opt.state, "a rejected step must change nothing"
    with pytest.raises(ValueError, match=r"qk_logits\[0\]"):
        opt.step(qk_logits={0: torch.ones(3)})
    with pytest.raises(ValueError, match="no qk_clip layers"):
        Muon([wq, wk]).step(qk_logits={0: torch.ones(2)})


@pytest.mark.parametrize("field", ["query", "key"])
def test_a_projection_stored_in_out_is_refused_before_the_step_changes_anything(field: str) -> None:
    """QK-clip scales head rows of (out, in) weights; a group's param_layout="transposed" says its weights are stored
    (in, out), where the clip would scale input columns. Set on the group after construction, it is found at the
    step that clips."""
    _, wq, wk, _, _ = attention_weights(2, 2, seed=0)
    in_group, other = (wq, wk) if field == "query" else (wk, wq)
    opt = Muon([dict(params=[in_group]), dict(params=[other])], qk_clip={0: QKClipLayer(wq, wk, 2, HEAD_DIM)})
    opt.param_groups[0]["param_layout"] = "transposed"
    for param in (wq, wk):
        param.grad = torch.ones_like(param)
    original = (wq.detach().clone(), wk.detach().clone())
    with pytest.raises(ValueError, match=rf"qk_clip\[0\].{field}: its group has param_layout='transposed'"):
        opt.step(qk_logits={0: torch.tensor([400.0, 50.0])})
    assert torch.equal(wq.detach(), original[0]) and torch.equal(wk.detach(), original[1]) and not opt.state
    opt.step()  # without clipping, such a layout steps as any other


@pytest.mark.parametrize("threshold", [-1.0, 0.0, float("nan"), "100"])
def test_the_clip_function_refuses_a_threshold_the_optimizer_refuses(threshold) -> None:
    # -1 turned the query weights into NaN and 0 zeroed them: qk_clip_ checked nothing Muon's constructor checks.
    _, wq, wk, _, _ = attention_weights(2, 2, seed=1)
    layer = QKClipLayer(wq, wk, num_heads=2, head_dim=HEAD_DIM)
    before = wq.detach().clone()
    with pytest.raises(ValueError, match="qk_clip_threshold"):
        optimizer.qk_clip_({0: layer}, {0: torch.tensor([5.0, 50.0])}, threshold)
    assert torch.equal(wq.detach(), before)


def test_the_clip_function_scales_a_models_parameters_without_no_grad() -> None:
    # In-place on leaf parameters that require grad, it raised unless the caller wrapped it in torch.no_grad().
    _, wq, wk, _, _ = attention_weights(2, 2, seed=1)
    expected = wq.detach().clone()
    expected[HEAD_DIM:] *= math.sqrt(10.0 / 50.0)
    optimizer.qk_clip_({0: QKClipLayer(wq, wk, num_heads=2, head_dim=HEAD_DIM)}, {0: torch.tensor([5.0, 50.0])}, 10.0)
    torch.testing.assert_close(wq.detach(), expected, rtol=1e-6, atol=0)


def test_float64_weights_are_clipped_by_float64_scales() -> None:
    # The logits and scales were float32: a float64 weight took a scale rounded to float32, and a finite logit
    # beyond float32's range (1e39) became inf and clipped nothing.
    weights = [torch.randn(2 * HEAD_DIM, MODEL_DIM, dtype=torch.float64) for _ in range(2)]
    expected = weights[0].clone()
    expected[HEAD_DIM:] *= math.sqrt(100.0 / 1e39)
    layer = QKClipLayer(*weights, num_heads=2, head_dim=HEAD_DIM)
    optimizer.qk_clip_({0: layer}, {0: torch.tensor([5.0, 1e39], dtype=torch.float64)}, 100.0)
    torch.testing.assert_close(weights[0], expected, rtol=4 * torch.finfo(torch.float64).eps, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_weights_are_scaled_with_one_rounding(dtype: torch.dtype) -> None:
    # The float32 scales were rounded to the weights' dtype first, and each product then rounded again: up to a
    # 16-bit ulp off the exact product where a scale given as a Python number rounds once (within half an ulp).
    heads, generator = 64, torch.Generator().manual_seed(0)
    weights = [torch.randn(heads * HEAD_DIM, MODEL_DIM, generator=generator).to(dtype) for _ in range(2)]
    exact = torch.stack(weights).double() * math.sqrt(10.0 / 33.0)  # query and key: each head's gamma, 10 / 33
    optimizer.qk_clip_({0: QKClipLayer(*weights, num_heads=heads, head_dim=HEAD_DIM)},
                       {0: torch.full((heads,), 33.0)}, 10.0)
    finfo = torch.finfo(dtype)
    ulp = (2.0 ** exact.abs().log2().floor() * finfo.eps).clamp(min=finfo.smallest_normal * finfo.eps)
    # Half an ulp from the final rounding, and a few float32 ulps from the scale's and the product's float32 values.
    assert ((torch.stack(weights).double() - exact).abs() <= ulp / 2 + 4 * 2.0**-24 * exact.abs()).all()


@pytest.mark.parametrize("logits, message", [([torch.ones(2)], "a list"), (torch.ones(2), "a Tensor"),
                                             ({0: torch.ones(2, dtype=torch.complex64)}, "complex64")])
def test_logits_of_another_kind_are_refused_naming_qk_logits(logits, message: str) -> None:
    # A list or a bare tensor failed on an attribute or a tensor's truth value; complex logits lost their imaginary
    # part.
    _, wq, wk, _, _ = attention_weights(2, 2, seed=1)
    opt = Muon([wq, wk], qk_clip={0: QKClipLayer(wq, wk, 2, HEAD_DIM)})
    with pytest.raises(ValueError, match=f"Invalid qk_logits.*{message}"):
        opt.step(qk_logits=logits)


def test_the_clip_function_refuses_what_is_not_a_layer() -> None:
    with pytest.raises(ValueError, match=r"qk_clip\[0\]: 'attention' \(expected a QKClipLayer\)"):
        optimizer.qk_clip_({0: "attention"}, {0: torch.tensor([5.0, 50.0])}, 10.0)


def test_the_clip_function_says_it_takes_tensors_where_it_is_given_names() -> None:
    layer = QKClipLayer("blocks.0.attn.q.weight", "blocks.0.attn.k.weight", num_heads=2, head_dim=HEAD_DIM)
    with pytest.raises(ValueError, match="parameter's name, which only Muon resolves"):
        optimizer.qk_clip_({0: layer}, {0: torch.tensor([5.0, 50.0])}, 10.0)


def test_the_clip_function_refuses_a_layer_whose_weights_do_not_fit_its_heads() -> None:
    _, wq, wk, _, _ = attention_weights(2, 2, seed=1)
    layer = QKClipLayer(wq, wk, num_heads=1, head_dim=1)  # 8 rows, where one head of one row was declared
    with pytest.raises(ValueError, match="query"):
        optimizer.qk_clip_({0: layer}, {0: torch.tensor([50.0])}, 10.0)


def test_a_projection_placed_as_pending_partial_sums_is_refused_when_the_layers_are_given(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Partial(): no rank holds the rows' values, so there are no rows to scale; found when the layers are given, not
    # after a step's update.
    from torch.distributed.tensor.placement_types import Partial, Shard  # noqa: PLC0415
    qk_clip = submodule(optimizer, "qk_clip")
    _, wq, wk, _, _ = attention_weights(2, 2, seed=1)
    wq.placements = (Partial(), Shard(0))  # as a DTensor's, read by the check
    monkeypatch.setattr(qk_clip, "is_dtensor", lambda tensor: hasattr(tensor, "placements"))
    with pytest.raises(ValueError, match=r"query: placement Partial\(sum\)"):
        qk_clip.resolve_layers({0: QKClipLayer(wq, wk, num_heads=2, head_dim=HEAD_DIM)}, {})
