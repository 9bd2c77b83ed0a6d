"""vLLMSampler with the engine in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, vLLM's default).

Worker calls go by name (``worker_extension_cls``) and merged weights as bytes, so nothing needs vLLM's
insecure pickling; sampled log-probs still equal the trainer's after a LoRA and a merged sync. The run is
a child process: vLLM reads the setting when its engine starts, and the other vLLM tests run in-process.
"""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM is not installed: `make test-vllm` runs these in .venv-vllm")

CHILD = """
import sys

import torch
from peft import LoraConfig

from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import IGNORE_INDEX, SamplingParams
from twinkle.model import TransformersModel
from twinkle.sampler import vLLMSampler


def gap(response, model):
    features = [s.new_input_feature for s in response.sequences]
    logps = model.forward_only(inputs=features, adapter_name="policy").logps
    return max(
        abs(a - b)
        for s, row, f in zip(response.sequences, logps, features)
        for a, b in zip(s.logprobs, row[torch.tensor(f["labels"]) != IGNORE_INDEX].tolist())
    )


def main(path):
    args = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 64 << 20, "enforce_eager": True}
    sampler = vLLMSampler(path, engine_args={**args, "enable_lora": True, "max_lora_rank": 8, "max_loras": 2})
    torch.manual_seed(0)
    model = TransformersModel(model_id=path, device="cpu")
    model.add_adapter_to_model("policy", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in model.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    prompts = [{"input_ids": [100 + 7 * i + j for j in range(24)]} for i in range(3)]
    params = SamplingParams(max_tokens=8, seed=1)
    CheckpointEngineManager(model, sampler).sync_weights()
    print(f"lora {gap(sampler.sample(prompts, params, adapter_name='policy'), model):.3e}")
    CheckpointEngineManager(model, sampler).sync_weights(merge_and_sync=True)
    print(f"merged {gap(sampler.sample(prompts, params, use_base_model=True), model):.3e}")


if __name__ == "__main__":
    main(sys.argv[1])
"""


def test_an_engine_in_its_own_process_syncs_and_samples_the_trainers_logprobs(vllm_model_dir, tmp_path):
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    env.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
    completed = subprocess.run(
        [sys.executable, "-c", CHILD, vllm_model_dir],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    gaps = dict(re.findall(r"^(lora|merged) (\S+)$", completed.stdout, re.M))
    print(f"engine in a subprocess: max |dlogp| after LoRA sync {gaps['lora']}, after merged sync {gaps['merged']}")
    assert float(gaps["lora"]) <= 1e-5 and float(gaps["merged"]) <= 1e-5
