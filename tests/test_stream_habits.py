"""Code written for AirLLM or for a transformers model, run against a streamed model as its users run it:
AirLLM's README example in a real process, `model.tokenizer`, `eval()`, `to()`, `dtype`, a closed model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardstream.convert import convert
from shardstream.errors import InvalidOption
from shardstream import AutoModel

DEMO = Path(__file__).resolve().parents[1] / "assets" / "demo-model"

# AirLLM's README example, as published but for the model path and the `.cuda()` after
# `input_tokens['input_ids']` (torch's CPU build has no CUDA; the model runs on the CPU by default).
AIRLLM_README = '''
from shardstream import AutoModel

MAX_LENGTH = 128
# could use hugging face model repo id:
model = AutoModel.from_pretrained(MODEL_PATH)

input_text = [
        'What is the capital of United States?',
        #'I like',
    ]

input_tokens = model.tokenizer(input_text,
    return_tensors="pt",
    return_attention_mask=False,
    truncation=True,
    max_length=MAX_LENGTH,
    padding=False)

generation_output = model.generate(
    input_tokens['input_ids'],
    max_new_tokens=20,
    use_cache=True,
    return_dict_in_generate=True)

output = model.tokenizer.decode(generation_output.sequences[0])

print(output)
'''


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("demo") / "store"
    convert(DEMO, store, progress=False)
    return store


def test_airllm_readme_code_runs_against_a_store_and_a_checkpoint_folder(tmp_path, demo_store):
    """It stopped at `model.tokenizer`, which did not exist."""
    checkpoint = tmp_path / "demo-model"
    shutil.copytree(DEMO, checkpoint)
    env = {**os.environ, "SHARDSTREAM_CACHE": str(tmp_path / "cache")}
    runs = []
    for path in (demo_store, checkpoint):   # the checkpoint folder is converted into the cache first
        script = tmp_path / f"example_{path.name}.py"
        script.write_text(AIRLLM_README.replace("MODEL_PATH", repr(str(path))))
        runs.append(subprocess.Popen([sys.executable, str(script)], env=env, cwd=tmp_path, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
        assert out.startswith("<s>What is the capital of United States?") and len(out) > 60, out
    assert [p.name for p in (tmp_path / "cache").iterdir()][0].startswith("demo-model-")


def test_transformers_habits(demo_store):
    """eval(), to() and dtype raised AttributeError; a closed model failed on meta tensors."""
    model = AutoModel.from_pretrained(demo_store, compute_dtype="float32")
    assert model.eval() is model
    assert model.to("cpu") is model and model.to(torch.device("cpu"), torch.float32) is model
    assert model.dtype == torch.float32
    with pytest.raises(InvalidOption, match=r"runs on cpu, chosen when it was opened; to run it on cuda:1, open it "
                                            r"with AutoModel.from_pretrained\(..., device='cuda:1'\) instead"):
        model.to("cuda:1")
    with pytest.raises(InvalidOption, match=r"computes in torch.float32, .* dtype=torch.bfloat16\) instead"):
        model.to(dtype=torch.bfloat16)
    ids = model.tokenizer(["ROMEO:"], return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=2, do_sample=False).shape[-1] == ids.shape[-1] + 2
    model.close()
    for call in (lambda: model.generate(ids, max_new_tokens=2), lambda: model(ids)):
        with pytest.raises(InvalidOption, match="the model is closed .*; open it again with AutoModel.from_pretrained"):
            call()
