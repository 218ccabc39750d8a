"""The GPU checks' driver on a machine without a GPU: it must get as far as the benchmark, whose refusal is
one sentence, and the benchmark refuses a setting it does not know by name (what the GPU machine's
minutes are spent on is decided here, on the CPU)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_without_wheels_reaches_the_benchmark_which_asks_for_a_gpu(tmp_path):
    """A checkout with no .whl/ and no PYTHONPATH set stopped at once on `PYTHONPATH: unbound variable`."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    (checkout / "scripts" / "gpu_check.sh").write_bytes((ROOT / "scripts" / "gpu_check.sh").read_bytes())
    for folder in ("src", "tests", "benchmarks"):
        (checkout / folder).symlink_to(ROOT / folder)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')   # this venv's, as python3
    (bin_dir / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", OUT=str(tmp_path / "out"), GPU_CHECK_WORKDIR=str(tmp_path / "work"))
    run = subprocess.run(["bash", str(checkout / "scripts" / "gpu_check.sh"), "llama-3.2-1b"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert "unbound variable" not in run.stderr
    assert "benchmarks/stream_gpu.py needs a CUDA GPU, and torch sees none here" in run.stdout
    assert "needs a CUDA GPU" in (tmp_path / "out" / "llama-3.2-1b.md").read_text()


def test_the_gpu_benchmark_refuses_an_unknown_setting_by_name():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "stream_gpu.py"), "--modes", "stream,bnb-fp4"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 2
    assert "--modes: unknown setting 'bnb-fp4'; choose among stream," in run.stderr
    assert "Traceback" not in run.stderr
