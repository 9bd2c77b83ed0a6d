"""``Template``: trajectories to token ids and assistant-only labels through the model's own chat template.

The text is always rendered by ``tokenizer.apply_chat_template`` (with the
trajectory's tools and ``enable_thinking``), so an encoded sequence is token
for token what the model sees at inference. Labels are found by rendering
prefixes, not by model-specific string rules (see :mod:`twinkle.template.loss_mask`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from twinkle.data_format import (
    IGNORE_INDEX,
    InputFeature,
    Message,
    Trajectory,
    make_input_feature,
    validate_message,
    validate_trajectory,
)
from twinkle.errors import InvalidInputError
from twinkle.hub import resolve_model
from twinkle.interfaces import ToolCallParser
from twinkle.registry import build, register
from twinkle.template.errors import TemplateError
from twinkle.template.loss_mask import assistant_token_mask
from twinkle.template.tool_parsers import assistant_message, detect_tool_parser
from twinkle.template.truncation import TruncationStrategy, check_truncation_args, truncate
from twinkle.template.vision import (
    IMAGE_PLACEHOLDER,
    ImageEncoder,
    ImageInputs,
    image_parts,
    trajectory_images,
    truncate_image_types,
    with_images,
)
from twinkle.utils import get_logger

logger = get_logger(__name__)


_TOKENIZER_FILES = ("tokenizer", "special_tokens", "vocab", "merges", "chat_template", "preprocessor")


def _tokenizer_digest(model_dir: Path) -> str:
    """sha256 over the tokenizer files of ``model_dir`` (what a pickled template stands for)."""
    digest = hashlib.sha256()
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and path.name.startswith(_TOKENIZER_FILES):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@register("template")
class Template:
    """Encodes trajectories for one model.

    ``model_id`` is anything :func:`twinkle.hub.resolve_model` accepts (``None``
    is the built-in tiny Qwen3); pass ``tokenizer=`` to use an already loaded
    fast tokenizer instead. ``chat_template`` overrides the tokenizer's own.
    ``default_system`` is prepended to conversations without a system message.
    ``tool_parser`` (a registered name such as ``'hermes'``, a class or an
    instance) reads tool calls out of completions in :meth:`parse_response`;
    by default it is detected from the chat template.
    """

    def __init__(
        self,
        model_id: str | None = None,
        max_length: int | None = 8192,
        truncation_strategy: TruncationStrategy = "raise",
        default_system: str | None = None,
        enable_thinking: bool = True,
        chat_template: str | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        tool_parser: str | ToolCallParser | type | None = None,
    ) -> None:
        check_truncation_args(max_length, truncation_strategy)
        self.max_length = max_length
        self.truncation_strategy = truncation_strategy
        self.default_system = default_system
        self.enable_thinking = enable_thinking
        model_dir = None
        if tokenizer is None:
            model_dir = Path(resolve_model(model_id))
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model_id = model_id or tokenizer.name_or_path
        if not getattr(tokenizer, "is_fast", False):
            raise TemplateError(
                f"Template needs a fast tokenizer (its offset mapping locates assistant tokens); "
                f"{self.model_id!r} gave {type(tokenizer).__name__}"
            )
        if chat_template is None and not tokenizer.chat_template:
            raise TemplateError(
                f"the tokenizer of {self.model_id!r} has no chat template; pass one as Template(chat_template=...)"
            )
        self._tokenizer = tokenizer
        self._model_dir = model_dir
        self._tokenizer_digest = _tokenizer_digest(model_dir) if model_dir else None
        self._vision = ImageEncoder.from_model_dir(model_dir)  # None: a text-only model
        self._chat_template = chat_template
        self._eos_token_ids = _eos_token_ids(tokenizer, model_dir)
        self._end_of_turn_ids = frozenset(self._eos_token_ids)
        self._special_ids = _special_ids(tokenizer)
        self._warned_no_end_of_turn = False
        self._eos_texts = [str(token) for token in tokenizer.convert_ids_to_tokens(list(self._eos_token_ids))]
        if tool_parser is None:
            tool_parser = detect_tool_parser(chat_template or tokenizer.chat_template)
        self.tool_parser: ToolCallParser | None = None if tool_parser is None else build("tool_parser", tool_parser)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def chat_template(self) -> str:
        """The Jinja chat template that renders conversations: the override given, else the tokenizer's."""
        return self._chat_template or str(self._tokenizer.chat_template)

    @chat_template.setter
    def chat_template(self, chat_template: str | None) -> None:
        """Override the chat template (``None``: the tokenizer's again); pickled with the template."""
        self._chat_template = chat_template

    def __getstate__(self) -> dict[str, Any]:
        """Pickle a tokenizer loaded from a directory as that directory plus a digest of its files.

        ``datasets`` pickles the template to fingerprint every ``encode`` (and to
        ship it to ``num_proc`` workers); a whole Qwen tokenizer takes ~2 s to
        pickle, its files' digest a few milliseconds, and the digest still
        changes whenever the tokenizer does.
        """
        state = dict(self.__dict__)
        if self._model_dir is not None:
            state["_tokenizer"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._tokenizer is None:
            self._tokenizer = AutoTokenizer.from_pretrained(self._model_dir)

    @property
    def eos_token_id(self) -> int | None:
        eos: int | None = self._tokenizer.eos_token_id
        return eos

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: the tokenizer's eos plus the model's ``generation_config.json`` ones."""
        return list(self._eos_token_ids)

    @property
    def pad_token_id(self) -> int | None:
        """The tokenizer's pad id, falling back to eos (padded positions are masked out anyway)."""
        pad = self._tokenizer.pad_token_id
        return self.eos_token_id if pad is None else pad

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce, added tokens included."""
        return len(self._tokenizer)

    def check(self, trajectory: Trajectory) -> Trajectory:
        """Validate a trajectory (its ``rejected_messages`` and ``tools`` too) before encoding; return it unchanged."""
        return validate_trajectory(trajectory)

    def encode(self, trajectory: Trajectory, add_generation_prompt: bool = False) -> InputFeature | None:
        """Encode one trajectory; ``None`` when it is too long under ``truncation_strategy='delete'``.

        Training encodes label every assistant turn. With ``add_generation_prompt``
        the trailing assistant messages (a reference answer) are not rendered, the
        prompt ends with the generation prompt and nothing is labelled; the
        feature's ``messages`` still holds them. A trajectory with
        ``rejected_messages`` (a preference pair) gets the encoded alternative
        under ``rejected``; it is not encoded for generation, whose prompt is shared.
        """
        self.check(trajectory)
        tools = trajectory.get("tools") or None
        extra: dict[str, Any] = {"messages": trajectory["messages"]}
        if trajectory.get("user_data") is not None:
            extra["user_data"] = trajectory["user_data"]
        images = trajectory_images(trajectory, self._vision, self.model_id)
        if add_generation_prompt:
            return self._encode_prompt(trajectory["messages"], tools, extra, images)
        feature = self._encode_conversation(trajectory["messages"], tools, "trajectory.messages", extra, images)
        rejected = trajectory.get("rejected_messages")
        if feature is None or rejected is None:
            return feature
        where = "trajectory.rejected_messages"
        rejected_feature = self._encode_conversation(rejected, tools, where, {"messages": rejected}, images)
        if rejected_feature is None:
            return None
        feature["rejected"] = rejected_feature  # type: ignore[typeddict-unknown-key]
        return feature

    def batch_encode(
        self, trajectories: Sequence[Trajectory], add_generation_prompt: bool = False
    ) -> list[InputFeature | None]:
        """:meth:`encode` each trajectory, keeping positions (deleted rows are ``None``)."""
        return [self.encode(trajectory, add_generation_prompt) for trajectory in trajectories]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        # one sequence of ids decodes to one str (the stub's list[str] is for a batch)
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)  # type: ignore[return-value]

    def encode_turns(
        self, history: Sequence[Mapping[str, Any]], turns: Sequence[Mapping[str, Any]], tools: list[Any] | None = None
    ) -> list[int]:
        """Token ids to append after a sampled assistant turn: ``turns`` (tool results, user feedback) and the
        next generation prompt, as the chat template renders them after ``history``.

        ``history`` ends with the assistant message whose tokens were sampled and
        which closed with an end-of-turn token. The ids begin right after that
        token, so appending them to the sampled ids gives exactly the prompt the
        model would see for the whole conversation (a multi-turn rollout never
        re-tokenizes what the model wrote).
        """
        if not history or history[-1]["role"] != "assistant":
            raise InvalidInputError("encode_turns: history must end with the assistant turn the new turns answer")
        if not turns:
            raise InvalidInputError("encode_turns: turns is empty; pass the messages that follow the assistant turn")
        for index, message in enumerate(turns):
            validate_message(message, f"turns[{index}]")
        chat, _ = self._chat([*history, *turns], "history")
        before, _ = self._chat(history, "history")
        text = self._render(chat, tools, add_generation_prompt=True)
        closed_turns = self._render(before, tools, add_generation_prompt=False).count(self._eos_texts[0])
        if closed_turns == 0:
            raise TemplateError(
                f"the chat template of {self.model_id!r} closes turns with no {self._eos_texts[0]!r}; "
                "encode_turns needs an end-of-turn token to know where the sampled turn ends"
            )
        end = -1
        for _ in range(closed_turns):
            end = text.index(self._eos_texts[0], end + 1)
        continuation = text[end + len(self._eos_texts[0]) :]
        ids: list[int] = self._tokenizer(continuation, add_special_tokens=False)["input_ids"]
        return ids

    def parse_response(self, text: str) -> Message:
        """The assistant message a completion's text stands for: reasoning, content and tool calls.

        The completion should be decoded with its special tokens (``decode(ids)``), as
        some formats mark tool calls with them; trailing end-of-turn tokens are dropped.
        """
        for eos in self._eos_texts:
            text = text.removesuffix(eos)
        return assistant_message(text, self.tool_parser)

    def batch_decode(self, batch_token_ids: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(token_ids, skip_special_tokens) for token_ids in batch_token_ids]

    def _truncate(
        self, input_ids: list[int], labels: list[int], extra: dict[str, Any], where: str
    ) -> InputFeature | None:
        kept = truncate(input_ids, labels, self.max_length, self.truncation_strategy, where)
        if kept is None:
            return None
        extra = truncate_image_types(extra, len(input_ids), len(kept[0]), self.truncation_strategy, where)
        return make_input_feature(kept[0], kept[1], **extra)

    def _encode_conversation(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[Any] | None,
        where: str,
        extra: dict[str, Any],
        images: ImageInputs | None = None,
    ) -> InputFeature | None:
        chat, names = self._chat(messages, where, images is not None)
        text = self._render(chat, tools, add_generation_prompt=False)
        encoding = self._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        input_ids = encoding["input_ids"]
        mask = assistant_token_mask(
            chat,
            text,
            input_ids,
            encoding["offset_mapping"],
            lambda prompt: self._render(prompt, tools, add_generation_prompt=True),
            self._end_of_turn_ids,
            self._special_ids,
            names,
        )
        self._warn_if_turns_never_end(input_ids, mask)
        labels = [token if trained else IGNORE_INDEX for token, trained in zip(input_ids, mask, strict=True)]
        input_ids, labels, extra = with_images(self._vision, input_ids, labels, images, extra, where)
        return self._truncate(input_ids, labels, extra, where)

    def _encode_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[Any] | None,
        extra: dict[str, Any],
        images: ImageInputs | None = None,
    ) -> InputFeature | None:
        end = len(messages)
        while end and messages[end - 1]["role"] == "assistant":
            end -= 1
        if end == 0:
            raise InvalidInputError("trajectory.messages holds only assistant messages: there is no prompt to encode")
        chat, _ = self._chat(messages[:end], "trajectory.messages", images is not None)
        text = self._render(chat, tools, add_generation_prompt=True)
        input_ids = self._tokenizer(text, add_special_tokens=False)["input_ids"]
        labels = [IGNORE_INDEX] * len(input_ids)
        input_ids, labels, extra = with_images(self._vision, input_ids, labels, images, extra, "trajectory.messages")
        return self._truncate(input_ids, labels, extra, "trajectory.messages")

    def _chat(
        self, messages: Sequence[Mapping[str, Any]], where: str, images: bool = False
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """Messages as chat templates expect them (``<image>`` as image parts when ``images``), and names."""
        chat = [_chat_message(message, images) for message in messages]
        names = [f"{where}[{index}]" for index in range(len(chat))]
        if self.default_system is not None and chat[0]["role"] != "system":
            chat.insert(0, {"role": "system", "content": self.default_system})
            names.insert(0, "default_system")
        return chat, names

    def _render(self, chat: list[dict[str, Any]], tools: list[Any] | None, add_generation_prompt: bool) -> str:
        try:
            # tokenize=False renders the text: a str (the stub's return type covers every mode)
            return self._tokenizer.apply_chat_template(  # type: ignore[return-value]
                chat,
                tools=tools,
                chat_template=self._chat_template,
                add_generation_prompt=add_generation_prompt,
                enable_thinking=self.enable_thinking,
                tokenize=False,
            )
        except jinja2.TemplateError as exc:
            raise TemplateError(
                f"the chat template of {self.model_id!r} cannot render this conversation: {exc}"
            ) from exc

    def _warn_if_turns_never_end(self, input_ids: list[int], mask: list[int]) -> None:
        """Warn once if trained turns hold no end-of-turn token: the model would never learn to stop."""
        if self._warned_no_end_of_turn or not any(mask):
            return
        if any(trained and token in self._end_of_turn_ids for token, trained in zip(input_ids, mask, strict=True)):
            return
        self._warned_no_end_of_turn = True
        logger.warning(
            "the chat template of %r closes assistant turns with none of the eos tokens %s, so no end-of-turn token "
            "is trained; use a tokenizer whose eos_token ends a turn",
            self.model_id,
            self._tokenizer.convert_ids_to_tokens(list(self._eos_token_ids)),
        )


def _chat_message(message: Mapping[str, Any], images: bool = False) -> dict[str, Any]:
    """Drop empty fields (``datasets`` fills absent keys with None) and give tool calls the OpenAI layout."""
    chat = {key: value for key, value in message.items() if value is not None}
    if images and IMAGE_PLACEHOLDER in chat.get("content", ""):
        chat["content"] = image_parts(chat["content"])
    if chat.get("tool_calls"):
        chat["tool_calls"] = [
            call if "function" in call else {"type": "function", "function": dict(call)} for call in chat["tool_calls"]
        ]
    return chat


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Named special tokens plus added tokens flagged special (chat markers such as ``<|im_start|>``)."""
    flagged = (index for index, token in tokenizer.added_tokens_decoder.items() if token.special)
    return frozenset(tokenizer.all_special_ids).union(flagged)


def _eos_token_ids(tokenizer: PreTrainedTokenizerBase, model_dir: Path | None) -> tuple[int, ...]:
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    config = None if model_dir is None else model_dir / "generation_config.json"
    if config is not None and config.is_file():
        configured = json.loads(config.read_text()).get("eos_token_id")
        ids += configured if isinstance(configured, list) else [] if configured is None else [configured]
    return tuple(dict.fromkeys(ids))
