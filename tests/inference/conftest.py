"""Fixtures for the inference engine tests: the tiny random model and engines built on it."""
from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch

from services.inference.engine.core import Engine
from testing.tiny import save_model, tiny_model
from tests.inference.helpers import tiny_config

# The tiny model gains nothing from a second intra-op thread, and on a shared 2-core machine an
# OpenMP team of 2 stalls whenever another process holds a core. Invariant batch sizes are
# calibrated at each warmup, so they follow whatever thread count is in force.
torch.set_num_threads(1)


@pytest.fixture
def var_dir(tmp_path, monkeypatch):
    """The stage's var/ (KEEL_VAR_DIR) for one test: tmp_path/var, not yet made (the stage makes
    what it needs), so tmp_path beside it holds the test's models."""
    monkeypatch.setenv("KEEL_VAR_DIR", str(tmp_path / "var"))
    return tmp_path / "var"


@pytest.fixture(scope="session")
def tiny():
    return tiny_model()


@pytest_asyncio.fixture
async def make_engine(tiny):
    """make_engine(model=None, clock=None, **config overrides) -> a warmed, started Engine."""
    engines = []

    async def make(model=None, clock=None, **overrides) -> Engine:
        kwargs = {"clock": clock} if clock is not None else {}
        engine = Engine(model if model is not None else tiny, tiny_config(**overrides), **kwargs)
        engine.warmup()
        await engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.stop(grace_s=0)



@pytest.fixture(scope="session")
def tiny_memory(tiny):
    """The memory model every tiny engine with the default test config measures at warmup."""
    engine = Engine(tiny, tiny_config())
    engine.warmup()
    return engine.memory


@pytest.fixture(scope="module")
def shared_engine(tiny):
    """One started engine for tests that leave no state behind (validation, refusals)."""
    engine = Engine(tiny, tiny_config())
    engine.warmup()
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.stop(grace_s=0))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny):
    """The tiny model saved as `make model` leaves the real one (config.json + model.safetensors)."""
    return save_model(tiny, tmp_path_factory.mktemp("tiny-model"))
