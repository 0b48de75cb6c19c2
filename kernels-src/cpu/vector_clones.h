#pragma once
// MUON_VECTOR_CLONES: the hot loops are also compiled for x86-64-v4 (AVX-512) and x86-64-v3 (AVX2, FMA), and the
// widest the CPU runs is picked when the library loads. v3 measured 2.4x faster than the SSE2 baseline for bfloat16
// buffers; v4 over v3, on the 2-core Xeon with AMX (paired, two builds in one process): int8-state AdamW on GPT-2's
// 50257x768 embedding 82 -> 64 ms (its stochastic e4m3 coding is arithmetic, not memory, bound), the GPT-2-small
// step 2-3% faster, bf16 state unchanged (bound by memory). CPUs without AVX2 run the default clone.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MUON_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MUON_VECTOR_CLONES
#endif
