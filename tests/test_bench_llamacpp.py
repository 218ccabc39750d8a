"""benchmarks/llamacpp.py where llama.cpp cannot be had: its rows say "not run" with the reason, the table is
printed all the same and the run succeeds, without building or downloading anything; its options refuse
what they do not know by name."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_serving_serve_memory import MEMCAP, _memcap_missing

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


def test_an_moe_shape_takes_its_own_cap_and_gguf_types_and_reports_its_expert_cache(tmp_path):
    missing = tmp_path / "no-such-build"
    run = bench("--shape", "qwen3-30b-a3b", "--layers", "1", "--llamacpp", str(missing), "--sections", "capped",
                "--gguf-types", "bf16,q4_0", "--shardstream-compressions", "", "--rounds", "1",
                "--workdir", str(tmp_path / "work"))
    assert run.returncode == 0, run.stderr
    rows = llama_rows(run.stdout)
    assert [row.split("|")[2].strip() for row in rows] == ["llama.cpp bf16 GGUF", "llama.cpp bf16 GGUF, -lm none (no mmap)",
                                                           "llama.cpp Q4_0 GGUF"]
    assert all("under memcap 2000M" in row for row in rows)
    assert "routings served by the expert cache (decode)" in run.stdout
    assert "Decode: 16 random steps" in run.stdout and "Model: qwen3-30b-a3b-shaped" in run.stdout
    assert "experts on demand, an eighth of their bytes cached" in run.stdout
    assert not (tmp_path / "work").exists()
    run = bench("--shape", "qwen3-30b-a3b", "--layers", "1", "--llamacpp", str(missing), "--sections", "capped",
                "--gguf-types", "q4_0", "--shardstream-compressions", "", "--rounds", "1", "--expert-cache", "auto",
                "--workdir", str(tmp_path / "work"))
    assert run.returncode == 0, run.stderr
    assert "experts on demand, cached as max_expert_memory='auto' sizes it" in run.stdout
    run = bench("--gguf-types", "bf16,q5_k", "--workdir", str(tmp_path))
    assert run.returncode == 2
    assert "--gguf-types: unknown q5_k; choose from bf16, q8_0, q4_0" in run.stderr


def test_an_moe_shape_builds_its_checkpoint_with_every_option_moe_py_reads(tmp_path):
    """An MoE shape's checkpoint and stores are benchmarks/moe.py's, made by its `build` from the options this
    script hands it: all of them (one it did not have, its residual scale, stopped every MoE run here)."""
    import argparse

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import llamacpp
    import moe

    ckpt = tmp_path / "qwen3-30b-a3b-l1" / "ckpt"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")   # made already: build writes nothing, converts no store
    options = llamacpp.moe_args(argparse.Namespace(shape="qwen3-30b-a3b", layers=1, workdir=str(tmp_path)))
    assert moe.build(argparse.Namespace(**vars(options), stores="")) == {}


def test_gguf_types_left_out_leave_their_stores_without_a_peer():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from llamacpp import default_cap, is_moe, settings

    ordered = [(s.runtime, s.kind, s.mmap) for s in settings(["none", "8bit", "4bit"], "memory", ("bf16", "q4_0"))]
    assert ordered == [("llama.cpp", "bf16", True), ("shardstream", "none", True), ("llama.cpp", "q4_0", True),
                       ("shardstream", "4bit", True), ("shardstream", "8bit", True)]
    both = settings(["4bit"], "capped", ("bf16", "q4_0"), (True, False))
    assert [s.name for s in both] == ["llama.cpp bf16 GGUF", "llama.cpp bf16 GGUF, -lm none (no mmap)", "llama.cpp Q4_0 GGUF",
                                      "llama.cpp Q4_0 GGUF, --repack 0", "shardstream, 4bit store"]
    assert [is_moe(s) for s in ("llama-3.2-1b", "qwen3-30b-a3b", "mixtral-8x7b")] == [False, True, True]
    assert [default_cap(s) for s in ("llama-3.2-1b", "qwen3-30b-a3b")] == ["1200M", "2000M"]


def test_a_crash_under_the_cap_names_its_signal_and_the_step_it_was_in(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import llamacpp

    fake = tmp_path / "memcap"   # passes the command's status on, as memcap does
    fake.write_text("#!/bin/sh\nshift 4\n\"$@\"\nrc=$?\necho 'memcap: limit 1.0G, peak 10M, cap hit 0' >&2\nexit $rc\n")
    fake.chmod(0o755)
    monkeypatch.setattr(llamacpp, "MEMCAP", fake)
    crash = "echo 'llama-bench: benchmark 1/2: warmup prompt run' >&2; kill -SEGV $$"
    env = dict(os.environ)
    assert llamacpp.capped(["sh", "-c", crash], "1G", tmp_path, 60, env) == "failed: SIGSEGV (llama-bench: benchmark 1/2: warmup prompt run)"
    assert llamacpp.capped(["sh", "-c", "echo 'bad model' >&2; exit 1"], "1G", tmp_path, 60, env) == "failed: bad model"


def test_peers_run_with_the_openmp_settings_the_benchmark_started_with(tmp_path):
    """`import shardstream` sets OMP_WAIT_POLICY=PASSIVE for our processes; a peer (llama.cpp, an OpenMP program
    too; transformers, accelerate and AirLLM in benchmarks/stream.py) runs without it (its own default, spinning
    barriers) unless the user set it, ours with it, and the path line says so."""
    fake = tmp_path / "memcap"
    fake.write_text("#!/bin/sh\nshift 4\n\"$@\"\n")
    fake.chmod(0o755)
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import llamacpp, shardstream, os; "
            f"llamacpp.MEMCAP = {str(fake)!r}; probe = ['sh', '-c', 'echo ${{OMP_WAIT_POLICY:-unset}}']; "
            f"print(llamacpp.capped(probe, '1G', {str(tmp_path)!r}, 60, llamacpp.peer_env())[0].strip(), "
            f"llamacpp.capped(probe, '1G', {str(tmp_path)!r}, 60, llamacpp.our_env())[0].strip()); "
            "print(llamacpp.openmp(llamacpp.peer_env()), '/', llamacpp.openmp(llamacpp.our_env()))")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = str(ROOT / "src")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**env, **given})
            for given in ({}, {"GOMP_SPINCOUNT": "20000"}, {"OMP_WAIT_POLICY": "ACTIVE"})]
    assert all(run.returncode == 0 for run in runs), "".join(run.stderr for run in runs)
    unset, spin, active = (run.stdout.splitlines() for run in runs)
    assert unset == ["unset PASSIVE", "libgomp's defaults / OMP_WAIT_POLICY=PASSIVE"]
    assert spin[1] == "GOMP_SPINCOUNT=20000 / OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=20000"
    assert active == ["ACTIVE ACTIVE", "OMP_WAIT_POLICY=ACTIVE / OMP_WAIT_POLICY=ACTIVE"]


def test_llama_bench_reads_are_counted_from_its_generation_run(tmp_path):
    """`_llamacpp.py` as the benchmark runs it: a stand-in for llama-bench that announces its runs on stderr."""
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\n"
                    "echo 'llama-bench: benchmark 1/2: warmup generation run' >&2\n"
                    "echo 'llama-bench: benchmark 2/2: generation run 1/1' >&2\n"
                    "echo '[{\"n_gen\": 0, \"avg_ts\": 50.0}, {\"n_gen\": 16, \"avg_ts\": 5.0}]'\n")
    fake.chmod(0o755)
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "_llamacpp.py"), str(fake)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _llamacpp import bench_result

    result = bench_result(run.stdout)
    assert result["prefill"] == 50.0 and result["decode"] == 5.0 and result["decode_read"] >= 0
    assert bench_result('[{"n_gen": 16, "avg_ts": 5.0}]') == {"decode": 5.0}


def test_the_peak_is_the_cgroups_own_count_where_the_run_read_it_and_memcaps_figure_otherwise():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from llamacpp import with_peak

    assert with_peak({"decode": 1.0, "peak_bytes": 3 << 29}, "1.6G") == {"decode": 1.0, "peak": 1536.0}
    assert with_peak({"decode": 1.0, "peak_bytes": None}, "1.6G") == {"decode": 1.0, "peak": 1638.4}
    assert with_peak({"decode": 1.0}, "845M") == {"decode": 1.0, "peak": 845.0}


@pytest.mark.skipif(_memcap_missing() is not None, reason=_memcap_missing() or "")
def test_a_run_under_memcap_reads_its_cgroups_peak_to_the_byte(tmp_path):
    """`_llamacpp.py` under the real memcap, with a stand-in for llama-bench that fills 64 MiB: the report's
    peak is the cgroup's count in bytes, within what memcap prints rounded up to a tenth of a GiB or a MiB."""
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\n"
                    f"{sys.executable} -c 'b = bytearray(64 << 20)'\n"
                    "echo '[{\"n_gen\": 16, \"avg_ts\": 5.0}]'\n")
    fake.chmod(0o755)
    run = subprocess.run([str(MEMCAP), "1G", "--", sys.executable, str(ROOT / "benchmarks" / "_llamacpp.py"), str(fake)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    peak = json.loads(run.stdout)["peak_bytes"]
    assert 64 << 20 < peak < 1 << 30, peak
    printed = re.search(r"peak (\S+),", run.stderr)[1]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from llamacpp import mib

    assert peak / 2**20 <= mib(printed) < peak / 2**20 + 102.4, (peak, printed)
