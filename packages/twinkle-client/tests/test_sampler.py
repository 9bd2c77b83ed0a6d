import pytest

from twinkle.data_format import SampleCall, SampledSequence, SampleResponse, SamplingParams
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle_client import LoraConfig
from twinkle_client.checkpoint_engine import CheckpointEngineManager
from twinkle_client.model import TransformersModel
from twinkle_client.sampler import TorchSampler, vLLMSampler
from twinkle_client.template import Template

PROMPTS = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]


def test_sampling_with_a_named_adapter_uses_its_run(client, server):
    model = TransformersModel()
    model.add_adapter_to_model("default", LoraConfig(r=4))
    sampler = TorchSampler(model_id="builtin://qwen3-tiny")
    sampler.set_template("Template", enable_thinking=False)
    response = sampler.sample(PROMPTS, SamplingParams(max_tokens=8, seed=1), adapter_name="default", num_samples=3)
    assert isinstance(response, SampleResponse)
    assert len(response.sequences) == 6
    expected = SampledSequence([7, 8], "stop", [-0.5, -0.25], decoded="7 8", adapter_name="default")
    assert response.sequences[0] == expected  # named by the adapter, as in-process, not by the server's run id
    [request] = server.requests("POST", "/sample")
    assert request.body == {
        "inputs": PROMPTS,
        "sampling_params": SamplingParams(max_tokens=8, seed=1).to_dict(),
        "num_samples": 3,
        "run_id": "run-1",
        "template": {"name": "Template", "kwargs": {"enable_thinking": False}},
    }


def test_without_an_adapter_the_base_model_samples_and_num_samples_follows_the_params(client, server):
    sampler = vLLMSampler()
    sampler.sample(PROMPTS[0], SamplingParams(num_samples=2))
    [request] = server.requests("POST", "/sample")
    assert "run_id" not in request.body and "template" not in request.body
    assert request.body["inputs"] == [PROMPTS[0]]
    assert request.body["num_samples"] == 2


def test_a_sampler_on_a_checkpoint_names_it_when_no_run_is_used(client, server):
    sampler = TorchSampler(model_id="twinkle://run-1/weights/warm-up")
    sampler.sample(PROMPTS)
    assert server.requests("POST", "/sample")[0].body["base_model"] == "twinkle://run-1/weights/warm-up"


def test_a_merged_sync_of_a_full_parameter_model_samples_its_run(client, server):
    model = TransformersModel()
    model.set_optimizer("AdamW")
    sampler = TorchSampler()
    CheckpointEngineManager(model, sampler).sync_weights(merge_and_sync=True)
    sampler.sample(PROMPTS)
    assert server.requests("POST", "/sample")[0].body["run_id"] == "run-1"


def test_sample_many_sends_every_call_before_waiting_and_keeps_each_calls_error(client, server):
    """The server generates calls it has queued together, so all are sent first; a call refused by the server or
    here (an unknown adapter) gets its own error, and the others their responses, in order."""
    server.pending_polls = 1
    server.script("POST", "/sample", server.error(400, "InvalidInputError", "prompt too long for this server"))
    calls = [
        SampleCall(PROMPTS, SamplingParams(max_tokens=10**6)),
        SampleCall(PROMPTS[0], SamplingParams(max_tokens=4, seed=1)),
        SampleCall(PROMPTS, adapter_name="nope"),
        SampleCall(PROMPTS, SamplingParams(num_samples=2), use_base_model=True),
    ]
    results = TorchSampler().sample_many(calls)
    paths = [seen.path for seen in server.seen if seen.path == "/sample" or seen.path.startswith("/futures/")]
    assert paths[:3] == ["/sample"] * 3 and "/sample" not in paths[3:]
    with pytest.raises(InvalidInputError, match="prompt too long for this server"):
        results[0].unwrap()
    assert [len(results[index].unwrap().sequences) for index in (1, 3)] == [1, 4]
    with pytest.raises(InvalidInputError, match="unknown adapter 'nope'"):
        results[2].unwrap()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"adapter_name": "nope"}, r"unknown adapter 'nope'; adapters: \[\]. Add it with model.add_adapter_to_model"),
        ({"adapter_name": ["a", "b"]}, "takes one adapter_name per call"),
        ({"sampling_params": {"max_tokens": 3}}, "sampling_params must be a SamplingParams, got dict"),
    ],
)
def test_bad_sample_arguments_are_refused_before_any_request(client, server, kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        TorchSampler().sample(PROMPTS, **kwargs)
    assert server.requests("POST", "/sample") == []


def test_sync_weights_moves_nothing_and_points_the_sampler_at_the_run(client, server):
    model = TransformersModel()
    model.add_adapter_to_model("policy", LoraConfig(r=4))
    other = TransformersModel()
    other.add_adapter_to_model("policy", LoraConfig(r=4))  # same name, later: the process-wide map now says run-2
    sampler = TorchSampler()
    manager = CheckpointEngineManager(model=model, sampler=sampler)
    calls_before = len(server.seen)
    manager.sync_weights()
    assert len(server.seen) == calls_before
    sampler.sample(PROMPTS, adapter_name="policy")
    sampler.sample(PROMPTS)  # the one adapter synced into the sampler, as in-process
    sampler.sample(PROMPTS, use_base_model=True)
    manager.sync_weights(merge_and_sync=True)
    sampler.sample(PROMPTS, use_base_model=True)  # after a merged sync the sampler's base "holds" the policy
    runs = [request.body.get("run_id") for request in server.requests("POST", "/sample")]
    assert runs == ["run-1", "run-1", None, "run-1"]


def test_without_a_name_a_sampler_synced_with_several_adapters_refuses_to_guess(client, server):
    model = TransformersModel()
    model.add_adapter_to_model("a", LoraConfig(r=4))
    model.add_adapter_to_model("b", LoraConfig(r=4))
    sampler = TorchSampler()
    for name in ("a", "b"):
        CheckpointEngineManager(model, sampler, adapter_name=name).sync_weights()
    with pytest.raises(InvalidInputError, match=r"serves several adapters \['a', 'b'\]: pass adapter_name="):
        sampler.sample(PROMPTS)
    with pytest.raises(InvalidInputError, match="do not also pass adapter_name='a'"):
        sampler.sample(PROMPTS, adapter_name="a", use_base_model=True)
    sampler.sample(PROMPTS, adapter_name="b")
    sampler.sample(PROMPTS, use_base_model=True)
    runs = [request.body.get("run_id") for request in server.requests("POST", "/sample")]
    assert runs == [model.run_id("b"), None]


def test_the_manager_checks_adapters_as_in_process(client):
    model = TransformersModel()
    with pytest.raises(ConfigurationError, match=r"no LoRA adapter to sync; use sync_weights\(merge_and_sync=True\)"):
        CheckpointEngineManager(model, TorchSampler()).sync_weights()
    model.add_adapter_to_model("a", LoraConfig(r=4))
    model.add_adapter_to_model("b", LoraConfig(r=4))
    with pytest.raises(ConfigurationError, match=r"several adapters \['a', 'b'\]: pass adapter_name="):
        CheckpointEngineManager(model, TorchSampler())
    with pytest.raises(ConfigurationError, match="no adapter 'c'"):
        CheckpointEngineManager(model, TorchSampler(), adapter_name="c")


def test_the_template_encodes_and_decodes_on_the_server(client, server):
    template = Template("builtin://qwen3-tiny", enable_thinking=False)
    feature = template.encode({"messages": [{"role": "user", "content": "hi"}]}, add_generation_prompt=True)
    assert feature == {"input_ids": [1, 1, 1]}
    assert template.decode([5, 6], skip_special_tokens=True) == "5 6"
    encode, decode = server.requests("POST", "/templates/encode")[0], server.requests("POST", "/templates/decode")[0]
    spec = {
        "name": "Template",
        "kwargs": {
            "model_id": "builtin://qwen3-tiny",
            "max_length": 8192,
            "truncation_strategy": "raise",
            "default_system": None,
            "enable_thinking": False,
            "chat_template": None,
        },
    }
    assert encode.body == {
        "template": spec,
        "trajectories": [{"messages": [{"role": "user", "content": "hi"}]}],
        "add_generation_prompt": True,
    }
    assert decode.body == {"template": spec, "token_ids": [[5, 6]], "skip_special_tokens": True}


def test_the_sampler_decodes_lists_adapters_and_has_a_prefix_cache_to_reset_as_in_process(client, server):
    model = TransformersModel()
    model.add_adapter_to_model("default", LoraConfig(r=4))
    sampler = TorchSampler()
    assert sampler.adapter_names == ["default"]  # every adapter this client added can be named
    assert sampler.decode([5, 6]) == "5 6"
    sampler.set_template("Template", enable_thinking=False)
    sampler.decode([7])
    first, second = server.requests("POST", "/templates/decode")
    assert first.body == {"token_ids": [[5, 6]], "skip_special_tokens": True}  # the server's default template
    assert second.body["template"] == {"name": "Template", "kwargs": {"enable_thinking": False}}
    requests_before = len(server.seen)
    sampler.reset_prefix_cache()
    assert len(server.seen) == requests_before  # no request: the server keeps no prompt cache between calls
