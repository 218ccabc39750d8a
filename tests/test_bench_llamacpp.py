"""benchmarks/llamacpp.py where llama.cpp cannot be had: its rows say "not run" with the reason, the table is
printed all the same and the run succeeds, without building or downloading anything; its options refuse
what they do not know by name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "llamacpp.py"


def bench(*options: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")} | ({"PATH": path} if path is not None else {})
    return subprocess.run([sys.executable, str(SCRIPT), *options], capture_output=True, text=True, timeout=120, env=env)


def llama_rows(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("| ") and "llama.cpp" in line.split("|")[2]]


def test_a_missing_llamacpp_build_gives_not_run_rows_in_every_section(tmp_path):
    missing = tmp_path / "no-such-build"
    run = bench("--llamacpp", str(missing), "--shardstream-compressions", "", "--rounds", "2",
                "--workdir", str(tmp_path / "work"))
    assert run.returncode == 0, run.stderr
    rows = llama_rows(run.stdout)
    # bf16, Q8_0, Q4_0 in memory; the same and bf16 without mmap under the cap
    assert len(rows) == 7
    assert all(f"not run: no llama-bench and llama-quantize in {missing}" in row for row in rows)
    assert any("-lm none (no mmap)" in row and "under memcap 1200M" in row for row in rows)
    assert "CPU: " in run.stdout and "avx512_bf16 " in run.stdout
    assert not (tmp_path / "work" / "llama-3.2-1b").exists()   # nothing to measure: no checkpoint written


def test_without_cmake_on_path_nothing_is_downloaded_and_the_rows_say_why(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    run = bench("--shardstream-compressions", "", "--rounds", "1", "--sections", "capped", "--mask-bf16",
                "--workdir", str(tmp_path / "work"), path=str(empty))
    assert run.returncode == 0, run.stderr
    rows = llama_rows(run.stdout)
    assert len(rows) == 4
    assert all("not run: no cmake or c++ on PATH to build llama.cpp" in row for row in rows)
    assert "-DGGML_AVX512_BF16=OFF" in run.stdout   # the masked path names the llama.cpp build it would use
    assert not (tmp_path / "work" / "llama.cpp" / "sdist").exists()


def test_unknown_sections_and_compressions_are_refused_by_name(tmp_path):
    run = bench("--sections", "memory,disk", "--workdir", str(tmp_path))
    assert run.returncode == 2
    assert "--sections: unknown disk; choose from memory, capped" in run.stderr
    run = bench("--shardstream-compressions", "none,3bit", "--workdir", str(tmp_path))
    assert run.returncode == 2
    assert "--shardstream-compressions: unknown 3bit; choose from none, 4bit" in run.stderr
    assert "Traceback" not in run.stderr


def test_stores_are_paired_with_the_gguf_type_of_their_bits():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from llamacpp import Setting, gguf_peer, settings

    assert [gguf_peer(c) for c in ("none", "8bit", "4bit", "int4", "mixed")] == ["bf16", "q8_0", "q4_0", "q4_0", None]
    ordered = [(s.runtime, s.kind, s.mmap) for s in settings(["none", "4bit", "int4", "mixed"], "capped")]
    assert ordered == [("llama.cpp", "bf16", True), ("llama.cpp", "bf16", False), ("shardstream", "none", True),
                       ("llama.cpp", "q8_0", True), ("llama.cpp", "q4_0", True), ("shardstream", "4bit", True),
                       ("shardstream", "int4", True), ("shardstream", "mixed", True)]
    assert Setting("shardstream", "none").name == "shardstream, bf16 store"
