"""Prompts for sampling (add_generation_prompt=True) and preference pairs (rejected_messages)."""

from __future__ import annotations

from twinkle.template import Template

QA = {
    "messages": [
        {"role": "system", "content": "Solve it."},
        {"role": "user", "content": "Tom has 3 apples and buys 4 more. How many?"},
        {"role": "assistant", "content": "3 + 4 = 7\n#### 7"},
    ],
    "user_data": {"answer": "7"},
}


def test_generation_prompt_drops_the_reference_answer_and_labels_nothing(template: Template, tokenizer) -> None:
    feature = template.encode(QA, add_generation_prompt=True)
    expected = tokenizer.apply_chat_template(
        QA["messages"][:2], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert feature["input_ids"] == expected
    assert template.decode(feature["input_ids"]).endswith("<|im_start|>assistant\n")
    assert sum(feature["loss_mask"]) == 0
    assert feature["messages"] == QA["messages"]  # the reference answer rides along for rewards
    assert feature["user_data"] == {"answer": "7"}


def test_generation_prompt_is_a_prefix_of_the_training_sequence(template: Template) -> None:
    # What the sampler sees is exactly what training sees before the first trained token.
    prompt = template.encode(QA, add_generation_prompt=True)["input_ids"]
    full = template.encode(QA)
    assert full["input_ids"][: len(prompt)] == prompt
    assert full["loss_mask"].index(1) == len(prompt)


def test_generation_prompt_with_thinking_disabled(model_dir: str) -> None:
    template = Template(model_dir, enable_thinking=False)
    feature = template.encode(QA, add_generation_prompt=True)
    assert template.decode(feature["input_ids"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_rejected_messages_are_encoded_alongside(template: Template, trained) -> None:
    prompt = [{"role": "user", "content": "What is 3 * 12?"}]
    pair = {
        "messages": [*prompt, {"role": "assistant", "content": "3 * 12 = 36."}],
        "rejected_messages": [*prompt, {"role": "assistant", "content": "3 * 12 = 38."}],
    }
    feature = template.encode(pair)
    rejected = feature["rejected"]
    assert rejected["messages"] == pair["rejected_messages"]
    assert rejected["input_ids"] == template.encode({"messages": pair["rejected_messages"]})["input_ids"]
    assert trained(template, feature) == ["<think>\n\n</think>\n\n3 * 12 = 36.<|im_end|>"]
    assert trained(template, rejected) == ["<think>\n\n</think>\n\n3 * 12 = 38.<|im_end|>"]
    # Both sides share the prompt tokens up to the first trained token.
    start = feature["loss_mask"].index(1)
    assert rejected["loss_mask"].index(1) == start
    assert feature["input_ids"][:start] == rejected["input_ids"][:start]


def test_generation_encode_ignores_the_rejected_side(template: Template) -> None:
    pair = {**QA, "rejected_messages": [*QA["messages"][:2], {"role": "assistant", "content": "#### 8"}]}
    assert "rejected" not in template.encode(pair, add_generation_prompt=True)
