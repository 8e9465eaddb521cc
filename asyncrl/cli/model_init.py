"""What ``rl-learner init-model`` makes: a tiny task or agent model (and its warm start), or a published shape."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import typer


def init_shaped(out: Path, shape: str, dtype: str, layers: int | None, seed: int, refused: tuple) -> None:
    """``init-model --shape``: the published architecture ``shape`` at ``layers`` deep (default: its own)."""
    from asyncrl.cli.util import fail
    from asyncrl.common.tiny_models.character import model_fingerprint
    from asyncrl.common.tiny_models.shapes import SHAPES, init_shaped_model

    if shape not in SHAPES:
        fail(f"--shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    if refused[0] is not None or refused[1]:
        fail(
            "--shape sets the widths and is never warm-started (random weights, for systems work): drop --hidden "
            "and --warm-steps, or leave out --shape"
        )
    size = SHAPES[shape].parameters(layers)
    typer.echo(f"writing {shape} ({size / 1e6:,.0f} M parameters, {dtype}) to {out}", err=True)
    folder = init_shaped_model(out, shape, dtype=dtype, layers=layers, seed=seed)
    typer.echo(f"wrote {folder} (sha256 {model_fingerprint(folder)[:16]})", err=True)


def _task_model() -> tuple[Callable, Callable]:
    from functools import partial

    from asyncrl.common.data.tasks import TASK_ALPHABET
    from asyncrl.common.tiny_models.character import init_model, warm_start

    return partial(init_model, alphabet=TASK_ALPHABET), warm_start


def _agent_model() -> tuple[Callable, Callable]:
    from functools import partial

    from asyncrl.common.tiny_models.agent import AGENT_WARM_START, init_agent_model, warm_start_calculator

    return partial(init_agent_model, layers=4), partial(warm_start_calculator, **AGENT_WARM_START)


MODEL_KINDS: dict[str, Callable[[], tuple[Callable, Callable]]] = {"task": _task_model, "agent": _agent_model}
"""``init-model --kind``: what makes the folder, and what warm-starts it on (prompt, answer) pairs."""
