"""Muon in 🤗 Transformers, as a notebook user runs it: GPT-2's Conv1D weights (stored (in, out)) stepped as the
(out, in) matrices they are, and `Trainer` training with our optimizer and resuming from its own checkpoint exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from kernel_under_test import optimizer

transformers = pytest.importorskip("transformers")

VOCAB = 97


class RandomTokens(Dataset):
    def __init__(self, rows: int = 48, length: int = 16) -> None:
        self.tokens = torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def test_gpt2s_conv1d_weights_go_to_muon_as_transposed_matrices() -> None:
    model = tiny_gpt2()
    layouts = {name: (group["use_muon"], group.get("param_layout"))
               for group in optimizer.muon_param_groups(model) for name, _ in group["params"]}
    conv1d = [name for name, module in model.named_modules() if type(module).__name__ == "Conv1D"]
    assert len(conv1d) == 8  # c_attn, c_proj, c_fc and mlp.c_proj in each of the two blocks
    assert all(layouts[f"{name}.weight"] == (None, "transposed") for name in conv1d)
    assert layouts["transformer.wte.weight"] == (False, None)  # the embedding, tied to lm_head
    assert all(layouts[f"{name}.bias"] == (False, None) for name in conv1d)


def test_gpt_oss_expert_banks_go_to_muon_transposed_and_their_biases_to_adamw() -> None:
    """GPT-OSS keeps its experts' banks (E, in, out) (its experts module says `is_transposed`) beside bias banks
    (E, out), which are matrices by shape."""
    config = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                       num_experts_per_tok=2, layer_types=["full_attention"])
    model = transformers.GptOssForCausalLM(config)
    groups = optimizer.muon_param_groups(model)
    layouts = {name: (group["use_muon"], group.get("param_layout"), group.get("adamw_weight_decay"))
               for group in groups for name, _ in group["params"]}
    experts = "model.layers.0.mlp.experts"
    assert layouts[f"{experts}.gate_up_proj"] == layouts[f"{experts}.down_proj"] == (None, "transposed", None)
    assert layouts[f"{experts}.gate_up_proj_bias"] == layouts[f"{experts}.down_proj_bias"] == (False, None, 0.0)
    opt = optimizer.Muon(groups, lr=0.02)
    tokens = RandomTokens()[0]["input_ids"][None]
    model(input_ids=tokens, labels=tokens).loss.backward()
    opt.step()
    assert "momentum_buffer" in opt.state[model.model.layers[0].mlp.experts.gate_up_proj]


def _trainer(output_dir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> transformers.Trainer:
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=8, max_steps=6, save_steps=3, save_only_model=False,
        lr_scheduler_type="cosine", warmup_steps=2, max_grad_norm=1.0, seed=0, use_cpu=True, report_to=[],
        disable_tqdm=True, logging_steps=100)
    return transformers.Trainer(model=model, args=args, train_dataset=RandomTokens(), optimizers=(opt, None))


def test_trainer_trains_with_muon_and_resumes_from_its_checkpoint_exactly(tmp_path: Path) -> None:
    """Trainer saves the optimizer's state_dict (torch.save) with its scheduler's and loads both on resume; the run
    resumed at step 3 must end where the uninterrupted one does, bit for bit."""
    model = tiny_gpt2()
    start = {name: param.detach().clone() for name, param in model.named_parameters()}
    opt = optimizer.Muon(optimizer.muon_param_groups(model), lr=0.02)
    _trainer(tmp_path, model, opt).train()
    c_attn = model.transformer.h[0].attn.c_attn.weight
    assert "momentum_buffer" in opt.state[c_attn]
    assert not torch.equal(c_attn, start["transformer.h.0.attn.c_attn.weight"])
    assert "exp_avg" in opt.state[model.transformer.wte.weight]

    resumed_model = tiny_gpt2()
    resumed_opt = optimizer.Muon(optimizer.muon_param_groups(resumed_model), lr=0.02)
    _trainer(tmp_path, resumed_model, resumed_opt).train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    for (name, ours), theirs in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(ours, theirs), name
    assert [group["lr"] for group in resumed_opt.param_groups] == [group["lr"] for group in opt.param_groups]
