"""From a task example to the prompt the model sees, and from that prompt to token ids — made once, by the learner.

The dispatcher owns the prompt: it turns each example into text with a :class:`Prompter` and into ids with the
same prompter, and those ids travel unchanged (``PromptGroup.prompt_ids`` → the actor's ``TokensPrompt`` →
``RolloutGroup.prompt_ids`` → the learner's batch); nothing downstream decodes and re-encodes them.

With a chat model (``task.chat``: ``auto`` = the tokenizer has a chat template) a row's ``messages`` — or its plain
prompt as one user message, after ``task.system_prompt`` when set — go through the tokenizer's own template with
``add_generation_prompt=True``; the templated text already holds the template's special tokens (BOS where the
template writes one), so it is tokenized with ``add_special_tokens=False``, as ``apply_chat_template(tokenize=True)``
does. Without a template a prompt is tokenized with the tokenizer's special tokens (the tiny model's ``<s>``).

Responses end where the template ends an assistant turn: :attr:`Prompter.stop_ids` holds that token (ChatML's
``<|im_end|>``, Llama 3's ``<|eot_id|>``) when it is not the tokenizer's EOS, and the actor passes it to vLLM as a
stop token id (vLLM stops on the EOS ids of ``generation_config.json`` and the tokenizer by itself). The stop token
is part of the sampled response: it is in ``token_ids`` with its behaviour log-prob, and the learner trains on it
like every other response token — the model learns to end its turn.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.common.data.tasks import TaskError
from asyncrl.common.observability.logs import get_logger

if TYPE_CHECKING:
    from asyncrl.common.config import TaskSection
    from asyncrl.common.data.tasks import TaskExample

Messages = Sequence[dict[str, str]]
_PROBE = "asyncrl-turn-end-probe"
log = get_logger("prompts")


class PromptError(TaskError):
    """A run whose prompts cannot be built as configured (chat without a template, a system prompt without chat)."""


@dataclass(frozen=True)
class Prompter:
    """How one run makes prompts: ``encode`` (text → ids, special tokens exactly once) and, for a chat model, the
    ``template`` (messages → text ending in the generation prompt)."""

    encode: Callable[[str], list[int]]
    template: Callable[[Messages], str] | None = None
    system_prompt: str = ""
    unknown_of: Callable[[str], str] | None = None
    """The characters of a text the tokenizer can only map to its unknown token (None: it has none)."""
    stop_ids: tuple[int, ...] = ()
    """Token ids that end a response besides the EOS ids vLLM knows: the template's end of an assistant turn."""

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, section: TaskSection, tools: Sequence[dict] = ()) -> Prompter:
        """The prompter of a run with this Hugging Face tokenizer and ``[task]`` section; :class:`PromptError` when
        ``task.chat = true`` and the tokenizer has no template, or ``task.system_prompt`` is set without chat.

        ``tools`` (OpenAI-style function schemas) go to the template's ``tools`` argument, which templates with tool
        support (Qwen2.5, Llama 3.1, Hermes) render into the system turn; a template without it ignores them, and
        the prompter says so in the log (describe the tools in ``task.system_prompt`` then)."""
        has_template = bool(getattr(tokenizer, "chat_template", None))
        chat = has_template if section.chat == "auto" else bool(section.chat)
        if chat and not has_template:
            raise PromptError("task.chat = true, but the tokenizer of model.path has no chat template")
        if section.system_prompt and not chat:
            raise PromptError(
                "task.system_prompt is set, but the run does not use a chat template "
                f"(task.chat = {section.chat!r}; the tokenizer {'has' if has_template else 'has no'} template)"
            )
        unk = getattr(tokenizer, "unk_token_id", None)
        unknown_of = None if unk is None else (lambda text: _unknown_characters(tokenizer, unk, text))
        if not chat:
            return cls(encode=lambda text: list(tokenizer(text)["input_ids"]), unknown_of=unknown_of)

        offered = [dict(t) for t in tools] or None

        def template(messages: Messages) -> str:
            return tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=True, tools=offered
            )

        if offered and template([{"role": "user", "content": "1"}]) == _without_tools(tokenizer):
            log.warning(
                "the chat template does not render tools: the model will not see them in its prompt",
                tools=",".join(t.get("function", {}).get("name", "?") for t in offered),
                action="describe the tools and their call format in task.system_prompt",
            )

        return cls(
            encode=lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"]),
            template=template,
            system_prompt=section.system_prompt,
            unknown_of=unknown_of,
            stop_ids=turn_end_ids(tokenizer),
        )

    @property
    def chat(self) -> bool:
        return self.template is not None

    def text(self, example: TaskExample) -> str:
        """The prompt text the model sees for ``example``; ``ValueError`` for ``messages`` without a template."""
        if self.template is None:  # not self.chat
            if example.messages is not None:
                raise ValueError(
                    "holds 'messages', but the run uses no chat template (task.chat = false, or the tokenizer of "
                    "model.path has none)"
                )
            return example.prompt
        messages = (
            [dict(m) for m in example.messages] if example.messages else [{"role": "user", "content": example.prompt}]
        )
        if self.system_prompt and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return self.template(messages)

    def apply(self, example: TaskExample) -> TaskExample:
        """``example`` with its prompt as the model sees it (templated for a chat model)."""
        return dataclasses.replace(example, prompt=self.text(example), messages=None)

    def unknown(self, text: str) -> str:
        """The characters of ``text`` the tokenizer cannot encode, sorted ('' when it can encode them all)."""
        return self.unknown_of(text) if self.unknown_of is not None else ""


def _without_tools(tokenizer: Any) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": "1"}], tokenize=False, add_generation_prompt=True)


def _unknown_characters(tokenizer: Any, unk: int, text: str) -> str:
    if unk not in tokenizer(text, add_special_tokens=False)["input_ids"]:
        return ""
    return "".join(sorted(c for c in set(text) if unk in tokenizer(c, add_special_tokens=False)["input_ids"]))


def turn_end_ids(tokenizer: Any) -> tuple[int, ...]:
    """The special token the chat template writes right after an assistant message, when it is not the EOS.

    Found by rendering a user turn and an assistant turn with a probe text and tokenizing what follows the probe
    (ChatML: ``<|im_end|>\\n``); nothing when that is not a special token, or the template will not render it.
    """
    messages = [{"role": "user", "content": "1"}, {"role": "assistant", "content": _PROBE}]
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # a template may refuse this conversation (e.g. it requires a system turn): EOS only
        return ()
    if _PROBE not in rendered:
        return ()
    after = tokenizer(rendered.split(_PROBE, 1)[1], add_special_tokens=False)["input_ids"]
    special = set(getattr(tokenizer, "all_special_ids", ()))
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    if not after or after[0] not in special or after[0] == tokenizer.eos_token_id:
        return ()
    return (int(after[0]),)


def turn_end_id(tokenizer: Any) -> int:
    """The token that ends an assistant turn: the template's own (:func:`turn_end_ids`), else EOS."""
    return int(next(iter(turn_end_ids(tokenizer)), tokenizer.eos_token_id))


def model_vocab_size(model_dir: str | Path) -> int:
    """The model's vocabulary: the rows of its embedding (``config.json``'s ``vocab_size``, or its text model's).

    Token ids are checked against this, not the tokenizer's length: an embedding is often padded beyond the
    tokenizer (Qwen2.5: 151,936 rows for 151,665 tokens), and vLLM can sample a padded id.
    """
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text())
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"{path}: no vocab_size")
    return size
