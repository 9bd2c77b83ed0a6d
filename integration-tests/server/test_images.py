"""Images over the server (builtin://qwen3-vl-tiny): the Tinker SDK's image chunks and the native client's
trajectory images become the same features, tenants with and without images share the server, and every
bad image is a 4xx for its own request only.

One server serves the module; alice trains over Tinker, bob over the native client, carol has tiny image
quotas. Every image is one of builtin://clevr-mini's 64x64 PNG scenes (4 vision tokens each).
"""

from __future__ import annotations

import base64
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
from tinker import types

from twinkle.data_format import IGNORE_INDEX, SamplingParams
from twinkle.errors import InvalidInputError, QuotaExceededError
from twinkle.hub import resolve_dataset
from twinkle.template import Template
from twinkle_client import init_twinkle_client
from twinkle_client.http import TwinkleClient
from twinkle_client.model import TransformersModel
from twinkle_client.sampler import TorchSampler, sample_body, sample_request

sys.path.insert(0, str(Path(__file__).parent))
from test_client_cookbooks import final_line, run_script
from tinker_harness import close_clients, service_client

pytestmark = pytest.mark.integration

MODEL = "builtin://qwen3-vl-tiny"
TINKER_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


@pytest.fixture(scope="module")
def server(start_server):
    carol = {"max_image_bytes": 100, "max_images_per_request": 1}
    yield start_server(["alice", "bob", "carol"], user_quotas={"carol": carol}, model_id=MODEL)
    close_clients()


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    with open(os.path.join(resolve_dataset("builtin://clevr-mini"), "train.jsonl"), encoding="utf-8") as handle:
        return [json.loads(next(handle)) for _ in range(3)]


@pytest.fixture(scope="module")
def template() -> Template:
    return Template(model_id=MODEL)


def trajectory(row: dict[str, Any]) -> dict[str, Any]:
    messages = [
        {"role": "user", "content": "<image>" + row["question"]},
        {"role": "assistant", "content": row["answer"]},
    ]
    return {"messages": messages, "images": [row["image"]]}


def png(row: dict[str, Any]) -> bytes:
    return base64.b64decode(row["image"].partition(",")[2])


def tinker_chunks(ids: list[int], image: bytes, image_token: int) -> list[Any]:
    """Text chunks around one image chunk standing for the run of image tokens (as tinker-cookbook renders)."""
    first = ids.index(image_token)
    count = ids.count(image_token)
    return [
        types.EncodedTextChunk(tokens=ids[:first]),
        types.ImageChunk(data=image, format="png", expected_tokens=count),
        types.EncodedTextChunk(tokens=ids[first + count :]),
    ]


def tinker_datum(template: Template, row: dict[str, Any], image: bytes | None = None) -> types.Datum:
    """The Template's feature of the row as a next-token datum: inputs ids[:-1], targets ids[1:]."""
    feature = template.encode(trajectory(row))
    ids, labels = feature["input_ids"], feature["labels"]
    image_token = template.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return types.Datum(
        model_input=types.ModelInput(chunks=tinker_chunks(ids[:-1], image or png(row), image_token)),
        loss_fn_inputs={
            "target_tokens": ids[1:],
            "weights": [0.0 if label == IGNORE_INDEX else 1.0 for label in labels[1:]],
        },
    )


@pytest.fixture(scope="module")
def alice(server):
    return service_client(server, "alice")


@pytest.fixture(scope="module")
def trainer(alice):
    return alice.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()


@pytest.fixture(scope="module")
def native(server):
    client = init_twinkle_client(server.url, server.keys["bob"])
    model = TransformersModel(model_id=MODEL)
    model.add_adapter_to_model("vl", {"r": 4, "lora_alpha": 32, "target_modules": TINKER_TARGETS}, seed=0)
    model.set_template("Template", model_id=MODEL)
    model.set_optimizer("AdamW", lr=1e-3)
    yield model
    client.close()


def test_tinker_image_chunks_give_the_native_loss_and_logprobs(trainer, native, rows, template):
    """Tinker's cross_entropy (a sum) over image datums equals the native loss (a token mean) times its tokens,
    and each trained position's log-prob equals the native one: the same features reached the model."""
    data = [tinker_datum(template, row) for row in rows]
    tinker_out = trainer.forward_backward(data, "cross_entropy").result()
    native_out = native.forward_backward(inputs=[trajectory(row) for row in rows])
    tinker_sum = tinker_out.metrics["loss:sum"]
    native_sum = native_out.loss * native_out.num_tokens
    print(f"image SFT loss over {len(rows)} datums: tinker loss:sum {tinker_sum:.6f}, native {native_sum:.6f}")
    assert tinker_sum == pytest.approx(native_sum, rel=1e-5, abs=1e-5)
    for datum, output, native_logps in zip(data, tinker_out.loss_fn_outputs, native_out.logps, strict=True):
        weights = datum.loss_fn_inputs["weights"].to_numpy() > 0
        tinker_logps = output["logprobs"].to_numpy()[weights]
        trained = np.asarray(native_logps)[1:][weights]  # native: label t's log-prob sits at t
        np.testing.assert_allclose(tinker_logps, trained, rtol=1e-5, atol=1e-5)
    native.clip_grad_and_step()
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_image_and_text_tenants_share_the_server(server, alice, trainer, native, rows, template):
    """A text-only datum and an image datum from two tenants at once: each gets what it gets alone."""
    text_client = service_client(server, "alice").create_lora_training_client(base_model=MODEL, rank=4).result()
    text_datum = types.Datum(
        model_input=types.ModelInput.from_ints([151644, 872, 198, 9707, 151645]),
        loss_fn_inputs={"target_tokens": [872, 198, 9707, 151645, 198], "weights": [1.0] * 5},
    )
    image_datum = tinker_datum(template, rows[0])
    alone = [
        text_client.forward([text_datum], "cross_entropy").result(),
        trainer.forward([image_datum], "cross_entropy").result(),
    ]
    with ThreadPoolExecutor(2) as pool:
        both = [
            pool.submit(lambda: text_client.forward([text_datum], "cross_entropy").result()),
            pool.submit(lambda: trainer.forward([image_datum], "cross_entropy").result()),
        ]
        together = [future.result() for future in both]
    for solo, shared in zip(alone, together, strict=True):
        assert shared.metrics["loss:sum"] == pytest.approx(solo.metrics["loss:sum"], rel=1e-5, abs=1e-5)


def test_image_prompts_sample_over_both_apis(alice, native, rows, template):
    prompt_feature = template.encode(
        {**trajectory(rows[0]), "messages": trajectory(rows[0])["messages"][:1]}, add_generation_prompt=True
    )
    image_token = template.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    prompt = types.ModelInput(chunks=tinker_chunks(prompt_feature["input_ids"], png(rows[0]), image_token))
    sampler = alice.create_sampling_client(base_model=MODEL).result()
    params = types.SamplingParams(max_tokens=3, temperature=0.0)
    tinker_tokens = sampler.sample(prompt, num_samples=1, sampling_params=params).result().sequences[0].tokens
    remote = TorchSampler(model_id=MODEL)
    prompt_trajectory = {"messages": trajectory(rows[0])["messages"][:1], "images": [png(rows[0])]}  # bytes
    response = remote.sample([prompt_trajectory], SamplingParams(max_tokens=3, temperature=0.0), use_base_model=True)
    assert list(response.sequences[0].tokens) == list(tinker_tokens) and len(tinker_tokens) == 3


@pytest.mark.parametrize(
    ("image", "expected", "message"),
    [
        (b"\x89PNG\r\n\x1a\nnot really", 4, "data[0].model_input[1] is not a readable image"),
        (None, 5, "data[0].model_input[1]: expected_tokens is 5 but this image takes 4 vision tokens"),
    ],
)
def test_bad_tinker_images_are_400s_and_others_go_on(trainer, rows, template, image, expected, message):
    bad = tinker_datum(template, rows[0], image)
    chunk = bad.model_input.chunks[1]
    bad.model_input.chunks[1] = types.ImageChunk(data=chunk.data, format="png", expected_tokens=expected)
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(lambda: trainer.forward([tinker_datum(template, rows[1])], "cross_entropy").result())
        with pytest.raises(tinker.BadRequestError, match=re.escape(message)):
            trainer.forward_backward([bad], "cross_entropy").result()
        assert good.result().metrics["loss:sum"] > 0


def test_image_asset_pointers_are_refused(alice):
    pointer = types.ImageAssetPointerChunk(format="png", location="uploads/cat.png", expected_tokens=4)
    prompt = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[151644]), pointer])
    with pytest.raises(tinker.BadRequestError, match="image_asset_pointer chunks are not supported"):
        alice.create_sampling_client(base_model=MODEL).result().sample(
            prompt, 1, types.SamplingParams(max_tokens=1)
        ).result()


def test_bad_native_images_are_refused_naming_the_problem(server, native, rows, tmp_path):
    good, corrupt = trajectory(rows[0]), {**trajectory(rows[1]), "images": [b"\x89PNG\r\n\x1a\ntruncated"]}
    with pytest.raises(InvalidInputError, match=r"inputs\[1\]\.images\[0\] is not a readable image"):
        native.forward_backward(inputs=[good, corrupt])
    extra = {**good, "images": good["images"] * 2}
    with pytest.raises(InvalidInputError, match=r"holds 1 <image> placeholder\(s\) but trajectory.images holds 2"):
        native.forward_only(inputs=[extra])
    fewer = {**good, "messages": [{**good["messages"][0], "content": "<image><image>two?"}, good["messages"][1]]}
    with pytest.raises(InvalidInputError, match=r"holds 2 <image> placeholder\(s\) but trajectory.images holds 1"):
        native.forward_only(inputs=[fewer])
    assert native.forward_only(inputs=[good]).loss > 0  # bob's run is unaffected


def test_image_quotas_refuse_too_many_and_too_large(server, rows):
    prompt = {"messages": trajectory(rows[0])["messages"][:1], "images": [rows[0]["image"]]}
    with TwinkleClient(server.url, server.keys["carol"]) as carol:
        with pytest.raises(QuotaExceededError, match="max_image_bytes of user 'carol' is 100") as large:
            sample_request(carol, sample_body([prompt], SamplingParams(max_tokens=1), None))
        assert large.value.limit == "max_image_bytes"
        with pytest.raises(QuotaExceededError, match="has 2 images; the quota max_images_per_request") as many:
            sample_request(carol, sample_body([prompt, prompt], SamplingParams(max_tokens=1), None))
        assert many.value.limit == "max_images_per_request"


@pytest.mark.parametrize(
    ("api", "script"), [("twinkle", "twinkle/self_host/multi_modal.py"), ("tinker", "tinker/self_host/multi_modal.py")]
)
def test_multi_modal_cookbook_lowers_the_loss(server, api, script, tmp_path):
    """cookbook/client/<api>/self_host/multi_modal.py, shrunk: LoRA on clevr-mini images, loss going down."""
    user = {"twinkle": "bob", "tinker": "alice"}[api]
    run = run_script(server, user, script, tmp_path, {"MAX_STEPS": "6", "BATCH_SIZE": "4"})
    line = final_line(run, r"loss: first step (\S+) -> last step (\S+)")
    print(f"{api} multi_modal.py: {line[0]}")
    assert float(line[2]) < float(line[1])
    assert "A: " in run.output()


def test_the_server_logged_no_errors(server):
    assert server.errors() == []
