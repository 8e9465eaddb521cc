"""An episode as token ids: model turns as sampled, environment turns tokenized once with the chat template.

A multi-turn episode is one response of a rollout group: after the prompt, the model's first turn (as vLLM sampled
it, ending with the template's end of an assistant turn), then the tokens the chat template writes for the
environment's observation up to and including the next generation prompt, then the model's next turn, and so on.
The rollout's ``loss_mask`` is 1 on the model's tokens and 0 on the environment's, so the segments of a response
are the maximal runs of equal mask values (:meth:`~asyncrl.common.wire.messages.RolloutGroup.segments`), alternating
model and environment.

:class:`TurnEncoder` finds what the template writes for an observation by rendering a probe conversation twice
(``[user, assistant]``, then ``[user, assistant, *observation]`` with the generation prompt) and keeping what the
second rendering adds after the assistant's end of turn. That is correct exactly when the template extends a
conversation by appending (ChatML, Llama 3, Mistral do). A template that rewrites every earlier turn does not, and is
refused when the encoder is made (:class:`TemplateError`) rather than training on a conversation the model would never
see rendered that way.

A thinking model's template rewrites only the turns that hold reasoning: it drops the ``<think>`` blocks of past
assistant turns once a later user turn follows (Qwen3's does; the encoder finds it by a probe whose assistant turn
holds reasoning). Such an episode is run as the model is served (``environment.past_reasoning = "as_served"``, the
default): each model turn is generated on the context the template renders for the conversation so far
(:meth:`TurnEncoder.served_ids`), and the response is cut into *rows* — a row is one training sequence after the
prompt: a context the model was given (loss mask 0) and the turns it then wrote (mask 1). A turn whose context extends
the current row (the template kept the row's past as it was sampled) is appended to it; one whose context rewrote it
starts a new row (:func:`next_context`). Every model token is in exactly one row, after exactly the tokens it was
sampled on. ``environment.past_reasoning = "keep"`` keeps one row per episode instead, past reasoning as generated.

Both the actor (which builds the episode) and the reward worker (which replays the environment on the model's turns
to score it) use this module, so both read a model turn as the same text: :func:`turn_text`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.common.data.prompts import turn_end_id

Message = dict[str, str]
_PROBE = "asyncrl-episode-probe"
_THINKING = "<think>\nasyncrl-reasoning-probe\n</think>\n\n"
"""A model turn's reasoning as thinking models write it before their answer."""


class TemplateError(ValueError):
    """A tokenizer whose chat template cannot carry a multi-turn episode as appended tokens."""


@dataclass(frozen=True)
class TurnEncoder:
    """Token ids of environment turns for one tokenizer with a chat template."""

    tokenizer: Any
    end_id: int
    """The token that ends an assistant turn (ChatML: ``<|im_end|>``): after it, and only after it, the environment
    steps."""

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> TurnEncoder:
        """The encoder of ``tokenizer``, whose turns end at :func:`asyncrl.common.data.prompts.turn_end_id`.
        :class:`TemplateError` when the tokenizer has no chat template, or its template rewrites earlier turns that
        hold no reasoning."""
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(
                "rollout.workflow = 'multi_turn' needs a chat template: the tokenizer of model.path has none"
            )
        encoder = cls(tokenizer, turn_end_id(tokenizer))
        encoder.ids([{"role": "user", "content": "probe"}])  # refuses a template that rewrites earlier turns
        return encoder

    def check_past_reasoning_kept(self, role: str = "user") -> None:
        """:class:`TemplateError` when the template renders an assistant turn that holds reasoning
        (``<think>…</think>``) one way while it is the last turn and another once a later turn of ``role`` follows —
        as thinking models' templates do (Qwen3's drops the reasoning of every assistant turn before the last user
        turn, and keeps it before a tool's reply). Kept as appended tokens, every later turn of an episode would be
        trained on the reasoning the served model never sees again (the plain probe, without reasoning, passes such a
        template); such a template is run per turn (module docstring)."""
        base = [{"role": "user", "content": "1"}, {"role": "assistant", "content": _THINKING + _PROBE}]
        before = self._render(base, generation_prompt=False)
        try:
            after = self._render([*base, {"role": role, "content": "2"}], generation_prompt=True)
        except Exception as exc:  # a template that takes no turn of this role: nothing to keep it by
            raise TemplateError(f"the chat template cannot render a {role!r} turn: {exc}") from exc
        if not after.startswith(before):
            raise TemplateError(
                "the chat template drops the model's past reasoning (<think>…</think>) once a later turn follows (a "
                "thinking model's template, such as Qwen3's, does): kept as appended tokens, each later turn of an "
                "episode would be trained on reasoning the model is never served with"
            )

    def keeps_past_reasoning(self, roles: Sequence[str] = ("user",)) -> bool:
        """Whether the template renders a past assistant turn's reasoning as it was written once a turn of each of
        ``roles`` follows (:meth:`check_past_reasoning_kept` passes for each)."""
        try:
            for role in roles:
                self.check_past_reasoning_kept(role)
        except TemplateError:
            return False
        return True

    @property
    def turn_end(self) -> str:
        """The text of :attr:`end_id`."""
        return self.tokenizer.convert_ids_to_tokens(self.end_id)

    def _render(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def text(self, observation: Sequence[Message]) -> str:
        """What the template writes after an assistant turn's end token for ``observation``, up to and including the
        next generation prompt."""
        base = [{"role": "user", "content": "1"}, {"role": "assistant", "content": _PROBE}]
        before = self._render(base, generation_prompt=False)
        after = self._render([*base, *observation], generation_prompt=True)
        closed = before.find(_PROBE + self.turn_end)
        if closed < 0:
            raise TemplateError(
                f"the chat template does not end an assistant turn with {self.turn_end!r} right after its content"
            )
        cut = closed + len(_PROBE) + len(self.turn_end)
        if not after.startswith(before):
            raise TemplateError(
                "the chat template rewrites earlier turns when a turn is added (a thinking model's template that "
                "drops past reasoning does): a multi-turn episode cannot be kept as appended tokens with it"
            )
        return after[cut:]

    def ids(self, observation: Sequence[Message]) -> list[int]:
        """:meth:`text` as token ids (the template's special tokens are in the text: none added)."""
        return self._tokens(self.text(observation))

    def served_ids(self, history: Sequence[Message]) -> list[int]:
        """The context a served model is given after the prompt for its next turn, as token ids: what the template
        renders for a conversation whose turns after the first user turn are ``history`` (the model's turns as
        :func:`turn_text` reads them, the environment's messages), up to and including the next generation prompt.
        Found, like :meth:`text`, from a probe prompt: rendered alone with its generation prompt, then with
        ``history``, the context is what the second rendering adds."""
        base = [{"role": "user", "content": "1"}]
        before = self._render(base, generation_prompt=True)
        after = self._render([*base, *history], generation_prompt=True)
        if not after.startswith(before):
            raise TemplateError("the chat template renders the first user turn differently once later turns follow")
        return self._tokens(after[len(before) :])

    def _tokens(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def turn_text(tokenizer: Any, ids: Sequence[int]) -> str:
    """A model turn as the environment reads it: its tokens decoded without special tokens."""
    return tokenizer.decode(list(ids), skip_special_tokens=True)


@dataclass(frozen=True)
class EpisodeTools:
    """A tokenizer, its :class:`TurnEncoder`, and whether episodes are kept in rows per turn."""

    tokenizer: Any
    encoder: TurnEncoder
    per_turn: bool = False
    """Whether each model turn is generated on the context the template serves (the template drops past reasoning
    and ``environment.past_reasoning = "as_served"``): the response is cut into rows (module docstring)."""

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, past_reasoning: str = "as_served") -> EpisodeTools:
        encoder = TurnEncoder.for_tokenizer(tokenizer)
        return cls(tokenizer, encoder, past_reasoning == "as_served" and not encoder.keeps_past_reasoning())

    @property
    def end_id(self) -> int:
        """The token that ends an assistant turn: after it, and only after it, the environment steps."""
        return self.encoder.end_id


def next_context(tools: EpisodeTools, row: Sequence[int], history: Sequence[Message]) -> tuple[list[int], bool]:
    """Per turn (:attr:`EpisodeTools.per_turn`): the tokens to add after the current ``row`` (its tokens after the
    prompt) so that the next model turn is generated on the context the template serves for ``history``, and whether
    they start a new row. The served context is appended to the row when it extends it (the template kept the row as
    sampled), and starts a row of its own when the template rewrote any of it."""
    served = tools.encoder.served_ids(history)
    if served[: len(row)] == list(row):
        return served[len(row) :], False
    return served, True


@functools.lru_cache(maxsize=4)
def episode_tools(model_path: str, past_reasoning: str = "as_served") -> EpisodeTools:
    """The tools of ``model.path``'s tokenizer, loaded once per process and folder (nothing is fetched from a hub),
    for ``environment.past_reasoning``."""
    from transformers import AutoTokenizer

    return EpisodeTools.for_tokenizer(AutoTokenizer.from_pretrained(model_path), past_reasoning)
