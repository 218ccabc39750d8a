"""`make demo`'s speculative part and the `generate --draft` it runs: no transformers
deprecation warning, and text that does not repeat one line."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from test_cli_convert import run_cli
from tiny_models import llama_store_with_tokenizer

ROOT = Path(__file__).resolve().parent.parent


def test_generate_with_a_draft_prints_no_deprecation(tmp_path):
    store, _, _ = llama_store_with_tokenizer(tmp_path)
    result = run_cli("generate", str(store), "--prompt", "Hello", "--max-new-tokens", "8", "--draft", str(store),
                     "--no-progress", "--profile", cwd=tmp_path, check=True)
    assert "tokens per pass" in result.stderr
    assert "deprecated" not in result.stderr and "[transformers]" not in result.stderr, result.stderr


@pytest.mark.slow
def test_demo_speculative_part_does_not_loop(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--workdir", str(tmp_path)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    speculative = result.stdout.rsplit("--draft", 1)[1]
    lines = Counter(line for line in speculative.splitlines() if line.strip())
    assert max(lines.values()) <= 2, lines.most_common(3)
    assert "deprecated" not in result.stdout + result.stderr
    assert "tokens per pass" in result.stderr
