import pytest

from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle_client.dataloader import DataLoader
from twinkle_client.dataset import Dataset, DatasetMeta
from twinkle_client.preprocessor import GSM8KProcessor, SelfCognitionProcessor
from twinkle_client.template import Template


def has_answer(row) -> bool:
    """A module-level predicate: sent by name, for the server's registry to resolve."""
    return bool(row.get("answer"))


class Unrebuildable:
    def __init__(self, prefix: str) -> None:
        self._prefix = prefix


def test_steps_are_recorded_and_the_server_builds_the_dataset_on_first_use(client, server):
    dataset = Dataset(DatasetMeta("builtin://self-cognition", data_slice=range(100)))
    dataset.set_template("Template", model_id="builtin://qwen3-tiny", max_length=256)
    dataset.map(SelfCognitionProcessor("Twinkle", "ModelScope"))
    dataset.map("GSM8KProcessor", strict=False)
    dataset.filter(has_answer)
    dataset.encode(add_generation_prompt=True)
    dataset.shuffle(seed=3)
    dataset.select(range(5))
    assert server.requests("POST", "/datasets") == []
    assert len(dataset) == 10
    assert dataset.handle == "ds-1"
    [created] = server.requests("POST", "/datasets")
    assert created.body == {
        "dataset_id": "builtin://self-cognition",
        "split": "train",
        "data_slice": {"start": 0, "stop": 100, "step": 1},
        "steps": [
            {
                "op": "set_template",
                "kwargs": {
                    "template": {"name": "Template", "kwargs": {"model_id": "builtin://qwen3-tiny", "max_length": 256}}
                },
            },
            {
                "op": "map",
                "kwargs": {
                    "preprocessor": {
                        "name": "SelfCognitionProcessor",
                        "kwargs": {"model_name": "Twinkle", "model_author": "ModelScope"},
                    }
                },
            },
            {"op": "map", "kwargs": {"preprocessor": {"name": "GSM8KProcessor", "kwargs": {}}, "strict": False}},
            {"op": "filter", "kwargs": {"predicate": {"name": "has_answer", "kwargs": {}}}},
            {"op": "encode", "kwargs": {"add_generation_prompt": True}},
            {"op": "shuffle", "kwargs": {"seed": 3}},
            {"op": "select", "kwargs": {"indices": [0, 1, 2, 3, 4]}},
        ],
    }


def test_a_step_after_creation_rebuilds_the_dataset_on_next_use(client, server):
    dataset = Dataset("builtin://gsm8k-mini")
    dataset.map(GSM8KProcessor(system=None, include_solution=True))
    len(dataset)
    len(dataset)
    assert len(server.requests("POST", "/datasets")) == 1
    dataset.set_template(Template(max_length=64))
    assert dataset.handle == "ds-2"
    second = server.requests("POST", "/datasets")[1].body
    assert second["steps"][0]["kwargs"]["preprocessor"] == {
        "name": "GSM8KProcessor",
        "kwargs": {"system": None, "include_solution": True},
    }
    assert second["steps"][1]["kwargs"]["template"]["kwargs"]["max_length"] == 64


def test_code_cannot_travel_so_lambdas_and_local_functions_are_refused():
    dataset = Dataset("builtin://gsm8k-mini")

    def local_row_fn(row):
        return row

    with pytest.raises(InvalidInputError, match=r"map\(preprocessor\): <lambda> is a lambda .* register it there"):
        dataset.map(lambda row: row)
    with pytest.raises(InvalidInputError, match="local_row_fn is a lambda or a local function"):
        dataset.filter(local_row_fn)
    with pytest.raises(InvalidInputError, match="constructor argument 'prefix' is not kept as an attribute"):
        dataset.map(Unrebuildable("x"))
    assert dataset.steps == []


def test_dataset_sources_the_server_cannot_read_are_refused():
    with pytest.raises(ConfigurationError, match="holds rows in this process"):
        DatasetMeta(data=[{"text": "a"}])
    with pytest.raises(ConfigurationError, match="needs a template: call set_template"):
        Dataset("builtin://gsm8k-mini").encode()
    assert DatasetMeta("d", subset_name="main", data_slice=[3, 1]).to_dict() == {
        "dataset_id": "d",
        "split": "train",
        "subset_name": "main",
        "data_slice": [3, 1],
    }


def test_the_dataloader_iterates_epochs_like_in_process(client, server):
    dataset = Dataset("builtin://gsm8k-mini")
    loader = DataLoader(dataset=lambda: dataset, batch_size=4, shuffle=True, seed=7, min_batch_size=4)
    assert len(loader) == 3
    assert server.requests("POST", "/dataloaders")[0].body == {
        "dataset": "ds-1",
        "batch_size": 4,
        "shuffle": True,
        "seed": 7,
        "min_batch_size": 4,
    }
    assert [batch[0]["input_ids"] for batch in loader] == [[0, 0], [0, 1], [0, 2]]
    batches = iter(loader)  # the next loop is the next epoch
    assert [next(batches)[0]["input_ids"] for _ in range(3)] == [[1, 0], [1, 1], [1, 2]]
    # the epoch was read to its last batch without seeing its end: a new loop still starts the next epoch
    assert next(iter(loader))[0]["input_ids"] == [2, 0]


def test_the_dataloader_needs_a_remote_dataset():
    with pytest.raises(ConfigurationError, match="reads a twinkle_client Dataset, got list"):
        DataLoader([{"input_ids": [1]}], batch_size=1)


def test_step_options_are_the_in_process_keywords_and_only_changed_ones_travel(client, server):
    dataset = Dataset("builtin://gsm8k-mini")
    dataset.map("GSM8KProcessor", source=0, batched=False, num_proc=2)
    dataset.set_template("Template")
    dataset.encode(True, False, strict=False, drop_unsupervised=True)
    dataset.filter(has_answer, batched=True)
    dataset.shuffle(7, source="builtin://gsm8k-mini")
    assert [step["kwargs"] for step in dataset.steps if step["op"] != "set_template"] == [
        {"preprocessor": {"name": "GSM8KProcessor", "kwargs": {}}, "source": 0, "batched": False, "num_proc": 2},
        {"add_generation_prompt": True, "batched": False, "strict": False, "drop_unsupervised": True},
        {"predicate": {"name": "has_answer", "kwargs": {}}},
        {"seed": 7, "source": "builtin://gsm8k-mini"},
    ]
    assert DatasetMeta("builtin://gsm8k-mini").name == "builtin://gsm8k-mini"


def test_dataloader_arguments_come_in_the_in_process_order(client, server):
    dataset = Dataset("builtin://gsm8k-mini")
    assert len(DataLoader(dataset, 4, 2, True, 5, device_mesh=None, rank=0)) == 3
    assert server.requests("POST", "/dataloaders")[0].body == {
        "dataset": "ds-1",
        "batch_size": 4,
        "min_batch_size": 2,
        "shuffle": True,
        "seed": 5,
    }
    with pytest.raises(ConfigurationError, match="yields lists of rows, which the server's model collates"):
        DataLoader(dataset, 4, processor="InputProcessor")
