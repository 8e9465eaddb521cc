"""The run's model folder checked against its config before any process starts (``rl-learner check-model``, and
``rl-launch run`` before its children): what an actor or the learner would otherwise find minutes into the run.

- the folder loads: ``config.json`` and the tokenizer, read by transformers as the learner and vLLM read them;
- ``model.max_model_len`` within the model's context (``cli/preflight.py: check_model_context``);
- the vocabulary is consistent: the tokenizer's ids and its special tokens (EOS, BOS, pad, unknown, and the EOS ids
  ``config.json`` and ``generation_config.json`` name) all index rows of the model's embedding
  (``config.json``'s ``vocab_size``; it may be padded beyond the tokenizer, never short of it);
- the prompt of one task row, and of one eval row when the run evaluates, rendered as the model will see it (the chat
  template, the system prompt, the tools of the run's environment), with its length in tokens.

Whether vLLM can build the engine and sample one token with the run's settings is ``rl-actor check-model``'s part
(vLLM lives with the actors); ``rl-learner check-model`` runs it as a child process. Each problem is a
``ValueError`` naming the setting and the fix.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.cli.preflight import check_model_context
from asyncrl.common.config import RunConfig
from asyncrl.common.environments.protocol import run_prompter

SPECIAL_TOKENS = ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id")


@dataclass
class RenderedRow:
    """One prompt as the model sees it."""

    source: str
    """Where it comes from: ``task`` or ``eval``."""
    text: str
    token_ids: list[int]


@dataclass
class ModelReport:
    """What the folder checks found: the figures shown to the user, and the rendered rows."""

    folder: Path
    context: int | None
    tokenizer_tokens: int
    embedding_rows: int
    special: dict[str, int | None]
    rows: list[RenderedRow] = field(default_factory=list)


def check_model_folder(config: RunConfig) -> ModelReport:
    """Every folder check of the module docstring; ``ValueError`` at the first problem."""
    from asyncrl.common.data.prompts import model_vocab_size

    folder = Path(config.model.path)
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"model.path: {folder} holds no config.json; point model.path at a Hugging Face model folder "
            "(rl-learner init-model CONFIG makes a tiny one)"
        )
    tokenizer = _load_tokenizer(folder)
    context = check_model_context(config)
    rows = model_vocab_size(folder)
    special = _special_ids(folder, tokenizer)
    check_vocabulary(len(tokenizer), rows, special, folder)
    try:
        prompter = run_prompter(tokenizer, config)
    except ValueError as exc:
        raise ValueError(f"task.chat: {exc}") from None
    return ModelReport(folder, context, len(tokenizer), rows, special, rendered_rows(config, prompter))


def check_vocabulary(tokens: int, rows: int, special: dict[str, int | None], folder: Path) -> None:
    """Every token id the tokenizer can produce, and every special id, indexes a row of the embedding."""
    if tokens > rows:
        raise ValueError(
            f"model.path: the tokenizer of {folder} has {tokens} tokens but the model's embedding has {rows} rows "
            "(vocab_size in config.json), so the last ids would index past it; resize the embedding "
            "(model.resize_token_embeddings(len(tokenizer))) and save the folder again, or use the model's own "
            "tokenizer"
        )
    outside = {name: i for name, i in special.items() if i is not None and not 0 <= i < rows}
    if outside:
        named = ", ".join(f"{name} = {i}" for name, i in outside.items())
        raise ValueError(
            f"model.path: {named} in {folder} is not a row of the model's {rows}-row embedding; fix the id in "
            "config.json, generation_config.json or the tokenizer's special tokens"
        )


def rendered_rows(config: RunConfig, prompter: Any) -> list[RenderedRow]:
    """The first row the run's task draws and, when the run evaluates, its first eval row, as the model sees
    them; ``ValueError`` naming the section when a row cannot be rendered."""
    from asyncrl.common.data.evaluation import eval_examples
    from asyncrl.learner.intake.dispatcher import prompt_source

    task, _label = prompt_source(config.task)
    rows = [_render("task", prompter, lambda: task.sample(random.Random(config.run.seed)))]
    if config.eval.every > 0:
        rows.append(_render("eval", prompter, lambda: eval_examples(config, prompter)[0], applied=True))
    return rows


def _render(source: str, prompter: Any, example: Any, applied: bool = False) -> RenderedRow:
    section = "[task]" if source == "task" else "[eval]"
    try:
        drawn = example()
        text = drawn.prompt if applied else prompter.text(drawn)
    except IndexError:
        raise ValueError(f"{section}: the {source} set has no row") from None
    except Exception as exc:  # a template that raises, a row it cannot carry, a file that cannot be read
        raise ValueError(f"{section}: its first row cannot be rendered for the model: {exc}") from None
    return RenderedRow(source, text, list(prompter.encode(text)))


def _load_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError… for a folder it cannot read
        raise ValueError(f"model.path: transformers cannot load the tokenizer of {folder}: {exc}") from None


def _special_ids(folder: Path, tokenizer: Any) -> dict[str, int | None]:
    """The tokenizer's special ids, and the EOS ids of ``config.json`` and ``generation_config.json`` (an int or a
    list there; each is named apart)."""
    special: dict[str, int | None] = {name: getattr(tokenizer, name, None) for name in SPECIAL_TOKENS}
    for file in ("config.json", "generation_config.json"):
        try:
            value = json.loads((folder / file).read_text()).get("eos_token_id")
        except (OSError, ValueError):
            continue
        for i, eos in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(eos, int):
                special[f"{file}: eos_token_id" + (f"[{i}]" if isinstance(value, list) else "")] = eos
    return special


def report_lines(report: ModelReport, config: RunConfig) -> list[str]:
    """What ``rl-learner check-model`` prints of the folder checks."""
    context = "unknown" if report.context is None else str(report.context)
    eos = report.special.get("eos_token_id")
    lines = [
        f"model: {report.folder}: context {context} tokens, model.max_model_len {config.model.max_model_len}",
        f"vocabulary: {report.tokenizer_tokens} tokenizer tokens within {report.embedding_rows} embedding rows; "
        f"eos {eos}, every special id in range",
    ]
    if (episodes := episode_mode(config)) is not None:
        lines.append(episodes)
    for row in report.rows:
        lines.append(f"{row.source} row as the model sees it ({len(row.token_ids)} tokens):")
        lines += [f"  | {line}" for line in row.text.splitlines() or [""]]
    return lines


def episode_mode(config: RunConfig) -> str | None:
    """How a ``multi_turn`` run's episodes are kept and scored, in one line (None for any other run): one sequence
    each with the environment's turns appended as the template renders them (a template that keeps past reasoning, or
    a run that keeps it against the template: ``environment.past_reasoning = "keep"``), or per turn, each turn on the
    context the template serves (one that drops it); and whether the reward worker replays the environment or checks
    its workers' signatures. The config passed :func:`~asyncrl.cli.preflight.check_episodes` (a template it
    refuses never gets here)."""
    if config.rollout.workflow != "multi_turn":
        return None
    from asyncrl.common.environments.protocol import is_replayable, observation_roles
    from asyncrl.common.environments.turns import episode_tools

    section = config.environment
    tools = episode_tools(config.model.path, section.past_reasoning)
    scored = (
        "replayed by the reward worker to score"
        if is_replayable(section.name)
        else "cannot be replayed: scored from the reward workers' signatures"
    )
    if tools.per_turn:
        roles = observation_roles(section.name)
        rows = (
            f"but keeps it before this environment's observations ({', '.join(roles)} turns), so each episode stays "
            "one row, trained on the context it is served in (a new row would start wherever the template rewrote "
            "the past)"
            if tools.encoder.keeps_past_reasoning(roles)
            else "so each model turn is generated and trained on the context the template renders at that turn (a "
            "new training row wherever it rewrote the past; environment.past_reasoning = 'keep' keeps one sequence "
            "instead)"
        )
        return (
            f"episodes: per turn, environment {section.name!r} ({scored}); the chat template drops past reasoning "
            f"once a later user turn follows, {rows}"
        )
    reasoning = (
        "the chat template keeps past reasoning, so every turn is trained on the context it is served in"
        if tools.encoder.keeps_past_reasoning()
        else "past reasoning kept as generated (environment.past_reasoning = 'keep'), which the chat template drops "
        "once a later turn follows: later turns are trained on a context the served model does not see"
    )
    return (
        f"episodes: one sequence each, environment {section.name!r} ({scored}), its turns appended as the chat "
        f"template renders them; {reasoning}"
    )
