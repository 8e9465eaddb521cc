"""Reward functions: a registry of scorers for rollout groups, and their weighted sum.

Every reward function has one signature, ``fn(group, options) -> list[float]``: one score per
response of the :class:`~asyncrl.common.wire.messages.RolloutGroup`, in the group's order. Functions take the
whole group (not one response) so that a reward model can score the K responses in batches.
``options`` is the function's ``options`` table from the run config (``reward.functions``).

A function is named in the config either by its registered name::

    @register_reward("brevity")
    def brevity(group: RolloutGroup, options: dict[str, Any]) -> list[float]: ...

or by an import path ``"package.module:function"`` (resolved with ``importlib`` once per
process), so a user's scorer needs no change to this package.

Built-ins:

=================  ===================================================================
``task``           the task's rule verifier (``common/rewards/verifiers.py``) on each response
``format``         1.0 when a response stopped by itself with a non-empty first line
``overlong``       DAPO's soft overlong punishment (Yu et al. 2025, eq. 13)
``code_tests``     the response's program run against the answer's tests in the sandbox
``reward_model``   a Hugging Face sequence-classification model, scored in batches
``environment``    a multi-turn episode replayed through ``[environment]`` (``actors/episode_scoring.py``)
=================  ===================================================================

:func:`combine` sums the functions' scores with their config weights and keeps each raw score.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncrl.common.config import RewardFunction, RunConfig
from asyncrl.common.data.tasks import task_label
from asyncrl.common.registry import Contract, Registry
from asyncrl.common.rewards.verifiers import Verifier, bind_verifier, first_line, verify_code_tests
from asyncrl.common.wire.messages import RolloutGroup, model_turns

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

RewardFn = Callable[[RolloutGroup, dict[str, Any]], list[Any]]
"""``fn(group, options) -> one score per response, in order``: a number, or one per model turn (:data:`Score`)."""

Caller = Callable[[RewardFunction, RolloutGroup], list["Score"]]
"""How :func:`combine` calls one configured function (the worker adds time limits and retries)."""

_FLOAT32_MAX = 3.4028234663852886e38


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable; the message names the function."""

    def __init__(self, function: str, reason: str) -> None:
        super().__init__(f"reward function {function!r}: {reason}")
        self.function = function
        self.reason = reason


# --------------------------------------------------------------------------- registry

REWARDS: Registry[RewardFn] = Registry(
    "reward function", Contract("f(group, options) -> one score per response", args=2), group="rewards"
)
"""Reward functions by name; a config may also name one by import path ``package.module:function``."""
register_reward = REWARDS.register
get_reward = REWARDS.get
reward_names = REWARDS.names
TIME_LIMIT_ATTRIBUTE = "min_time_limit_s"


def needs_time(limit: Callable[[dict[str, Any]], float]) -> Callable[[RewardFn], RewardFn]:
    """Decorator: a reward function whose one call may need more than ``reward.timeout_s``, ``limit(options)`` seconds
    (the environment replay: each of its steps has a limit of its own, and a call may take them all)."""

    def mark(function: RewardFn) -> RewardFn:
        function.__dict__[TIME_LIMIT_ATTRIBUTE] = limit
        return function

    return mark


RUN_OPTIONS_ATTRIBUTE = "options_from_run"


@dataclass(frozen=True)
class RunFacts:
    """What a reward worker knows of its run when it binds the configured functions (:func:`bind_functions`)."""

    task: str
    """The run's task label (:func:`asyncrl.common.data.tasks.task_label`)."""
    episodes: dict[str, Any] = field(default_factory=dict)
    """What the run's episodes ran in (:func:`episode_options`), with the run's signers on a reward worker."""


def takes_from_run(bind: Callable[[RunFacts, dict[str, Any]], dict[str, Any]]) -> Callable[[RewardFn], RewardFn]:
    """Decorator: a reward function whose options are completed from the run once, when a reward worker starts —
    ``bind(run, options)`` gives the options it is called with (raising ``ValueError`` for options that cannot
    work) — so what it reads is fixed by the config, never by a field of a group that came over a socket."""

    def mark(function: RewardFn) -> RewardFn:
        function.__dict__[RUN_OPTIONS_ATTRIBUTE] = bind
        return function

    return mark


def time_limit(function: RewardFunction, timeout_s: float) -> float:
    """How long one call of the configured ``function`` may take: ``reward.timeout_s`` (``timeout_s``), or what the
    function declares it needs (:func:`needs_time`), whichever is longer."""
    limit = getattr(get_reward(function.name), TIME_LIMIT_ATTRIBUTE, None)
    return max(timeout_s, float(limit(dict(function.options)))) if limit is not None else timeout_s


# --------------------------------------------------------------------------- scoring and combining


Score = float | tuple[float, ...]
"""A response's score: one number, or one per model turn of a multi-turn response (its sum is the score)."""


def score(function: RewardFunction, group: RolloutGroup) -> list[Score]:
    """Call one configured function on ``group`` and check its output: K finite numbers, or for a response one finite
    number per model turn (``common.wire.messages.model_turns``: the runs of its loss mask; a single-turn response has
    one).

    Raises :class:`RewardError` for an output of the wrong length or type, or a non-finite score
    (the wire format refuses NaN and infinity, so the learner could not read such a group).
    """
    raw = get_reward(function.name)(group, dict(function.options))  # a copy: a function cannot edit the config
    k = group.num_samples
    if isinstance(raw, str | bytes) or not hasattr(raw, "__len__"):
        raise RewardError(function.name, f"returned a {type(raw).__name__}, not a list of {k} scores")
    if len(raw) != k:
        raise RewardError(function.name, f"returned {len(raw)} scores for {k} responses")
    scores: list[Score] = []
    for i, value in enumerate(raw):
        if isinstance(value, list | tuple):
            turns = model_turns(group.trained(i))
            if len(value) != turns:
                raise RewardError(function.name, f"score {i} has {len(value)} turn rewards for {turns} model turns")
            scores.append(tuple(_number(function, f"score {i}, turn {t}", v) for t, v in enumerate(value)))
        else:
            scores.append(_number(function, f"score {i}", value))
    return scores


def _number(function: RewardFunction, what: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RewardError(function.name, f"{what} is a {type(value).__name__}, not a number") from None
    if not math.isfinite(number):
        raise RewardError(function.name, f"{what} is not finite ({number})")
    return number


def detail_keys(functions: Sequence[RewardFunction]) -> list[str]:
    """The key of each function in a response's details: its name, then ``name#2``, ``name#3`` for repeats."""
    keys: list[str] = []
    seen: dict[str, int] = {}
    for function in functions:
        seen[function.name] = seen.get(function.name, 0) + 1
        keys.append(function.name if seen[function.name] == 1 else f"{function.name}#{seen[function.name]}")
    return keys


def combine(
    group: RolloutGroup, functions: Sequence[RewardFunction], call: Caller = score
) -> tuple[list[float], list[dict[str, float]], np.ndarray]:
    """The weighted sum of the functions' scores, each function's raw score per response, and the turn rewards.

    ``reward_i = Σ_f weight_f · score_f,i``; ``details[i][key_f] = score_f,i`` (keys from :func:`detail_keys`). A
    function that scores a response per model turn (:data:`Score`) counts with the sum of its turns, and its
    weighted turn scores make the group's ``turn_rewards`` (``common.wire.messages.ScoredGroup``; empty when no function
    scores turns). ``call`` runs one function (default :func:`score`; the reward worker passes one with a time limit
    and retries). Raises :class:`RewardError` when a weighted sum overflows float32, the replay stream's dtype.
    """
    k = group.num_samples
    rewards = [0.0] * k
    details: list[dict[str, float]] = [{} for _ in range(k)]
    turns: list[np.ndarray | None] = [None] * k
    for key, function in zip(detail_keys(functions), functions, strict=True):
        for i, value in enumerate(call(function, group)):
            if isinstance(value, tuple):
                shares = function.weight * np.asarray(value, np.float64)
                previous = turns[i]
                turns[i] = shares if previous is None else previous + shares
                value = sum(value)
            rewards[i] += function.weight * value
            details[i][key] = value
    if not all(abs(r) <= _FLOAT32_MAX for r in rewards):
        raise RewardError(",".join(f.name for f in functions), f"weighted sum {rewards} overflows float32")
    if all(t is None for t in turns):
        return rewards, details, np.zeros(0, np.float32)
    packed = np.concatenate(
        [t if t is not None else np.zeros(model_turns(group.trained(i))) for i, t in enumerate(turns)]
    )
    if not np.all(np.abs(packed) <= _FLOAT32_MAX):
        raise RewardError(",".join(f.name for f in functions), "a weighted turn reward overflows float32")
    return rewards, details, packed.astype(np.float32)


def check_functions(functions: Sequence[RewardFunction]) -> None:
    """Resolve every configured function now (an unknown name or a bad import path raises ``ValueError``)."""
    if not functions:
        raise ValueError("reward.functions is empty: configure at least one reward function")
    for function in functions:
        get_reward(function.name)


def bind_functions(
    functions: Sequence[RewardFunction], task: str, episodes: dict[str, Any] | None = None
) -> list[RewardFunction]:
    """The configured functions, all resolved now, each with the options it takes from the run (:func:`takes_from_run`)
    filled in: the ``task`` function's verifier (the run's task label ``task`` unless the config names one), an
    ``environment`` function's ``[environment]`` and model folder (``episodes``, from :func:`episode_options`).
    ``ValueError`` naming the function for one that cannot work."""
    check_functions(functions)
    run = RunFacts(task, dict(episodes or {}))
    return [_bound(function, run) for function in functions]


def _bound(function: RewardFunction, run: RunFacts) -> RewardFunction:
    bind = getattr(get_reward(function.name), RUN_OPTIONS_ATTRIBUTE, None)
    return function if bind is None else function.model_copy(update={"options": bind(run, dict(function.options))})


def episode_options(config: RunConfig) -> dict[str, Any]:
    """The options :func:`bind_functions` gives an ``environment`` function: what the run's episodes ran in, and the
    run whose reward workers sign what an environment that cannot be replayed said."""
    return {"environment": config.environment.model_dump(), "model": config.model.path, "run": config.run.name}


def check_names(functions: Sequence[RewardFunction]) -> None:
    """Each configured function is a registered name, or an import path to a reward function (``f(group, options)``:
    :data:`REWARDS`' contract); ``ValueError`` naming the setting otherwise. What the learner checks in a config: a
    registered function is not imported here (``reward_model`` loads transformers, ``environment`` the actors' code,
registered by ``asyncrl.actors``),
    an import path is (the user's own code), so that ``os:system`` is refused before anything starts."""
    for i, function in enumerate(functions):
        if ":" in function.name or function.name not in REWARDS:
            get_reward(function.name, f"reward.functions[{i}].name")


def check_options(functions: Sequence[RewardFunction], task: str) -> None:
    """The options of each configured function already in memory (registered by its object, as the built-ins of this
    module are) bound as :func:`bind_functions` binds them, without importing any other (what the learner checks in a
    config: a ``task`` function's typo'd verifier option raises ``ValueError`` before anything starts)."""
    run = RunFacts(task)
    for function in functions:
        if REWARDS.loaded(function.name) is not None:
            _bound(function, run)


def run_verifier(config: RunConfig) -> Verifier:
    """The verifier of a run whose reward is its one ``task`` function at weight 1, bound as the reward workers bind
    it (the run's task label unless the config names another, with its options): what a peer trainer scoring the
    same responses calls. Any other reward raises ``ValueError`` naming it."""
    functions = config.reward.functions
    if len(functions) != 1 or functions[0].name != "task" or functions[0].weight != 1.0:
        named = ", ".join(f"{f.name} (weight {f.weight:g})" for f in functions)
        raise ValueError(f"reward.functions: one 'task' function at weight 1 is needed here, got {named}")
    [task] = bind_functions(functions, task_label(config.task))
    return task_verifier(task.options)


def task_verifier(options: dict[str, Any]) -> Verifier:
    """The verifier a ``task`` function's options name, with the rest of its options (``pattern`` for ``regex``, …)
    bound (:func:`asyncrl.common.rewards.verifiers.bind_verifier`: an option it does not declare raises
    ``ValueError``)."""
    return bind_verifier(str(options["verifier"]), {k: v for k, v in options.items() if k != "verifier"})


# --------------------------------------------------------------------------- built-in rule rewards


def _task_options(run: RunFacts, options: dict[str, Any]) -> dict[str, Any]:
    """The ``task`` function's options: the run's task label as its verifier unless the config names one, checked."""
    bound = {"verifier": run.task, **options}
    task_verifier(bound)
    return bound


@register_reward("task")
@takes_from_run(_task_options)
def task_reward(group: RolloutGroup, options: dict[str, Any]) -> list[float]:
    """The rule verifier named by ``options["verifier"]`` on each response.

    The verifier comes from the config (:func:`bind_functions` sets it to the run's task label unless the config
    names one, e.g. ``"math"`` for a ``file`` task), never from ``group.task``. The other options are the verifier's
    (``reward.functions = [{name = "task", options = {verifier = "regex", pattern = 'Answer: (\\w+)'}}]``). A
    malformed ``group.answer`` raises (a data bug).
    """
    if not options.get("verifier"):
        raise ValueError("task needs options.verifier (bind_functions sets it from the run's task)")
    verify = task_verifier(options)
    return [verify(text, group.answer) for text in group.texts]


@register_reward("format")
def format_reward(group: RolloutGroup, options: dict[str, Any]) -> list[float]:
    """1.0 when a response ended by itself and put something on its first line, else 0.0.

    "Ended by itself" is finish reason ``stop`` (an end-of-sequence token or a stop string), not
    ``length`` (cut at the token limit) or ``abort``. The first line is judged as the rule verifiers
    judge it (:func:`asyncrl.common.rewards.verifiers.first_line`: up to the first newline, whitespace stripped), so
    this rewards the shape of an answer — one answer first, then stop — regardless of its correctness.
    """
    return [
        1.0 if reason == "stop" and first_line(text) else 0.0
        for text, reason in zip(group.texts, group.finish_reasons, strict=True)
    ]


@register_reward("overlong")
def overlong_reward(group: RolloutGroup, options: dict[str, Any]) -> list[float]:
    """DAPO's soft overlong punishment of each response's length ``|y|`` in tokens.

    With ``L_max = options["max_tokens"]`` and the buffer ``L_cache = options["buffer"]``
    (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", eq. 13)::

        R(y) = 0                                    if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
             = -1                                   if |y| > L_max

    The penalty falls linearly from 0 to -1 across the last ``L_cache`` tokens before ``L_max``.
    Combine it with weight 1 next to the task reward, as DAPO does.
    """
    max_tokens, buffer = options.get("max_tokens"), options.get("buffer")
    if not (isinstance(max_tokens, int) and isinstance(buffer, int) and 0 < buffer <= max_tokens):
        raise ValueError(f"overlong needs integer options 0 < buffer <= max_tokens, got {options!r}")
    start = max_tokens - buffer
    return [_overlong(int(n), start, max_tokens, buffer) for n in group.lengths]


def _overlong(length: int, start: int, max_tokens: int, buffer: int) -> float:
    if length <= start:
        return 0.0
    if length <= max_tokens:
        return (start - length) / buffer
    return -1.0


@register_reward("code_tests")
def code_tests_reward(group: RolloutGroup, options: dict[str, Any]) -> list[float]:
    """1.0 per response whose program passes the tests in ``group.answer`` in the sandbox, else 0.0.

    The program is the response's first fenced code block, else the whole response
    (:func:`asyncrl.common.rewards.verifiers.verify_code_tests`); the tests, not the program's exit status, decide the
    score (``sys.exit(0)`` or ``os._exit(0)`` before the tests end scores 0). Each run is a separate
    subprocess with CPU, memory and wall-clock limits (``common/sandbox/``: 5 s wall by default), so even
    an abandoned call ends by itself — though an abandoned call still delays the process's exit until its
    sandboxes have ended.
    Up to ``options["workers"]`` (default: the CPU count) sandboxes run at once; size the worker's
    ``reward.timeout_s`` for ``ceil(K / workers)`` sandbox runs.
    """
    workers = int(options.get("workers", os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=max(1, min(workers, group.num_samples))) as pool:
        return list(pool.map(lambda text: verify_code_tests(text, group.answer), group.texts))


# --------------------------------------------------------------------------- reward model

_MODELS: dict[str, tuple[PreTrainedModel, PreTrainedTokenizerBase]] = {}
_MODEL_LOCK = threading.Lock()
_TOKENIZE_LOCK = threading.Lock()  # a fast tokenizer is not reentrant: a retry may overlap an abandoned call


@register_reward("reward_model")
def reward_model_reward(group: RolloutGroup, options: dict[str, Any]) -> list[float]:
    """The scalar output of a sequence-classification model on ``prompt + response``, per response.

    ``options``: ``path`` (a local Hugging Face ``AutoModelForSequenceClassification`` folder with its
    tokenizer), ``batch_size`` (default 16), ``label`` (the logit to use, default 0), ``max_length``
    (default the model's ``max_position_embeddings``). The model is loaded once per process, kept in
    float32 on the CPU, and run under ``torch.no_grad``. Sequences are right-padded (the model reads
    the last non-pad token, so padding changes nothing) and truncated on the left, because the end of
    the response is what is being judged.
    """
    import torch

    if not options.get("path"):
        raise ValueError("reward_model needs options.path: a local sequence-classification model folder")
    model, tokenizer = load_reward_model(str(options["path"]))
    batch_size = int(options.get("batch_size", 16))
    label = int(options.get("label", 0))
    max_length = int(options.get("max_length", getattr(model.config, "max_position_embeddings", 2048)))
    texts = [group.prompt + text for text in group.texts]
    scores: list[float] = []
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            with _TOKENIZE_LOCK:
                batch = tokenizer(
                    texts[start : start + batch_size],
                    padding=True,
                    truncation=True,
                    max_length=max_length,
                    return_tensors="pt",
                )
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            scores += logits[:, label].float().tolist()
    return scores


def load_reward_model(path: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer in ``path``, loaded on first use and cached for the process."""
    with _MODEL_LOCK:  # concurrent first calls (e.g. a retry of a slow load) must not load it twice
        if path not in _MODELS:
            import torch
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path)
            tokenizer.padding_side, tokenizer.truncation_side = "right", "left"
            if tokenizer.pad_token_id is None:
                raise ValueError(f"reward model {path}: its tokenizer has no pad token, needed to score in batches")
            model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
            if model.config.pad_token_id is None:
                model.config.pad_token_id = tokenizer.pad_token_id
            _MODELS[path] = (model.eval(), tokenizer)
        return _MODELS[path]
