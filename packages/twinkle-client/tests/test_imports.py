import subprocess
import sys

SUBMODULES = [
    "advantage",
    "checkpoint_engine",
    "components",
    "context",
    "data_format",
    "dataloader",
    "dataset",
    "http",
    "lora",
    "metric",
    "model",
    "preprocessor",
    "remote_errors",
    "reward",
    "sampler",
    "template",
]
HEAVY = ["torch", "transformers", "peft", "datasets"]


def test_the_client_and_every_submodule_import_without_torch_transformers_or_peft():
    imports = "; ".join(f"import twinkle_client.{name}" for name in SUBMODULES)
    script = f"import sys, twinkle_client; {imports}; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_the_mirrored_names_are_the_local_implementations_where_they_run_locally():
    import twinkle.advantage
    import twinkle.reward
    from twinkle_client import advantage, reward

    assert reward.GSM8KAccuracyReward is twinkle.reward.GSM8KAccuracyReward
    assert advantage.GRPOAdvantage is twinkle.advantage.GRPOAdvantage
    assert advantage.__all__ == twinkle.advantage.__all__
