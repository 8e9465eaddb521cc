"""The whole run's configuration, :class:`RunConfig`: every section, the rules that span sections, and the
one-line errors that name each bad field (:func:`validated`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    model_validator,
)

from asyncrl.common.config.base import GROUP_BASELINE_ADVANTAGES, MAX_DEPTH, ConfigError, Section, check_values
from asyncrl.common.config.operations import (
    CheckpointSection,
    HealthSection,
    MonitoringSection,
    StalenessSection,
    TransportSection,
    WeightSyncSection,
)
from asyncrl.common.config.ray import RaySection
from asyncrl.common.config.slurm import SlurmSection
from asyncrl.common.config.training import (
    AlgorithmSection,
    CriticSection,
    DataSection,
    EnvironmentSection,
    EvalSection,
    LearnerSection,
    LoraSection,
    ModelSection,
    RewardSection,
    RolloutSection,
    RunSection,
    TaskSection,
)
from asyncrl.common.redact import redact


class RunConfig(Section):
    """A whole run. Sections group the settings of each part of the system."""

    run: RunSection = Field(default_factory=RunSection)
    model: ModelSection = Field(default_factory=ModelSection)
    task: TaskSection = Field(default_factory=TaskSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    reward: RewardSection = Field(default_factory=RewardSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    learner: LearnerSection = Field(default_factory=LearnerSection)
    critic: CriticSection = Field(default_factory=CriticSection)
    lora: LoraSection = Field(default_factory=LoraSection)
    data: DataSection = Field(default_factory=DataSection)
    staleness: StalenessSection = Field(default_factory=StalenessSection)
    transport: TransportSection = Field(default_factory=TransportSection)
    weight_sync: WeightSyncSection = Field(default_factory=WeightSyncSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    monitoring: MonitoringSection = Field(default_factory=MonitoringSection)
    health: HealthSection = Field(default_factory=HealthSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    environment: EnvironmentSection = Field(default_factory=EnvironmentSection)
    slurm: SlurmSection = Field(default_factory=SlurmSection)
    ray: RaySection = Field(default_factory=RaySection)

    @model_validator(mode="after")
    def _episodes_need_an_environment(self) -> RunConfig:
        if self.rollout.workflow == "multi_turn":
            if not self.environment.name:
                raise ValueError(
                    "rollout.workflow = 'multi_turn' runs episodes in an environment: set environment.name "
                    "(e.g. 'calculator')"
                )
            if self.rollout.stop:
                raise ValueError(
                    "rollout.stop with rollout.workflow = 'multi_turn': a turn ends at the chat template's end of "
                    "turn, which the episode keeps as a token; remove rollout.stop"
                )
        return self

    @model_validator(mode="after")
    def _adapters_have_no_separate_reference(self) -> RunConfig:
        if self.lora.enabled and self.learner.reference_precision is not None:
            raise ValueError(
                f"learner.reference_precision = {self.learner.reference_precision!r} with [lora]: the reference is the "
                "policy's own model with its adapters off, in learner.precision, not a second model; remove "
                "learner.reference_precision"
            )
        return self

    @model_validator(mode="after")
    def _eval_is_scored_as_the_task(self) -> RunConfig:
        # Eval groups carry the run's task label: the reward workers score them with the run's verifier.
        if self.eval.every and self.eval.name not in ("file", self.task.name):
            raise ValueError(
                f"eval.name {self.eval.name!r}: eval prompts are scored by the run's verifier, so eval takes a "
                f'held-out file (name = "file", eval.path) or the run\'s own task {self.task.name!r} with another '
                "eval.seed; eval.every = 0 turns evaluation off"
            )
        return self

    @model_validator(mode="after")
    def _sync_every_fits_the_staleness_bound(self) -> RunConfig:
        lag = weights_lag(self)
        if lag > self.staleness.max_staleness:
            raise ValueError(
                f"weight_sync.sync_every = {self.weight_sync.sync_every}: the actors' weights would lag the learner "
                f"by up to {lag} versions, beyond staleness.max_staleness = {self.staleness.max_staleness}, so their "
                f"groups would be dropped as stale; set staleness.max_staleness >= {lag} or lower sync_every"
            )
        return self

    @model_validator(mode="after")
    def _overlong_follows_the_response_limit(self) -> RunConfig:
        # DAPO's penalty acts on the last `buffer` tokens before `max_tokens`: by default the run's own limit, so that
        # a preset cannot carry a limit the run's responses never reach.
        limit = self.rollout.max_new_tokens
        for function in self.reward.functions:
            if function.name != "overlong":
                continue
            options = function.options
            options.setdefault("max_tokens", limit)
            if isinstance(options["max_tokens"], int):
                options.setdefault("buffer", max(1, options["max_tokens"] // 4))
            start = options["max_tokens"] - options["buffer"] if isinstance(options.get("buffer"), int) else None
            if start is not None and start >= limit:
                raise ValueError(
                    f"reward.functions overlong: max_tokens = {options['max_tokens']} with buffer = "
                    f"{options['buffer']} penalises responses longer than {start} tokens, which "
                    f"rollout.max_new_tokens = {limit} never allows; leave max_tokens out (it follows "
                    "rollout.max_new_tokens) or lower it"
                )
        return self

    @model_validator(mode="after")
    def _responses_leave_room_for_the_prompt(self) -> RunConfig:
        limit = self.model.max_model_len
        for name, tokens in (("rollout", self.rollout.max_new_tokens), ("eval", self.eval.max_new_tokens)):
            if tokens >= limit:
                raise ValueError(
                    f"{name}.max_new_tokens = {tokens} leaves no token for the prompt in model.max_model_len = "
                    f"{limit}; set {name}.max_new_tokens below {limit} or raise model.max_model_len"
                )
        return self

    @model_validator(mode="after")
    def _group_signals_need_a_group(self) -> RunConfig:
        # A group of one response is its own baseline (advantage 0) and has equal rewards (dropped as no signal).
        samples, algorithm = self.rollout.num_samples, self.algorithm
        if self.data.source != "rollouts" or samples >= 2:
            return self
        if algorithm.advantage in GROUP_BASELINE_ADVANTAGES:
            raise ValueError(
                f"rollout.num_samples = {samples} with algorithm.advantage = {algorithm.advantage!r}: a group "
                "baseline compares each response with the others of its prompt, so every advantage would be 0; "
                "set rollout.num_samples >= 2 or an estimator without a group baseline (batch_mean, reinforce_pp, gae)"
            )
        if algorithm.dynamic_sampling:
            raise ValueError(
                f"rollout.num_samples = {samples} with algorithm.dynamic_sampling: a group of one response has "
                "equal rewards and would always be dropped; set rollout.num_samples >= 2 or dynamic_sampling = false"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.run.root) / self.run.name

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str | bytes) -> RunConfig:
        try:
            data = json.loads(text)
        except RecursionError:
            raise ConfigError(f"config JSON: nested more than {MAX_DEPTH} levels deep") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config JSON: {exc}") from None
        except ValueError:  # a number beyond Python's int-string conversion limit
            raise ConfigError(f"config JSON: a number of over {sys.get_int_max_str_digits()} digits") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config JSON: a JSON object is needed, not {type(data).__name__}")
        return validated(data)


def broadcast_overlaps(config: RunConfig) -> bool:
    """Whether a version's broadcast runs while the next step trains: ``weight_sync.overlap`` with ``max_staleness``
    ≥ 1 (synchronous training needs the new weights before its next batch)."""
    return config.weight_sync.overlap and config.staleness.max_staleness >= 1


def weights_lag(config: RunConfig) -> int:
    """Most versions the actors' weights trail the learner's: (sync_every − 1) versions are never sent, and with
    overlap the newest one is still on the wire while the next step trains."""
    return config.weight_sync.sync_every - 1 + int(broadcast_overlaps(config))


def validated(data: dict[str, Any]) -> RunConfig:
    check_values(data, [])
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_explain(exc)) from None


def _explain(exc: ValidationError) -> str:
    """One line per problem, naming the field, what is allowed and what was given (one line in all for one)."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        msg = err["msg"]
        given = err.get("input")
        if err["type"] == "extra_forbidden":
            msg = f"unknown field; allowed here: {', '.join(_allowed_fields(err['loc'][:-1]))}"
        elif err["type"] == "int_type" and isinstance(given, bool):
            msg = "a whole number is needed, not true or false"
        elif err["type"] == "int_type" and isinstance(given, float):
            msg = "a whole number is needed: write it without a decimal point or exponent (TOML reads 1e9 as a float)"
        # A section's own rule was given the whole section: its message names the fields instead.
        got = "" if err["type"] == "missing" or isinstance(given, (dict, BaseModel)) else f" (got {_shown(given)})"
        if not where and msg.startswith("Value error, "):
            lines.append(f"{msg.removeprefix('Value error, ')}{got}")
        else:
            lines.append(f"{where or '(top level)'}: {msg}{got}")
    if len(lines) == 1:
        return f"invalid config: {lines[0]}"
    return "\n  ".join([f"invalid config ({len(lines)} problems):", *lines])


def _shown(value: Any, limit: int = 80) -> str:
    """``value`` as given, secrets redacted, cut to about ``limit`` characters."""
    if isinstance(value, str) and len(value) > 4 * limit:
        value = value[: 4 * limit]
    try:
        text = redact(repr(value))
    except ValueError:  # an integer beyond Python's int-string conversion limit
        return "a number of over 4300 digits"
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-1:]}"


def _allowed_fields(loc: tuple[Any, ...]) -> list[str]:
    model: Any = RunConfig
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return ["(see the config reference)"]
        model = field.annotation
    return sorted(model.model_fields)
