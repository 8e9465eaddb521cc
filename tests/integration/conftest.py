"""Fixtures shared by the learner-side integration tests (DeepSpeed engines in the pytest process)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.common.data.tasks import TASK_ALPHABET
from asyncrl.common.plane.redis_server import free_port
from asyncrl.common.tiny_models.character import init_model


@pytest.fixture(scope="module")
def one_rank_world() -> Iterator[None]:
    """This pytest process is a one-rank world (engines start gloo in it); launcher variables are restored after.
    A module uses it with ``pytestmark = pytest.mark.usefixtures("one_rank_world")``."""
    with pytest.MonkeyPatch.context() as patch:
        single = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
        for key, value in {**single, "MASTER_PORT": str(free_port()), "DS_ACCELERATOR": "cpu"}.items():
            patch.setenv(key, value)
        yield


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly initialised tiny Llama over the task alphabet (seed 0), shared by a module's tests."""
    return init_model(tmp_path_factory.mktemp("tiny") / "model", alphabet=TASK_ALPHABET, seed=0)
