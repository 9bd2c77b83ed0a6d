import re
from pathlib import Path

import pytest

from twinkle.hub import resolve_dataset
from twinkle.hub.data import gsm8k_mini, preference_mini, self_cognition
from twinkle.hub.data.preference_mini import OPERATIONS, POLITE_OPENERS, RUDE_OPENERS

EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")
CALCULATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}


@pytest.fixture(scope="module")
def gsm8k_dir() -> Path:
    return Path(resolve_dataset("builtin://gsm8k-mini"))


@pytest.fixture(scope="module")
def preference_dir() -> Path:
    return Path(resolve_dataset("builtin://preference-mini"))


@pytest.mark.parametrize("builder", [self_cognition.build, gsm8k_mini.build, preference_mini.build])
def test_builds_are_deterministic(builder, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    builder(first)
    builder(second)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes()


def test_self_cognition_rows(read_jsonl):
    rows = read_jsonl(Path(resolve_dataset("builtin://self-cognition")) / "train.jsonl")
    assert len(rows) >= 100
    assert all(set(row) == {"query", "response", "tag"} for row in rows)
    assert all("{{NAME}}" in row["response"] and "{{AUTHOR}}" in row["response"] for row in rows)
    assert {row["tag"] for row in rows} == {"en", "zh"}
    assert len({row["query"] for row in rows}) == len(rows), "queries are not repeated"
    chinese = [row for row in rows if row["tag"] == "zh"]
    assert all(re.search(r"[\u4e00-\u9fff]", row["query"] + row["response"]) for row in chinese)
    queries = " ".join(row["query"].lower() for row in rows)
    for intent in ("who are you", "your name", "who made you", "你是谁", "名字", "开发"):
        assert intent in queries


def test_self_cognition_has_only_a_train_split():
    assert [p.name for p in Path(resolve_dataset("builtin://self-cognition")).iterdir()] == ["train.jsonl"]


def test_gsm8k_sizes_format_and_disjoint_splits(gsm8k_dir, read_jsonl):
    train, test = read_jsonl(gsm8k_dir / "train.jsonl"), read_jsonl(gsm8k_dir / "test.jsonl")
    assert (len(train), len(test)) == (2000, 200)
    assert all(set(row) == {"question", "answer"} for row in train + test)
    assert all(re.fullmatch(r"(?s).+\n#### \d+", row["answer"]) for row in train + test)
    assert not {row["question"] for row in train} & {row["question"] for row in test}
    assert len({row["question"] for row in train}) == len(train)


def test_gsm8k_answers_are_correct(gsm8k_dir, read_jsonl):
    """Recompute every reasoning step and check the chain: operands come from the question or earlier steps."""
    rows = read_jsonl(gsm8k_dir / "train.jsonl") + read_jsonl(gsm8k_dir / "test.jsonl")
    step_counts = set()
    for row in rows:
        reasoning, final = row["answer"].rsplit("\n#### ", 1)
        known = {int(n) for n in re.findall(r"\d+", row["question"])}
        if "twice" in row["question"]:
            known.add(2)
        steps = reasoning.split("\n")
        step_counts.add(len(steps))
        for step in steps:
            (a, op, b, result), *others = EQUATION.findall(step)
            assert not others, step
            assert CALCULATIONS[op](int(a), int(b)) == int(result), step
            assert {int(a), int(b)} <= known, (row["question"], step)
            known.add(int(result))
        assert int(final) == int(result), row
        assert int(final) >= 0
    assert step_counts == {1, 2}


def test_preference_sizes_format_and_disjoint_prompts(preference_dir, read_jsonl):
    train, test = read_jsonl(preference_dir / "train.jsonl"), read_jsonl(preference_dir / "test.jsonl")
    assert (len(train), len(test)) == (400, 100)
    assert all(set(row) == {"prompt", "chosen", "rejected"} for row in train + test)

    def calculation(row):
        return re.search(r"(\d+) ([-+*]) (\d+)", row["prompt"]).groups()

    assert not {calculation(row) for row in train} & {calculation(row) for row in test}


def test_preference_is_consistent(preference_dir, read_jsonl):
    """Chosen is always polite and correct; rejected is always wrong, rude, or both."""
    rows = read_jsonl(preference_dir / "train.jsonl") + read_jsonl(preference_dir / "test.jsonl")
    kinds = set()
    for row in rows:
        a, op, b = re.search(r"(\d+) ([-+*]) (\d+)", row["prompt"]).groups()
        correct = OPERATIONS[op](int(a), int(b))
        assert row["chosen"].startswith(POLITE_OPENERS)
        assert row["chosen"].endswith(f"{a} {op} {b} = {correct}.")
        rejected_result = int(re.search(r"= (\d+)\.$", row["rejected"]).group(1))
        rude, wrong = row["rejected"].startswith(RUDE_OPENERS), rejected_result != correct
        assert rude or wrong, row
        kinds.add((rude, wrong))
    assert kinds == {(True, False), (False, True), (True, True)}


def test_clevr_mini_answers_follow_from_the_drawn_scenes(read_jsonl, tmp_path):
    import base64
    import io

    from PIL import Image

    from twinkle.hub.data import clevr_mini

    first = Path(resolve_dataset("builtin://clevr-mini"))
    rows = {split: read_jsonl(first / f"{split}.jsonl") for split in ("train", "test")}
    assert (len(rows["train"]), len(rows["test"])) == (clevr_mini.TRAIN_SIZE, clevr_mini.TEST_SIZE)
    train_keys = {row["image"] + row["question"] for row in rows["train"]}
    assert not any(row["image"] + row["question"] in train_keys for row in rows["test"])
    assert {row["type"] for row in rows["test"]} == {"count", "count_color", "color", "shape"}
    for row in rows["test"]:
        objects, question = row["objects"], row["question"]
        colors, shapes = [o["color"] for o in objects], [o["shape"] for o in objects]
        if row["type"] == "count":
            expected = str(len(objects))
        elif row["type"] == "count_color":
            expected = str(colors.count(question.split()[2]))
        elif row["type"] == "color":
            shape = question.removesuffix("?").split()[-1]
            assert shapes.count(shape) == 1
            expected = colors[shapes.index(shape)]
        else:
            color = question.split()[4]
            assert colors.count(color) == 1
            expected = shapes[colors.index(color)]
        assert row["answer"] == expected, row
        image = Image.open(io.BytesIO(base64.b64decode(row["image"].removeprefix("data:image/png;base64,"))))
        assert image.size == (64, 64)
        for obj in objects:  # each object is drawn in its colour at its centre
            assert image.getpixel((obj["x"], obj["y"])) == clevr_mini.COLORS[obj["color"]]
    clevr_mini.build(tmp_path)
    assert (tmp_path / "test.jsonl").read_bytes() == (first / "test.jsonl").read_bytes()
