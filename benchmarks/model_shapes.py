"""The Newton-Schulz matrices of whole models, as `plan_step` takes them (nn.Linear weights are (out, in); expert
banks (experts, out, in)). Shared by the balance tests and the scale predictions."""

from __future__ import annotations


def llama(layers: int, hidden: int, kv: int, intermediate: int) -> list[tuple[int, ...]]:
    """q, k, v, o, gate, up, down per layer."""
    return [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (intermediate, hidden),
            (intermediate, hidden), (hidden, intermediate)] * layers


GPT2_SMALL = [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12
LLAMA_3_8B = llama(32, 4096, 1024, 14336)
LLAMA_3_70B = llama(80, 8192, 1024, 28672)
# Multi-head latent attention (q down/up, kv down/up, output) in 61 layers, 3 dense MLP layers, then 58 MoE layers of
# 256 routed experts (three banks) beside one shared expert.
DEEPSEEK_V3_LIKE = ([(1536, 7168), (24576, 1536), (576, 7168), (32768, 512), (7168, 16384)] * 61
                    + [(18432, 7168), (18432, 7168), (7168, 18432)] * 3
                    + [(256, 2048, 7168), (256, 2048, 7168), (256, 7168, 2048),
                       (2048, 7168), (2048, 7168), (7168, 2048)] * 58)
