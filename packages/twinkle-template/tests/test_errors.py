"""Inputs and templates the Template cannot use fail with errors that say what to do."""

from __future__ import annotations

import logging

import pytest

from twinkle.errors import InvalidInputError
from twinkle.registry import build
from twinkle.template import Template, TemplateError

CHAT = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}

# A minimal prefix-stable template that ends assistant turns with the eos token.
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m.role + ': ' + m.content }}{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def test_tokenizer_without_chat_template_needs_one(fresh_tokenizer) -> None:
    fresh_tokenizer.chat_template = None
    with pytest.raises(TemplateError, match=r"'my-base-model' has no chat template; pass one as .*chat_template="):
        Template("my-base-model", tokenizer=fresh_tokenizer)


def test_a_given_chat_template_is_used(fresh_tokenizer, trained) -> None:
    fresh_tokenizer.chat_template = None
    template = Template(tokenizer=fresh_tokenizer, chat_template=PLAIN_TEMPLATE)
    feature = template.encode(CHAT)
    assert template.decode(feature["input_ids"]) == "user: Hi\nassistant: Hello!<|im_end|>\n"
    # "assistant: " + "Hello" tokenizes as "assistant:" + " Hello": the straddling token is model output.
    assert trained(template, feature) == [" Hello!<|im_end|>"]


def test_bad_role_is_named(template: Template) -> None:
    bad = {"messages": [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hello"}]}
    with pytest.raises(InvalidInputError, match=r"messages\[1\]\.role must be one of .* got 'bot'"):
        template.encode(bad)


def test_bad_rejected_messages_are_named(template: Template) -> None:
    with pytest.raises(InvalidInputError, match=r"trajectory\.rejected_messages\[0\]\.content must be a string"):
        template.encode({**CHAT, "rejected_messages": [{"role": "user", "content": 3}]})


def test_template_that_is_not_prefix_stable(fresh_tokenizer) -> None:
    # Rendering the message count up front changes the start of the text whenever a turn is added.
    unstable = "{{ messages | length }}\n" + PLAIN_TEMPLATE
    template = Template(tokenizer=fresh_tokenizer, chat_template=unstable)
    with pytest.raises(TemplateError, match=r"not prefix-stable at trajectory\.messages\[1\]"):
        template.encode(CHAT)


def test_conversation_opening_with_the_assistant(template: Template) -> None:
    with pytest.raises(TemplateError, match=r"trajectory\.messages\[0\] is an assistant message"):
        template.encode({"messages": [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Hi"}]})


def test_only_assistant_messages_leave_no_prompt(template: Template) -> None:
    with pytest.raises(InvalidInputError, match="no prompt to encode"):
        template.encode({"messages": [{"role": "assistant", "content": "Hello"}]}, add_generation_prompt=True)


def test_template_errors_are_wrapped(fresh_tokenizer) -> None:
    failing = "{{ raise_exception('only user turns allowed') }}"
    template = Template("strict-model", tokenizer=fresh_tokenizer, chat_template=failing)
    with pytest.raises(TemplateError, match="'strict-model' cannot render this conversation: only user turns allowed"):
        template.encode(CHAT)


def test_warns_once_when_turns_never_end(fresh_tokenizer, caplog: pytest.LogCaptureFixture) -> None:
    no_eos = PLAIN_TEMPLATE.replace("{{ eos_token }}", "")
    template = Template(tokenizer=fresh_tokenizer, chat_template=no_eos)
    with caplog.at_level(logging.WARNING, logger="twinkle"):
        template.encode(CHAT)
        template.encode(CHAT)
    warnings = [record for record in caplog.records if "no end-of-turn token" in record.getMessage()]
    assert len(warnings) == 1


def test_resolves_by_registered_name(model_dir: str) -> None:
    template = build("template", "Template", model_id=model_dir, max_length=256)
    assert isinstance(template, Template)
    assert template.max_length == 256


def test_pickles_compactly_and_round_trips():
    """datasets fingerprints (and ships to workers) a pickled template: it must be small and faithful."""
    import pickle

    template = Template("builtin://qwen3-tiny", max_length=64)
    data = pickle.dumps(template)
    assert len(data) < 10_000  # the tokenizer is referenced by directory and digest, not embedded
    restored = pickle.loads(data)
    trajectory = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    assert restored.encode(trajectory) == template.encode(trajectory)
