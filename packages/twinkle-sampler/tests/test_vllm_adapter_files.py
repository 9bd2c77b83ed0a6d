"""vLLMSampler's adapter files: written in PEFT's format, deleted with the adapter and the sampler, and never left
in the temporary directory by a killed process for longer than the next sampler's start (no vLLM needed)."""

import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

from twinkle.module import read_adapter_dir
from twinkle.sampler.vllm_adapter_files import PREFIX, AdapterFiles

CONFIG = {"peft_type": "LORA", "r": 1, "lora_alpha": 1, "target_modules": ["q_proj"]}
WEIGHTS = {"base_model.model.q_proj.lora_A.weight": torch.ones(1, 4)}


@pytest.fixture(autouse=True)
def temp_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_written_adapters_load_and_are_deleted_with_the_adapter_and_the_sampler(temp_dir):
    files = AdapterFiles()
    first, second = files.write(CONFIG, WEIGHTS), files.write(CONFIG, WEIGHTS)
    config, weights = read_adapter_dir(first)
    assert config == CONFIG and torch.equal(weights["base_model.model.q_proj.lora_A.weight"], torch.ones(1, 4))
    files.remove(first)
    assert not first.exists() and second.exists()
    users_own = temp_dir / "users-adapter"
    users_own.mkdir()
    files.remove(users_own)  # served from the user's directory: not the sampler's to delete
    assert users_own.exists()
    files.close()
    files.close()
    assert not files.root.exists()


def run_child(temp_dir, ending: str) -> str:
    """The root of an AdapterFiles made by a child process that then ends with ``ending``."""
    script = f"""
        import os, signal, tempfile
        tempfile.tempdir = {str(temp_dir)!r}
        from twinkle.sampler.vllm_adapter_files import AdapterFiles
        files = AdapterFiles()
        files.write({CONFIG!r}, {{}})
        print(files.root, flush=True)
        {ending}
    """
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True)
    assert "Traceback" not in child.stderr, child.stderr
    return child.stdout.strip()


def test_a_killed_process_leaves_its_files_only_until_the_next_sampler_starts(temp_dir):
    exited = run_child(temp_dir, "")
    assert exited and not (temp_dir / exited).exists(), "a process that exits removes its own"
    killed = temp_dir / run_child(temp_dir, "os.kill(os.getpid(), signal.SIGKILL)")
    assert killed.name.startswith(PREFIX) and any(killed.iterdir()), "SIGKILL runs no clean-up"
    alive = AdapterFiles()
    other = temp_dir / "not-an-adapter-dir"
    other.mkdir()
    AdapterFiles()
    assert not killed.exists()
    assert alive.root.exists() and other.exists(), "a live process's directory and others stay"
