"""A config.json that contradicts its checkpoint is named at convert time: the CLI as a
user runs it, in a subprocess; one sentence, exit 1, nothing written."""

from __future__ import annotations

import json

import pytest

from test_cli_convert import run_cli
from tiny_models import save_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("config") / "src"
    save_checkpoint("llama", folder)   # 4 blocks, vocabulary 128
    return folder


@pytest.mark.parametrize("field,value,message", [
    ("num_hidden_layers", 6, "config.json num_hidden_layers is 6 but the checkpoint's tensors hold 4 blocks (0-3), "
                             "none for block 4; set num_hidden_layers to the number of blocks"),
    ("vocab_size", "128", "config.json vocab_size is '128', not a positive integer; fix it in config.json"),
    ("max_position_embeddings", -1, "config.json max_position_embeddings is -1, not a positive integer"),
    ("vocab_size", 256, "config.json vocab_size is 256 but the embedding model.embed_tokens.weight has 128 rows; "
                        "set vocab_size to 128"),
])
def test_bad_config_field_is_named_at_convert_time(checkpoint, tmp_path, field, value, message):
    src = tmp_path / "src"
    src.mkdir()
    for path in checkpoint.iterdir():
        (src / path.name).symlink_to(path)
    config = json.loads((checkpoint / "config.json").read_text())
    (src / "config.json").unlink()
    (src / "config.json").write_text(json.dumps({**config, field: value}))

    result = run_cli("convert", "src", "store", "--no-progress", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "store").exists()
