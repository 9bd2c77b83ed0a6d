import numpy as np
import pytest

from twinkle.data_format import LossOutput, ModelOutput
from twinkle.errors import ComponentNotFoundError, ConfigurationError, InvalidInputError
from twinkle_client import LoraConfig
from twinkle_client.model import MultiLoraModel, TransformersModel


class GRPOLoss:
    """Stands for a registered loss class the client cannot import (it needs torch)."""

    def __init__(self, epsilon: float = 0.2, beta: float = 0.0) -> None:
        self.epsilon = epsilon
        self.beta = beta


def calls(server, run_id: str) -> list[tuple[str, dict]]:
    return [(s.body["method"], s.body["kwargs"]) for s in server.requests("POST", f"/runs/{run_id}/call")]


def test_lora_config_sends_only_the_given_fields():
    config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    assert config.to_dict() == {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
    assert LoraConfig().to_dict() == {}
    full = LoraConfig(8, 16, ["q_proj"], 0.1, True, {"q_proj": 4}, {"q_proj": 8}, "gaussian")
    assert full.to_dict() == {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ["q_proj"],
        "lora_dropout": 0.1,
        "use_rslora": True,
        "rank_pattern": {"q_proj": 4},
        "alpha_pattern": {"q_proj": 8},
        "init_lora_weights": "gaussian",
    }


def test_the_model_checks_the_servers_base_model(client):
    assert TransformersModel().model_id == "builtin://qwen3-tiny"
    assert TransformersModel(model_id="builtin://qwen3-tiny", device_mesh=None).model_id == "builtin://qwen3-tiny"
    with pytest.raises(
        ConfigurationError, match=r"serves 'builtin://qwen3-tiny'; pass model_id='builtin://qwen3-tiny'"
    ):
        TransformersModel(model_id="hf://Qwen/Qwen3-8B")
    assert MultiLoraModel is TransformersModel


def test_an_adapter_is_a_run_and_training_calls_go_to_it(client, server):
    model = TransformersModel()
    model.add_adapter_to_model("default", LoraConfig(r=16, lora_alpha=32), gradient_accumulation_steps=2)
    [created] = server.requests("POST", "/runs")
    assert created.body == {
        "session_id": "s1",
        "lora_config": {"r": 16, "lora_alpha": 32},
        "gradient_accumulation_steps": 2,
        "seed": 42,  # twinkle.initialize's seed unless one is given
    }
    model.set_optimizer("AdamW", lr=1e-3)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=5, num_training_steps=100)
    model.set_loss(GRPOLoss(epsilon=0.3))
    model.set_template("Template", max_length=128)
    batch = [{"input_ids": list(range(10)), "labels": list(range(10))}]
    output = model.forward_backward(inputs=batch, advantages=[0.5], micro_batch_size=4)
    assert model.clip_grad_and_step() == {"stepped": True, "grad_norm": 0.5, "lr": 0.001, "global_step": 1}
    assert model.calculate_metric(is_training=True) == {"loss": 1.25}
    assert model.save("last", output_dir="outputs/x") == "twinkle://run-1/weights/last"
    model.load("twinkle://run-1/weights/last")
    assert calls(server, "run-1") == [
        ("set_optimizer", {"optimizer_cls": "AdamW", "lr": 1e-3}),
        (
            "set_lr_scheduler",
            {"scheduler_cls": "CosineWarmupScheduler", "num_warmup_steps": 5, "num_training_steps": 100},
        ),
        ("set_loss", {"loss": "GRPOLoss", "epsilon": 0.3, "beta": 0.0}),
        ("set_template", {"template": "Template", "max_length": 128}),
        ("forward_backward", {"inputs": batch, "micro_batch_size": 4, "advantages": [0.5]}),
        ("clip_grad_and_step", {"max_grad_norm": 1.0}),
        ("calculate_metric", {"is_training": True}),
        ("save", {"name": "last", "save_optimizer": True}),
        ("load", {"path": "twinkle://run-1/weights/last", "load_optimizer": False}),
    ]
    assert isinstance(output, ModelOutput)
    assert (output.loss, output.num_tokens) == (1.25, 2)
    assert output.logps[0].dtype == np.float32
    np.testing.assert_array_equal(output.logps[0], [-0.5, -1.0])


def test_results_sent_as_plain_lists_still_come_back_as_numpy(client, server):
    server.results["forward_only"] = {"loss": None, "logps": [[-0.5, -0.25], [-1.0]], "num_tokens": 3}
    server.results["calculate_loss"] = {"loss": 0.75, "num_tokens": 3, "metrics": {"clip": 0.0}}
    model = TransformersModel()
    model.add_adapter_to_model("a", {"r": 4})
    output = model.forward_only(inputs=[{"input_ids": [1, 2]}])
    assert [logps.tolist() for logps in output.logps] == [[-0.5, -0.25], [-1.0]]
    assert model.calculate_loss() == LossOutput(loss=0.75, num_tokens=3, metrics={"clip": 0.0})


def test_adapter_names_route_to_their_runs_as_in_process(client, server):
    model = TransformersModel()
    model.add_adapter_to_model("a", LoraConfig(r=4))
    model.zero_grad()  # one adapter: the name may be omitted
    model.add_adapter_to_model("b", LoraConfig(r=8))
    with pytest.raises(ConfigurationError, match=r"several adapters \['a', 'b'\]: pass adapter_name="):
        model.step()
    model.step(adapter_name="b")
    with pytest.raises(ConfigurationError, match=r"unknown adapter 'c'; adapters: \['a', 'b'\]"):
        model.step(adapter_name="c")
    with pytest.raises(ConfigurationError, match="'a' already exists"):
        model.add_adapter_to_model("a", LoraConfig(r=4))
    assert calls(server, "run-1") == [("zero_grad", {})]
    assert calls(server, "run-2") == [("step", {})]
    assert client.adapter_runs == {"a": "run-1", "b": "run-2"}


def test_without_adapters_calls_go_to_a_full_parameter_run_as_in_process(client, server):
    model = TransformersModel()
    model.set_optimizer("AdamW", lr=1e-3)
    model.forward_backward(inputs=[{"input_ids": [1, 2]}])
    assert model.save("warm-up", save_optimizer=False) == "twinkle://run-1/weights/warm-up"
    [created] = server.requests("POST", "/runs")
    assert created.body == {"session_id": "s1", "lora_config": None, "gradient_accumulation_steps": 1}
    assert [method for method, _ in calls(server, "run-1")] == ["set_optimizer", "forward_backward", "save"]
    assert model.adapter_names == []
    with pytest.raises(ConfigurationError, match="set up for full-parameter training"):
        model.add_adapter_to_model("a", LoraConfig(r=4))


def test_a_checkpoint_in_the_servers_store_can_be_the_base_of_new_runs(client, server):
    model = TransformersModel(model_id="twinkle://run-1/weights/warm-up")
    assert model.model_id == "twinkle://run-1/weights/warm-up"
    model.add_adapter_to_model("default", LoraConfig(r=16))
    assert server.requests("POST", "/runs")[0].body["base_model"] == "twinkle://run-1/weights/warm-up"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("outputs/adapter", "is a path: a remote adapter is created from a LoraConfig"),
        (object(), "must be a twinkle_client.LoraConfig or a dict"),
    ],
)
def test_adapter_configs_that_cannot_travel_are_refused(client, config, message):
    with pytest.raises(InvalidInputError, match=message):
        TransformersModel().add_adapter_to_model("a", config)


def test_an_instance_with_extra_arguments_is_refused_as_in_process(client):
    model = TransformersModel()
    model.add_adapter_to_model("a", LoraConfig(r=4))
    with pytest.raises(ConfigurationError, match=r"GRPOLoss is already an instance; arguments \['beta'\]"):
        model.set_loss(GRPOLoss(), beta=0.1)


def test_generate_is_greedy_sampling_with_the_adapter(client, server):
    model = TransformersModel()
    model.add_adapter_to_model("a", LoraConfig(r=4))
    assert model.generate([1, 2, 3], max_new_tokens=5) == [7, 8]
    [request] = server.requests("POST", "/sample")
    assert request.body["run_id"] == "run-1"
    assert request.body["inputs"] == [{"input_ids": [1, 2, 3]}]
    assert request.body["sampling_params"]["temperature"] == 0.0
    assert request.body["sampling_params"]["max_tokens"] == 5
    assert request.body["num_samples"] == 1


def test_checkpoints_of_the_adapters_run(client, server):
    model = TransformersModel()
    model.add_adapter_to_model("a", LoraConfig(r=4))
    assert model.list_checkpoints() == [{"name": "c1", "path": "twinkle://run-1/weights/c1", "created_at": 1.0}]
    model.delete_checkpoint("c1")
    assert len(server.requests("DELETE", "/runs/run-1/checkpoints/c1")) == 1
    with pytest.raises(ConfigurationError, match="cannot record a dataloader position"):
        model.save("c2", dataloader=object())


def test_a_checkpoint_can_expire_on_the_server(client, server):
    model = TransformersModel()
    model.add_adapter_to_model("a", LoraConfig(r=4))
    model.save("short", ttl_seconds=2)
    model.save("kept")
    assert [kwargs for _, kwargs in calls(server, "run-1")] == [
        {"name": "short", "save_optimizer": True, "ttl_seconds": 2},
        {"name": "kept", "save_optimizer": True},  # no TTL: the server keeps it until deleted
    ]
    model.set_checkpoint_ttl("kept", 60)
    model.set_checkpoint_ttl("short", None)
    assert [s.body for s in server.requests("PUT", "/runs/run-1/checkpoints/kept/ttl")] == [{"ttl_seconds": 60}]
    assert [s.body for s in server.requests("PUT", "/runs/run-1/checkpoints/short/ttl")] == [{"ttl_seconds": None}]


def test_metrics_added_to_a_remote_model_run_here_and_join_calculate_metric(client, server):
    from twinkle_client.metric import DPOMetric

    model = TransformersModel()
    model.add_adapter_to_model("a", config_or_dir=LoraConfig(r=4))
    metric = DPOMetric()
    model.add_metric(metric)
    metric.accumulate(chosen_rewards=[1.0, 0.0], rejected_rewards=[0.0, 1.0])
    reported = model.calculate_metric()
    assert reported == {
        "loss": 1.25,
        "dpo/accuracy": 0.5,
        "dpo/margin": 0.0,
        "dpo/chosen_reward": 0.5,
        "dpo/rejected_reward": 0.5,
        "dpo/num_pairs": 2.0,
    }
    assert model.calculate_metric() == {"loss": 1.25}  # reset by the previous report, as in-process
    assert [method for method, _ in calls(server, "run-1")] == ["calculate_metric", "calculate_metric"]
    with pytest.raises(ComponentNotFoundError, match="unknown metric 'NoSuchMetric'"):
        model.add_metric("NoSuchMetric")


def test_update_optimizer_sets_hyperparameters_of_the_runs_optimizer(client, server):
    model = TransformersModel()
    model.add_adapter_to_model("a", LoraConfig(r=4))
    model.update_optimizer(lr=2e-4, weight_decay=0.0)
    assert calls(server, "run-1") == [("update_optimizer", {"lr": 2e-4, "weight_decay": 0.0})]
