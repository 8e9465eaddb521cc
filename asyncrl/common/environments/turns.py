"""An episode as token ids: model turns as sampled, environment turns tokenized once with the chat template.

A multi-turn episode is one response of a rollout group: after the prompt, the model's first turn (as vLLM sampled
it, ending with the template's end of an assistant turn), then the tokens the chat template writes for the
environment's observation up to and including the next generation prompt, then the model's next turn, and so on.
The rollout's ``loss_mask`` is 1 on the model's tokens and 0 on the environment's, so the segments of a response
are the maximal runs of equal mask values (:func:`segments`), alternating model and environment.

:class:`TurnEncoder` finds what the template writes for an observation by rendering a probe conversation twice
(``[user, assistant]``, then ``[user, assistant, *observation]`` with the generation prompt) and keeping what the
second rendering adds after the assistant's end of turn. That is correct exactly when the template extends a
conversation by appending (ChatML, Llama 3, Mistral do). A template that rewrites earlier turns — a thinking model's
template that drops the ``<think>`` blocks of past assistant turns — does not, and is refused when the encoder is
made (:class:`TemplateError`) rather than training on a conversation the model would never see rendered that way. The
encoder probes twice: a plain assistant turn, and one that holds reasoning (a thinking model's template leaves the
first alone and rewrites only the second).

Both the actor (which builds the episode) and the reward worker (which replays the environment on the model's turns
to score it) use this module, so both read a model turn as the same text: :func:`turn_text`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncrl.common.data.prompts import turn_end_id

EPISODE_FINISH_REASONS = ("stop", "length", "max_turns", "deadline")
"""How a trained episode ended, as its finish reason says: ``stop`` (the environment said done, or the model ended its
turn without a call: the model's choice), ``length`` (the token limit), ``max_turns`` (``environment.max_turns``),
``deadline`` (``environment.episode_timeout_s``). An episode its environment's fault ended (``environment_error``) is
never trained (``actors/faults.py``)."""

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
    def for_tokenizer(cls, tokenizer: Any, past_reasoning: str = "refuse") -> TurnEncoder:
        """The encoder of ``tokenizer``, whose turns end at :func:`asyncrl.common.data.prompts.turn_end_id`.
        :class:`TemplateError` when the tokenizer has no chat template, or its template does not extend a conversation
        by appending, or (``past_reasoning = "refuse"``, ``environment.past_reasoning``) it drops past reasoning."""
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(
                "rollout.workflow = 'multi_turn' needs a chat template: the tokenizer of model.path has none"
            )
        encoder = cls(tokenizer, turn_end_id(tokenizer))
        encoder.ids([{"role": "user", "content": "probe"}])  # refuses a template that rewrites earlier turns
        if past_reasoning == "refuse":
            encoder.check_past_reasoning_kept()
        return encoder

    def check_past_reasoning_kept(self) -> None:
        """:class:`TemplateError` when the template renders an assistant turn that holds reasoning
        (``<think>…</think>``) one way while it is the last turn and another once a later turn follows — as thinking
        models' templates do (Qwen3's drops the reasoning of every assistant turn before the last user turn). Kept as
        appended tokens, every later turn of an episode would be trained on the reasoning the served model never sees
        again (the plain probe, without reasoning, passes such a template)."""
        base = [{"role": "user", "content": "1"}, {"role": "assistant", "content": _THINKING + _PROBE}]
        before = self._render(base, generation_prompt=False)
        after = self._render([*base, {"role": "user", "content": "2"}], generation_prompt=True)
        if not after.startswith(before):
            raise TemplateError(
                "the chat template drops the model's past reasoning (<think>…</think>) once a later turn follows (a "
                "thinking model's template, such as Qwen3's, does): kept as appended tokens, each later turn of an "
                "episode would be trained on reasoning the model is never served with; give model.path a chat "
                "template that renders past assistant turns as they were written (Qwen3's without its branch that "
                "strips reasoning before the last user turn), or set environment.past_reasoning = 'keep' to train "
                "each episode as one sequence with its past reasoning kept"
            )

    def keeps_past_reasoning(self) -> bool:
        """Whether the template renders a past assistant turn's reasoning as it was written
        (:meth:`check_past_reasoning_kept` passes)."""
        try:
            self.check_past_reasoning_kept()
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
        return list(self.tokenizer(self.text(observation), add_special_tokens=False)["input_ids"])


def turn_text(tokenizer: Any, ids: Sequence[int]) -> str:
    """A model turn as the environment reads it: its tokens decoded without special tokens."""
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def segments(trained: np.ndarray) -> list[tuple[int, int, bool]]:
    """``(start, end, trained)`` of each maximal run of equal values in a response's loss mask, in order."""
    mask = np.asarray(trained, dtype=bool)
    if not len(mask):
        return []
    edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    starts = [0, *edges.tolist()]
    ends = [*edges.tolist(), len(mask)]
    return [(s, e, bool(mask[s])) for s, e in zip(starts, ends, strict=True)]


@dataclass(frozen=True)
class EpisodeTools:
    """A tokenizer and its :class:`TurnEncoder`."""

    tokenizer: Any
    encoder: TurnEncoder

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, past_reasoning: str = "refuse") -> EpisodeTools:
        return cls(tokenizer, TurnEncoder.for_tokenizer(tokenizer, past_reasoning))

    @property
    def end_id(self) -> int:
        """The token that ends an assistant turn: after it, and only after it, the environment steps."""
        return self.encoder.end_id


@functools.lru_cache(maxsize=4)
def episode_tools(model_path: str, past_reasoning: str = "refuse") -> EpisodeTools:
    """The tools of ``model.path``'s tokenizer, loaded once per process and folder (nothing is fetched from a hub),
    for ``environment.past_reasoning``."""
    from transformers import AutoTokenizer

    return EpisodeTools.for_tokenizer(AutoTokenizer.from_pretrained(model_path), past_reasoning)
