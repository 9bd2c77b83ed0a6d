"""One tenant of the multi-tenant server test, run as its own process: ``tenant_worker.py JOB SEED``.

The jobs use only ``twinkle_client`` (what a laptop has) and print one JSON
line with what the test compares against the same job run in-process.
"""

from __future__ import annotations

import json
import sys

from twinkle_client import LoraConfig, init_twinkle_client
from twinkle_client.data_format import SamplingParams
from twinkle_client.model import TransformersModel
from twinkle_client.sampler import TorchSampler

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from tenant_jobs import JOBS, STEPS, grpo_rewards, job_features


def main(job: str, seed: int) -> None:
    init_twinkle_client()
    spec = JOBS[job]
    model = TransformersModel()
    model.add_adapter_to_model(job, LoraConfig(**spec["lora"]), seed=seed)
    model.set_optimizer("AdamW", lr=spec["lr"])
    result: dict = {"losses": []}
    if spec["kind"] == "sft":
        for step in range(STEPS):
            result["losses"].append(model.forward_backward(job_features(job, step)).loss)
            model.clip_grad_and_step()
    elif spec["kind"] == "grpo":
        model.set_loss("GRPOLoss", epsilon=0.2)
        sampler = TorchSampler()
        for step in range(STEPS):
            prompts = job_features(job, step)
            response = sampler.sample(
                prompts, SamplingParams(max_tokens=4, seed=seed + step), adapter_name=job, num_samples=2
            )
            inputs = [s.new_input_feature for s in response.sequences]
            advantages = grpo_rewards([s.tokens for s in response.sequences])
            output = model.forward_backward(
                inputs, old_logps=[s.logprobs for s in response.sequences], advantages=advantages
            )
            result["losses"].append(output.loss)
            model.clip_grad_and_step()
    else:  # forward-only log-probabilities of a fixed adapter
        for step in range(STEPS):
            output = model.forward_only(job_features(job, step))
            result["losses"].append([logps.tolist() for logps in output.logps])
    result["checkpoint"] = model.save("final", save_optimizer=False)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
