"""Fixtures shared by the whole suite: the real default model, loaded once per session."""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Iterator

import pytest
import torch

# the Triton interpreter must be chosen before anything (transformers included) imports triton
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from services.launcher.redis_server import RedisServer  # noqa: E402
from shared.model.loader import LoadedModel, load_model  # noqa: E402
from shared.model.paths import default_model_path  # noqa: E402

# Tests talk to a real Redis: REDIS_URL when set, else a private server started for this run.
# Started on import, not in pytest_configure: a run of one file also loads that directory's
# conftest before pytest_configure, and modules it imports read REDIS_URL when they load.
_private_redis: RedisServer | None = None
if "REDIS_URL" not in os.environ:
    _private_redis = RedisServer()
    os.environ["REDIS_URL"] = _private_redis.start()


def pytest_unconfigure(config: pytest.Config) -> None:
    if _private_redis is not None:
        _private_redis.stop()


_LIBC = ctypes.CDLL(None)


@pytest.fixture(scope="module", autouse=True)
def give_memory_back() -> None:
    """Returns to the system, before each module, what the modules before it freed: glibc keeps it
    in its arenas, and with the test process on 2-10 GiB the stacks that later modules start fault
    their pages in 2-3x slower on this VM (a 4-worker stack in 30 s, not 13)."""
    gc.collect()
    _LIBC.malloc_trim(0)


@pytest.fixture(scope="session")
def model_path() -> str:
    return str(default_model_path())


@pytest.fixture(scope="session")
def loaded_model(model_path: str) -> LoadedModel:
    return load_model(model_path)


@pytest.fixture
def two_torch_threads() -> Iterator[None]:
    """torch on 2 intra-op threads for the test, as on the 2-core machines CI runs on."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)
