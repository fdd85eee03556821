"""The KV copies of a handoff (Engine.read_blocks / write_blocks): exact in every KV cache
format (an 8-bit block's bytes carry its scales), never converted, and, on the CPU, made without
starting OpenMP threads on the helper thread that runs them while a step goes on."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kernels.kv_quant import kv_format
from shared.engine.engine import Engine
from shared.model.loader import LoadedModel
from shared.model.runner import kv_block_bytes
from shared.settings import EngineSettings, KVCacheSettings, ModelSettings

NUM_BLOCKS = 32


def make_engine(loaded: LoadedModel, dtype: str, kv_dtype: str = "auto", memory: int | None = None) -> Engine:
    memory = memory or NUM_BLOCKS * kv_block_bytes(loaded.config, 16, kv_format(kv_dtype, getattr(torch, dtype)))
    settings = EngineSettings(
        model=ModelSettings(dtype=dtype, device="cpu"),  # type: ignore[arg-type]
        kv_cache=KVCacheSettings(memory_bytes=memory, dtype=kv_dtype),  # type: ignore[arg-type]
    )
    return Engine(settings, loaded)


# (model dtype, KV cache dtype)
POOLS = [("float32", "auto"), ("bfloat16", "auto"), ("float32", "int8"), ("float32", "fp8_e4m3")]


def filled(engine: Engine, seed: int) -> torch.Tensor:
    pool = engine.runner.kv_cache
    pool.copy_(torch.randn(pool.shape, generator=torch.Generator().manual_seed(seed)) * 100)
    return pool


@pytest.mark.parametrize(("dtype", "kv_dtype"), POOLS)
def test_blocks_read_from_one_pool_land_bitwise_in_another(loaded_model: LoadedModel, dtype: str, kv_dtype: str) -> None:
    source, target = make_engine(loaded_model, dtype, kv_dtype), make_engine(loaded_model, dtype, kv_dtype)
    source_pool, target_pool = filled(source, 0), filled(target, 1)
    before = target_pool.clone()
    read_ids, write_ids = [5, 2, 9, 30], [1, 7, 3, 12]

    data = source.read_blocks(read_ids)

    assert data.shape == (4, *source_pool.shape[:2], *source_pool.shape[3:])
    assert torch.equal(data, source_pool[:, :, read_ids].movedim(2, 0))
    target.write_blocks(write_ids, data)
    expected = before.clone()
    expected[:, :, write_ids] = source_pool[:, :, read_ids]
    assert torch.equal(target_pool, expected)


@pytest.mark.parametrize(("dtype", "kv_dtype"), POOLS)
def test_blocks_read_into_a_given_buffer_are_the_same_bytes(loaded_model: LoadedModel, dtype: str, kv_dtype: str) -> None:
    engine = make_engine(loaded_model, dtype, kv_dtype)
    filled(engine, 3)
    buffer = torch.empty(engine.kv_blocks_shape(3), dtype=engine.kv_dtype)

    out = engine.read_blocks([4, 1, 8], buffer)

    assert out is buffer and torch.equal(buffer, engine.read_blocks([4, 1, 8]))
    with pytest.raises(ValueError, match=r"KV block buffer is torch.float16\[.*\] on cpu, expected a contiguous"):
        engine.read_blocks([4, 1, 8], buffer.half())
    with pytest.raises(ValueError, match="expected a contiguous"):
        engine.read_blocks([4, 1], buffer)


def test_blocks_of_another_format_are_refused_not_converted(loaded_model: LoadedModel) -> None:
    source, target = make_engine(loaded_model, "bfloat16"), make_engine(loaded_model, "float32")
    with pytest.raises(ValueError, match="KV block data is torch.bfloat16, the pool stores float32"):
        target.write_blocks([4, 0], source.read_blocks([6, 8]))
    # an 8-bit pool's blocks are bytes: float32 data is refused by its dtype, not reinterpreted
    int8 = make_engine(loaded_model, "float32", "int8")
    with pytest.raises(ValueError, match="KV block data has shape"):
        int8.write_blocks([4, 0], target.read_blocks([6, 8]))


def test_the_same_memory_holds_more_blocks_in_narrower_formats(loaded_model: LoadedModel) -> None:
    memory = NUM_BLOCKS * kv_block_bytes(loaded_model.config, 16, torch.float32)
    engines = {kv: make_engine(loaded_model, "float32", kv, memory) for kv in ("auto", "bfloat16", "int8")}
    head_dim = loaded_model.config.head_dim
    # 8 bits a value and 4 bytes of scale a row of head_dim values
    assert {kv: e.stats().kv.num_blocks for kv, e in engines.items()} == {
        "auto": NUM_BLOCKS, "bfloat16": 2 * NUM_BLOCKS, "int8": NUM_BLOCKS * 4 * head_dim // (head_dim + 4)}
    int8 = engines["int8"]
    assert int8.kv_dtype == torch.uint8 and int8.kv_format.name == "int8"
    assert int8.kv_blocks_shape(2)[-1] == head_dim + 4  # codes, then the row's float32 scale


def test_a_block_shape_that_does_not_fit_is_refused(loaded_model: LoadedModel) -> None:
    engine = make_engine(loaded_model, "float32")
    data = engine.read_blocks([1, 2])
    with pytest.raises(ValueError, match="KV block data has shape"):
        engine.write_blocks([1, 2, 3], data)


def num_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_copies_on_a_helper_thread_start_no_openmp_threads(loaded_model: LoadedModel, two_torch_threads: None) -> None:
    # a torch copy this size runs in parallel, and the first parallel region a thread enters
    # starts that thread's own OpenMP team; libgomp then counts more threads than CPUs and
    # stops spin-waiting, which slows every step of the engine thread
    source, target = make_engine(loaded_model, "float32"), make_engine(loaded_model, "float32")
    with ThreadPoolExecutor(max_workers=1) as helper:
        helper.submit(lambda: None).result()
        threads_before = num_threads()
        data = helper.submit(source.read_blocks, list(range(16))).result()
        helper.submit(target.write_blocks, list(range(16, 32)), data).result()
        helper.submit(source.read_blocks, list(range(16)), torch.empty_like(data)).result()
        assert num_threads() == threads_before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_block_views_are_the_pools_own_bytes_in_read_blocks_order(loaded_model: LoadedModel, dtype: str) -> None:
    # what a transport sends from and receives into: the bytes read_blocks gives, and writing
    # them writes the pool
    source, target = make_engine(loaded_model, dtype), make_engine(loaded_model, dtype)
    filled(source, 4)
    target_pool = filled(target, 5)
    before = target_pool.clone()
    views = source.kv_block_views([7, 0, 3])
    assert views is not None
    assert b"".join(views) == source.read_blocks([7, 0, 3]).view(torch.uint8).numpy().tobytes()

    into = target.kv_block_views([2, 9, 4])
    assert into is not None and [len(v) for v in into] == [len(v) for v in views]
    for dst, src in zip(into, views, strict=True):
        dst[:] = src

    assert torch.equal(target.read_blocks([2, 9, 4]), source.read_blocks([7, 0, 3]))
    untouched = [b for b in range(NUM_BLOCKS) if b not in (2, 9, 4)]
    assert torch.equal(target_pool[:, :, untouched], before[:, :, untouched])
