import subprocess
import sys

import pytest

from twinkle.errors import ResourceNotFoundError
from twinkle.hub import is_builtin, list_builtin
from twinkle.hub.registry import get_builtin

MODELS = [
    "builtin://qwen3-tiny",
    "builtin://qwen3-tiny-head32",
    "builtin://llama-tiny",
    "builtin://qwen2-tiny",
    "builtin://qwen3-moe-tiny",
    "builtin://glm4-tiny",
    "builtin://qwen3-vl-tiny",
]
DATASETS = [
    "builtin://self-cognition",
    "builtin://gsm8k-mini",
    "builtin://preference-mini",
    "builtin://clevr-mini",
]


def test_list_builtin_has_every_id_with_a_one_line_description():
    builtins = list_builtin()
    assert list(builtins) == MODELS + DATASETS
    for description in builtins.values():
        assert description and "\n" not in description


def test_list_builtin_filters_by_kind():
    assert list(list_builtin("model")) == MODELS
    assert list(list_builtin("dataset")) == DATASETS


@pytest.mark.parametrize("ref", MODELS + DATASETS)
def test_is_builtin_accepts_known_ids(ref):
    assert is_builtin(ref)


@pytest.mark.parametrize("ref", ["builtin://nope", "qwen3-tiny", "hf://Qwen/Qwen3-0.6B", ""])
def test_is_builtin_rejects_everything_else(ref):
    assert not is_builtin(ref)


def test_cache_names_carry_the_format_version():
    assert get_builtin("builtin://qwen3-tiny", "model").cache_name == "qwen3-tiny-v2"
    assert get_builtin("builtin://gsm8k-mini", "dataset").cache_name == "gsm8k-mini-v1"


def test_unknown_builtin_lists_the_available_ones():
    with pytest.raises(ResourceNotFoundError) as info:
        get_builtin("builtin://qwen9-huge", "model")
    assert "builtin://qwen9-huge" in str(info.value)
    assert "builtin://qwen3-tiny" in str(info.value)


def test_builtin_of_the_other_kind_says_what_it_is():
    with pytest.raises(ResourceNotFoundError, match="is a builtin dataset, not a model") as info:
        get_builtin("builtin://gsm8k-mini", "model")
    assert "builtin://qwen3-tiny" in str(info.value)


def test_importing_twinkle_hub_stays_light():
    code = (
        "import sys, twinkle.hub\n"
        "heavy = {'transformers', 'torch', 'huggingface_hub', 'modelscope', 'tokenizers'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
