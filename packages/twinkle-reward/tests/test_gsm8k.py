"""GSM8K accuracy and format rewards on realistic model completions."""

from __future__ import annotations

import pytest

from twinkle.errors import InvalidInputError
from twinkle.reward import GSM8KAccuracyReward, GSM8KFormatReward

SOLUTION = "Natalia sold 48/2 = 24 clips in May.\nAltogether she sold 48 + 24 = 72 clips.\n#### 72"

# (completion, reference answer, accuracy, format)
CASES = [
    (SOLUTION, "72", 1.0, 1.0),
    ("In May: 48 / 2 = 24.\nTotal: 48 + 24 = 72.\n#### 72\n\n", "72", 1.0, 1.0),  # trailing blank lines
    ("48 + 24 = 72\n#### 72.", "72", 1.0, 1.0),  # final period
    ("48 + 24 = 72\n#### $72", "72", 1.0, 1.0),
    ("48 + 24 = 72\n#### 72.0", "72", 1.0, 1.0),
    ("He earns 1,200 + 600\n#### 1,800", "1800", 1.0, 1.0),
    ("He earns 1200 + 600\n#### 1800", "1,800", 1.0, 1.0),  # reference with separators
    ("The temperature drops by 3 twice.\n#### -6", "-6", 1.0, 1.0),
    ("The temperature drops by 3 twice.\n#### −6", "-6", 1.0, 0.0),  # Unicode minus: right, not tidy
    ("Each costs 0.25, so 10 cost\n#### 2.5", "2.5", 1.0, 1.0),
    ("48 + 24 = 72\n#### 72 clips", "72", 1.0, 0.0),  # a unit after the number breaks the format only
    ("48 + 24 = 72\n#### **72**", "72", 1.0, 0.0),
    ("48 + 24 = 72\n####72", "72", 1.0, 1.0),
    ("#### 72", "72", 1.0, 0.0),  # no reasoning
    ("   \n#### 72", "72", 1.0, 0.0),  # whitespace is not reasoning
    ("48 + 24 = 72\n#### 70", "72", 0.0, 1.0),  # tidy but wrong
    ("First guess\n#### 70\nOn reflection 48 + 24 = 72\n#### 72", "72", 1.0, 1.0),  # the last marker counts
    ("48 + 24 = 72\n#### 72\nOops, I mean\n#### 73", "72", 0.0, 1.0),
    ("So she sold 72 clips in total.", "72", 0.0, 0.0),  # no marker: accuracy needs one
    ("So the total is \\boxed{72}.", "72", 1.0, 0.0),  # boxed is accepted for accuracy
    ("\\boxed{70} hmm\n#### 72", "72", 1.0, 1.0),  # #### wins over boxed
    ("48 + 24 = 72\n#### 72\n", "72", 1.0, 1.0),
    ("48 + 24 = 72 #### 72", "72", 1.0, 0.0),  # marker not on its own line
    ("", "72", 0.0, 0.0),  # empty completion
    ("Reasoning...\n#### ", "72", 0.0, 0.0),
    ("Reasoning...\n#### 72 or 73", "72", 1.0, 0.0),
]


@pytest.mark.parametrize(("completion", "answer", "accuracy", "fmt"), CASES)
def test_realistic_completions(make_sampled, completion, answer, accuracy, fmt):
    batch = [make_sampled(completion, answer)]
    assert GSM8KAccuracyReward()(batch) == [accuracy]
    assert GSM8KFormatReward()(batch) == [fmt]


def test_batch_scores_align_with_inputs(make_sampled):
    batch = [make_sampled(completion, answer) for completion, answer, _, _ in CASES]
    assert GSM8KAccuracyReward()(batch) == [case[2] for case in CASES]
    assert GSM8KFormatReward()(batch) == [case[3] for case in CASES]
    assert GSM8KAccuracyReward()([]) == []


@pytest.mark.parametrize("reference", [72, 72.0, "72", " 72 ", "$72", "48+24=72\n#### 72"])
def test_reference_forms(make_sampled, reference):
    assert GSM8KAccuracyReward()([make_sampled(SOLUTION, reference)]) == [1.0]


def test_custom_answer_key_and_completion_key():
    rows = [{"completion": SOLUTION, "user_data": {"target": "72"}}]
    assert GSM8KAccuracyReward(answer_key="target")(rows) == [1.0]


def test_prompt_without_reply_scores_zero_even_with_few_shot_examples(make_sampled):
    row = make_sampled(SOLUTION)
    row["messages"].append({"role": "user", "content": "Now the next question."})
    assert GSM8KAccuracyReward()([row]) == [0.0]
    assert GSM8KFormatReward()([row]) == [0.0]


def test_missing_or_unusable_ground_truth_names_the_index(make_sampled):
    rows = [make_sampled(SOLUTION), {"messages": [{"role": "assistant", "content": SOLUTION}]}]
    with pytest.raises(InvalidInputError, match=r"GSM8KAccuracyReward: trajectories\[1\]: user_data has no 'answer'"):
        GSM8KAccuracyReward()(rows)
    with pytest.raises(InvalidInputError, match=r"trajectories\[0\]: user_data\['answer'\] must be a number"):
        GSM8KAccuracyReward()([make_sampled(SOLUTION, "seventy-two")])
    with pytest.raises(InvalidInputError, match="must be a number"):
        GSM8KAccuracyReward()([make_sampled(SOLUTION, float("nan"))])


def test_format_ignores_ground_truth():
    assert GSM8KFormatReward()([{"completion": SOLUTION}]) == [1.0]
