"""One call of every launcher per kernel configuration that production shapes select."""

from __future__ import annotations

import torch

from kernels.activation import silu_and_mul_triton
from kernels.kv_cache_write import write_kv_cache_triton
from kernels.paged_attention import paged_attention_triton
from kernels.rms_norm import rms_norm_triton
from kernels.rotary import apply_rotary_triton
from tests.kernels.paged_batch import make_paged_batch

DTYPES = (torch.float32, torch.bfloat16)
# (num_heads, num_kv_heads, head_dim, block_size): SmolLM2-135M, Llama-3-8B, an MHA model
ATTENTION_SHAPES = ((9, 3, 64, 16), (32, 8, 128, 16), (16, 16, 128, 32))


def run_attention() -> None:
    for dtype in DTYPES:
        for num_heads, num_kv_heads, head_dim, block_size in ATTENTION_SHAPES:
            shape = (num_heads, num_kv_heads, head_dim, block_size)
            decode = make_paged_batch([3, 40], [1, 1], *shape, dtype=dtype)
            paged_attention_triton(*decode.args)  # one partition
            paged_attention_triton(*decode.args, partition_size=64)  # split-K and reduce
            extend = make_paged_batch([9, 40], [9, 20], *shape, dtype=dtype)
            paged_attention_triton(*extend.args)


def run_elementwise() -> None:
    for dtype in DTYPES:
        x = torch.zeros(2, 576, dtype=dtype)
        rms_norm_triton(x, torch.ones(576, dtype=dtype), 1e-5)
        rms_norm_triton(x, torch.ones(576, dtype=dtype), 1e-5, torch.zeros_like(x))
        q, k = torch.zeros(2, 9, 64, dtype=dtype), torch.zeros(2, 3, 64, dtype=dtype)
        apply_rotary_triton(q, k, torch.zeros(2, dtype=torch.int64), torch.zeros(16, 64))
        silu_and_mul_triton(torch.zeros(2, 2 * 1536, dtype=dtype))
        cache = torch.zeros(4, 16, 3, 64, dtype=dtype)
        write_kv_cache_triton(k, k, cache, cache.clone(), torch.tensor([0, 17]))


def run_all() -> None:
    run_attention()
    run_elementwise()
