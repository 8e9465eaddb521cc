"""Environments for multi-turn episodes: text in, text out, named by the config.

An environment is made for one episode from a dataset row (:class:`EpisodeRow`: the prompt the model saw, the
reference answer, the row's other fields, a seed) and the ``environment.options`` table. The row's prompt is the
first observation. After each model turn the actor calls :meth:`Environment.step` with the turn's text; it returns
the next observation (chat messages, which the chat template turns into tokens), a per-turn reward and whether the
episode is done. :meth:`Environment.score` is the episode's reward once it ends::

    @register_environment("echo")
    class Echo:
        def __init__(self, row: EpisodeRow, options: dict) -> None:
            self.answer, self.said = row.answer, ""

        def step(self, action: str) -> Step:          # may also be ``async def``
            self.said = action
            return Step(done=True)

        def score(self) -> float:
            return float(self.said.strip() == self.answer)

``environment.name`` names a registered environment or an import path ``package.module:Class``; a name on the wire
never selects one. The reward worker scores an episode by replaying the model's turns through a fresh environment
made from the same row and seed (``actors/episode_scoring.py``), so an environment must give the same observations for
the same row, seed and turns — and an actor cannot write observations the environment did not.

An environment that cannot give the same observations again (a clock, an unseeded random source, a web tool, a judge
model) says so with a class attribute, ``replayable = False`` (absent: True; :func:`is_replayable`). Such a run needs
``environment.isolation = "workers"``: its environments run on the run's reward workers, which sign each step's
answer and the score with a key that never leaves them, and the reward worker that scores an episode checks those
signatures against the episode's tokens instead of replaying it (``common/wire/attestation.py``)::

    class Weather:
        replayable = False          # what it says depends on when it is asked

Its observations are ``user`` turns unless the class says otherwise (``observation_roles = ("tool",)``, as every
:class:`ToolEnvironment`): a thinking model's template may keep past reasoning before one role and drop it before
another, and ``rl-learner check-model`` says which holds for the run's environment.

An episode of such an environment cannot move to another worker when its own is lost: it ends as an environment
error, and its group is generated again.

Built-in: ``calculator`` — arithmetic with a ``calc`` tool (:class:`Calculator`); ``python`` — the same questions with a
``python`` tool whose code runs in the sandbox (``common/environments/python_tool.py``); adapters
(``common/environments/gyms.py``): ``skyrl_gym`` and ``textarena``.
"""

from __future__ import annotations

import ast
import itertools
import math
import operator
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.common.environments.tool_calls import parse_tool_calls
from asyncrl.common.registry import Contract, Registry

if TYPE_CHECKING:
    from asyncrl.common.config import RunConfig
    from asyncrl.common.data.prompts import Prompter

Message = dict[str, str]
MAX_OBSERVATION_CHARS = 65536
"""Longest observation (all its messages' contents together) an episode takes; a longer one ends it as an error."""
MAX_TIMED_OUT_VARIANTS = 15
"""Most :attr:`Step.if_timed_out` observations a step may give: each subset of up to four time-limited calls."""


class EnvironmentFailed(RuntimeError):
    """An environment that failed, hung or returned something unusable; the message says which and how."""


class EnvironmentLost(EnvironmentFailed):
    """The reward worker holding an episode's environment is gone (it left, died, or its heartbeat expired): the
    environment, not the episode, is lost; it can be made again elsewhere."""


@dataclass(frozen=True)
class EpisodeRow:
    """What an environment is made from: one dataset row and the episode's seed."""

    prompt: str
    answer: str
    extra: dict[str, Any] = field(default_factory=dict)
    seed: int = 0


@dataclass(frozen=True)
class Step:
    """An environment's answer to one model turn."""

    observation: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    timed_out: bool = False
    """A time limit cut part of this step short (a tool call that ran out of time): on a faster or less loaded
    machine the same turn may get another observation."""
    if_timed_out: list[list[Message]] = field(default_factory=list)
    """The observations this step would have given had some of its time-limited calls run out of time instead (the
    reward worker's replay accepts an episode that recorded one of them: it tells the model only that time ran out)."""

    def observations_given(self) -> list[list[Message]]:
        """Every observation an episode may have recorded for this step: its own, then :attr:`if_timed_out`'s."""
        return [self.observation, *self.if_timed_out]


class Environment(Protocol):
    def step(self, action: str) -> Step | Awaitable[Step]:
        """The environment's answer to the model's turn ``action``."""
        ...

    def score(self) -> float:
        """The episode's reward, once it has ended (done, or cut at ``environment.max_turns`` or a token limit)."""
        ...


EnvironmentFactory = Callable[[EpisodeRow, dict[str, Any]], Environment]
ENVIRONMENTS: Registry[EnvironmentFactory] = Registry(
    "environment",
    Contract("a class Env(row, options) with step(action) and score()", 2, methods=("step", "score")),
    group="environments",
)
"""Environments by the name ``environment.name`` gives (or an import path ``package.module:Class``)."""
register_environment = ENVIRONMENTS.register
# Adapters that need optional packages (common/environments/gyms.py), imported when a run names them.
ENVIRONMENTS.register_path("skyrl_gym", "asyncrl.common.environments.gyms:SkyRLGym")
ENVIRONMENTS.register_path("textarena", "asyncrl.common.environments.gyms:TextArenaGame")
# Runs the model's code in the sandbox of the process that hosts the episode.
ENVIRONMENTS.register_path("python", "asyncrl.common.environments.python_tool:PythonTool")


def is_replayable(name: str) -> bool:
    """Whether environment ``name`` gives the same observations for the same row, seed and turns: its class's
    ``replayable`` attribute, True when it has none (module docstring)."""
    return bool(getattr(ENVIRONMENTS.get(name), "replayable", True))


def observation_roles(name: str) -> tuple[str, ...]:
    """The chat roles of environment ``name``'s observations: its class's ``observation_roles``, ``("user",)`` when it
    has none (a :class:`ToolEnvironment` answers as ``tool``). What the template check probes a thinking model's
    template with (``asyncrl/cli/model_check.py``)."""
    return tuple(getattr(ENVIRONMENTS.get(name), "observation_roles", ("user",)))


def make_environment(name: str, options: dict[str, Any], row: EpisodeRow) -> Environment:
    """The environment ``name`` of ``row``, made in this process; :class:`EnvironmentFailed` when it cannot be."""
    try:
        return ENVIRONMENTS.get(name)(row, dict(options))
    except Exception as exc:
        raise EnvironmentFailed(f"environment {name!r} could not be made: {type(exc).__name__}: {exc}") from exc


def checked_step(value: Any) -> Step:
    """``value`` as a :class:`Step`, or :class:`EnvironmentFailed` saying what is wrong with it."""
    if not isinstance(value, Step):
        raise EnvironmentFailed(f"step returned a {type(value).__name__}, not a Step")
    if not isinstance(value.observation, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value.observation
    ):
        raise EnvironmentFailed("step's observation is not a list of {'role': str, 'content': str} messages")
    size = sum(len(m["content"]) for m in value.observation)
    if size > MAX_OBSERVATION_CHARS:
        raise EnvironmentFailed(f"step's observation holds {size} characters, over {MAX_OBSERVATION_CHARS}")
    if isinstance(value.reward, bool) or not isinstance(value.reward, int | float) or not math.isfinite(value.reward):
        raise EnvironmentFailed(f"step's reward {value.reward!r} is not a finite number")
    if not isinstance(value.done, bool):
        raise EnvironmentFailed(f"step's done {value.done!r} is not a bool")
    if not value.done and not value.observation:
        raise EnvironmentFailed("step is not done but gives no observation for the next turn")
    if not isinstance(value.timed_out, bool) or not isinstance(value.if_timed_out, list):
        raise EnvironmentFailed("step's timed_out is not a bool or its if_timed_out not a list of observations")
    if len(value.if_timed_out) > MAX_TIMED_OUT_VARIANTS:
        variants = len(value.if_timed_out)
        raise EnvironmentFailed(f"step gives {variants} if_timed_out observations, over {MAX_TIMED_OUT_VARIANTS}")
    for variant in value.if_timed_out:
        checked_step(Step(observation=variant, done=value.done))
    return value


def recorded_as_given(step: Step, recorded: Callable[[list[Message]], bool]) -> bool:
    """Whether an episode's recorded observation is one ``step`` gives: its own, or one of its time-limited calls
    stopped at the limit (:attr:`Step.if_timed_out`). ``recorded(observation)`` says whether ``observation`` is what
    was recorded."""
    return any(recorded(observation) for observation in step.observations_given())


def checked_score(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise EnvironmentFailed(f"score {value!r} is not a finite number")
    return float(value)


# --------------------------------------------------------------------------- built-in: calculator

_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_MAX_EXPRESSION = 200
_MAX_MAGNITUDE = 10**18
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")


def calculate(expression: str) -> str:
    """The value of an arithmetic ``expression`` (``+ - * / // %``, parentheses, numbers) as text, or ``error: …``.
    No names, calls or powers: nothing a model writes here can do more than arithmetic on bounded numbers."""
    if len(expression) > _MAX_EXPRESSION:
        return f"error: expression longer than {_MAX_EXPRESSION} characters"
    try:
        value = _evaluate(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as exc:
        return f"error: {exc.msg if isinstance(exc, SyntaxError) else exc}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


def _evaluate(node: ast.AST) -> int | float:
    constant = node.value if isinstance(node, ast.Constant) else None
    if isinstance(constant, (int, float)) and not isinstance(constant, bool):  # True is no number here
        value = constant
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        value = _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        value = _OPERATORS[type(node.op)](_evaluate(node.operand))
    else:
        raise ValueError(f"unsupported {type(node).__name__}: only numbers and + - * / // % ( )")
    if abs(value) > _MAX_MAGNITUDE:
        raise ValueError(f"a value beyond {_MAX_MAGNITUDE:.0e}")
    return value


def final_number(text: str) -> str | None:
    """The last number in ``text``, normalised (``12.0`` → ``12``), or None."""
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    value = float(numbers[-1].replace(",", ""))  # 1,776 is 1776
    return str(int(value)) if value.is_integer() else str(value)


def run_tools(config: RunConfig) -> list[dict[str, Any]]:
    """The tools a run's environment offers the model (its class's ``tool_specs(options)``, OpenAI-style function
    schemas), for the chat template; none outside a ``multi_turn`` run or for an environment without them."""
    if config.rollout.workflow != "multi_turn" or not config.environment.name:
        return []
    specs = getattr(ENVIRONMENTS.get(config.environment.name), "tool_specs", None)
    return list(specs(dict(config.environment.options))) if specs is not None else []


def run_prompter(tokenizer: Any, config: RunConfig) -> Prompter:
    """The prompter of a run: its ``[task]`` section, and the tools of its environment (:func:`run_tools`) offered
    through the chat template."""
    from asyncrl.common.data.prompts import Prompter

    return Prompter.for_tokenizer(tokenizer, config.task, run_tools(config))


def function_spec(name: str, description: str, **arguments: str) -> dict[str, Any]:
    """An OpenAI-style function tool taking string ``arguments`` (name → description), all required."""
    properties = {key: {"type": "string", "description": text} for key, text in arguments.items()}
    parameters = {"type": "object", "properties": properties, "required": list(arguments)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


class ToolEnvironment:
    """A question answered with tools: a turn with ``<tool_call>`` calls (``common/environments/tool_calls.py``) gets
    each call's result back as one ``tool`` message; a turn without a call is the final answer, scored 1.0 when its last
    number equals the row's answer. Malformed calls, unknown tools and calls past ``max_calls`` (option, default 4) get
    an error message instead of a result (and count in :attr:`tool_errors`). A subclass gives its tools in
    :meth:`make_tools`: by name, a function from the call's arguments to the result's text; a tool with a time limit
    names, in :meth:`time_limited`, the one result it gives when it runs out of time, and returns it as
    :class:`OutOfTime` then (text a program printed is never taken for a timeout). Such a tool must not change the
    environment's state: a replay may accept its call as run out of time where it finished."""

    observation_roles = ("tool",)
    """Every observation is a ``tool`` message (:func:`observation_roles`)."""

    def __init__(self, row: EpisodeRow, options: dict[str, Any]) -> None:
        self.tools = self.make_tools(options)
        self.stopped = self.time_limited(options)
        self.answer = final_number(row.answer)
        self.max_calls = int(options.get("max_calls", 4))
        self.calls = 0
        self.tool_errors = 0
        self.correct = False

    def step(self, action: str) -> Step:
        parsed = parse_tool_calls(action)
        if not parsed.any:
            self.correct = self.answer is not None and final_number(action) == self.answer
            return Step(done=True)
        results = [f"error: malformed tool call: {why}" for why in parsed.errors]
        limited: list[tuple[int, str]] = []  # (position, result had it run out of time) of each time-limited call
        for call in parsed.calls:
            self.calls += 1
            if call.name not in self.tools:
                results.append(f"error: unknown tool {call.name!r}; the tools are {', '.join(sorted(self.tools))}")
            elif self.calls > self.max_calls:
                results.append(f"error: more than {self.max_calls} calls")
            else:
                if call.name in self.stopped:
                    limited.append((len(results), self.stopped[call.name]))
                results.append(self.tools[call.name](call.arguments))
        self.tool_errors += sum(r.startswith("error:") for r in results)
        return Step(
            observation=_tool_message(results),
            timed_out=any(isinstance(results[at], OutOfTime) for at, _ in limited),
            if_timed_out=[_tool_message(variant) for variant in _timed_out_variants(results, limited)],
        )

    def score(self) -> float:
        return 1.0 if self.correct else 0.0

    def make_tools(self, options: dict[str, Any]) -> dict[str, Callable[[dict[str, Any]], str]]:
        raise NotImplementedError

    @classmethod
    def tool_specs(cls, options: dict[str, Any]) -> list[dict[str, Any]]:
        """The tools as the chat template offers them to the model (:func:`function_spec`)."""
        return []

    def time_limited(self, options: dict[str, Any]) -> dict[str, str]:
        """The tools with a time limit, each with the result it gives when it runs out of time (whichever limit it
        met first: that depends on the machine's load, so the text must not)."""
        return {}


class OutOfTime(str):
    """A time-limited tool's result when it ran out of time: its :meth:`ToolEnvironment.time_limited` text."""


def _tool_message(results: list[str]) -> list[Message]:
    return [{"role": "tool", "content": "\n".join(results)}]


def _timed_out_variants(results: list[str], limited: list[tuple[int, str]]) -> list[list[str]]:
    """``results`` with each non-empty subset of its time-limited calls that finished (the first four) replaced by
    their out-of-time result: what a more loaded machine could have given for the same turn."""
    finished = [(at, stop) for at, stop in limited if not isinstance(results[at], OutOfTime)][:4]
    variants = []
    for size in range(1, len(finished) + 1):
        for subset in itertools.combinations(finished, size):
            variant = list(results)
            for at, stop in subset:
                variant[at] = stop
            variants.append(variant)
    return variants


@register_environment("calculator")
class Calculator(ToolEnvironment):
    """Arithmetic with a calculator: ``<tool_call>{"name": "calc", "arguments": {"expression": "37*48"}}</tool_call>``
    gets ``1776`` back (:func:`calculate`)."""

    def make_tools(self, options: dict[str, Any]) -> dict[str, Callable[[dict[str, Any]], str]]:
        return {"calc": lambda arguments: calculate(str(arguments.get("expression", "")))}

    @classmethod
    def tool_specs(cls, options: dict[str, Any]) -> list[dict[str, Any]]:
        return calculator_specs()


def calculator_specs() -> list[dict[str, Any]]:
    """:class:`Calculator`'s tool as the chat template offers it (the class itself is typed as the registry's
    factory: its own attributes are not seen through the name)."""
    about = "The value of an arithmetic expression: numbers, + - * / // % and parentheses."
    return [function_spec("calc", about, expression="the expression, e.g. 37*48")]
