"""Qwen3's chat template without the empty ``<think>`` block it trains on the last turn.

Qwen3's template renders ``<think>\\n\\n</think>\\n\\n`` before the *last*
assistant turn even when it has no reasoning, and before no other turn. SFT on
such conversations teaches the model to open its answers with an empty think
block on the last turn only; and with ``enable_thinking=False`` the generation
prompt ends in that block while earlier turns lack it, so multi-turn tool
conversations are not prefix-stable (``Template.encode`` refuses them).

Patched, a turn shows a think block when it has reasoning, and every turn
shows the empty one when thinking is off, exactly as the generation prompt
does: the empty block is then prompt, never trained.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from twinkle.errors import ConfigurationError
from twinkle.interfaces import Patch
from twinkle.registry import register

THINKING_OFF = "(enable_thinking is defined and enable_thinking is false)"

# (what Qwen3's templates say, what the patched template says): the official Qwen3 template, where the
# condition sits inside "after the last user query"; Twinkle's embedded builtin://qwen3-tiny template.
REWRITES: tuple[tuple[str, str], ...] = (
    ("loop.last or (not loop.last and reasoning_content)", f"reasoning_content or {THINKING_OFF}"),
    (
        "loop.index0 > state.last_query and (loop.last or reasoning)",
        f"(loop.index0 > state.last_query and reasoning) or {THINKING_OFF}",
    ),
)


@register("patch")
class Qwen3ThinkingTemplatePatch(Patch):
    """Renders think blocks only where there is reasoning (or thinking is off); see the module docstring.

    The target is a ``twinkle.template.Template`` or a transformers tokenizer
    whose chat template is Qwen3's; any other template is refused.
    """

    name: ClassVar[str] = "Qwen3ThinkingTemplatePatch"

    def check(self, target: Any) -> None:
        template = getattr(target, "chat_template", None)
        if not isinstance(template, str):
            raise ConfigurationError(
                f"{self.name} patches a Template or a tokenizer with a chat template, not {type(target).__name__}"
            )
        if not any(original in template for original, _ in REWRITES):
            raise ConfigurationError(
                f"{self.name} fixes Qwen3's chat template; the chat template of {type(target).__name__} "
                f"({getattr(target, 'name_or_path', getattr(target, 'model_id', 'unknown model'))}) is another one"
            )

    def apply(self, target: Any) -> Callable[[], None]:
        previous = target.chat_template
        patched = previous
        for original, fixed in REWRITES:
            patched = patched.replace(original, fixed)
        target.chat_template = patched
        # A Template that rendered its tokenizer's own template gets no override back, only None.
        tokenizer = getattr(target, "tokenizer", None)
        restored = None if tokenizer is not None and previous == tokenizer.chat_template else previous

        def undo() -> None:
            target.chat_template = restored

        return undo
