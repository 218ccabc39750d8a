"""int4 against NF4 on the CPU: the kernels' read speed, a model's decode and prefill, and the accuracy of each.

Sections (`--sections`):
- kernel: one product of random weights of the Llama-3.2-1B shape's MLP (8192 x 2048) and head (128256 x 2048),
  NF4 (stream/quant_linear.cpp) and int4 (stream/int4_linear.cpp), alternating, `--rounds` rounds: the
  fastest call's milliseconds (on a shared machine a call that other processes interrupt is slower, and
  one that loses a thread waits for it at the end), and GB/s of codes and scales read; `--rows` more rows too.
  Each call reads weights from memory, not from cache: the MLP's products go round copies of it (COPY_BYTES).
- model: the Llama-3.2-1B shape (scripts/real_shapes.py, bf16, random weights) converted to a 4bit and an
  int4 store, each held in memory (every block resident), each round one process per store, alternating:
  decode tokens/s after a 32-token prompt, and prefill tokens/s of one `--prefill-tokens` pass.
- accuracy: per method, the relative error of the weights (Frobenius, over every quantized matrix) and of the
  logits of a 64-token prompt against the unquantized model (both computed in float32), and top-1 agreement:
  the 1B shape at 2 layers, and tests/tiny_models.py's llama.

Prints the CPU, its integer dot-product flags and the int4 kernel's build first, then markdown tables.
Run: `PYTHONPATH=src .venv/bin/python benchmarks/int4.py [--sections kernel,model,accuracy] [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _measure import cpu_model, markdown_table  # noqa: E402

METHODS = ("4bit", "int4")
SHAPE = "llama-3.2-1b"
KERNEL_SHAPES = {"MLP 8192 x 2048": (8192, 2048), "head 128256 x 2048": (128256, 2048)}
COPY_BYTES = 256 << 20   # weights a method goes round: several times any L3 cache


def machine() -> str:
    import torch

    from shardstream.stream import int4_linear

    flags = torch.cpu.get_capabilities()
    shown = ", ".join(name for name in ("avx2", "avx512_f", "avx512_bw", "avx512_vnni", "avx_vnni") if flags.get(name))
    return (f"CPU: {cpu_model()}, {torch.get_num_threads()} threads; flags: {shown}; torch capability "
            f"{torch.backends.cpu.get_cpu_capability()}; int4 kernel build: {int4_linear.build()}")


# -- kernel ---------------------------------------------------------------------------------------

def kernel(args) -> str:
    import torch

    from shardstream import quant
    from shardstream.stream import quant_linear

    rows_asked = [1, *args.rows]
    lines = []
    for label, (out_features, in_features) in KERNEL_SHAPES.items():
        weight = (torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
        packed = {method: quant.quantize(weight, method) for method in METHODS}
        del weight
        read = {method: sum(t.nbytes for t in quant.held_by(packed[method])) for method in METHODS}
        copies = {method: [packed[method]] + [quant.QuantizedTensor(*(t.clone() for t in quant.held_by(packed[method])),
                                                                     packed[method].meta)
                                              for _ in range(COPY_BYTES // read[method])] for method in METHODS}
        for rows in rows_asked if label.startswith("MLP") else [1]:
            x = torch.randn(rows, in_features)
            best = {method: float("inf") for method in METHODS}
            calls = max(5, int(2e8 // (out_features * in_features * rows)))
            for _ in range(args.rounds):
                for method in METHODS:
                    times = []
                    for call in range(calls):
                        weight = copies[method][call % len(copies[method])]
                        started = time.perf_counter()
                        quant_linear.linear(x, weight, None)
                        times.append(time.perf_counter() - started)
                    best[method] = min(best[method], *times)
            lines.append([label, str(rows), *(f"{best[m] * 1e3:.2f} ms, {read[m] / best[m] / 1e9:.1f} GB/s" for m in METHODS),
                          f"{best['4bit'] / best['int4']:.2f}x"])
    return markdown_table(["weight", "rows", "NF4 (quant_linear)", "int4 (int4_linear)", "int4 speed-up"], lines)


# -- model ----------------------------------------------------------------------------------------

def stores(args) -> dict[str, Path]:
    from real_shapes import write_checkpoint

    from shardstream.convert import convert

    work = Path(args.workdir)
    ckpt = write_checkpoint(SHAPE, work / "ckpt")
    found = {}
    for method in METHODS:
        found[method] = work / f"store-{method}"
        if not (found[method] / "manifest.json").exists():
            convert(ckpt, found[method], compression=method, progress=False)
    return found


def model_child(store: Path, prefill_tokens: int, new_tokens: int) -> dict:
    """Decode and prefill speed of one store held in memory, in this process."""
    import torch

    from shardstream import AutoModel

    vocab = 128256
    with AutoModel.from_pretrained(store, max_resident_memory=None) as model, torch.no_grad():
        assert model.resident_blocks == list(range(model.store.num_layers))
        model(torch.randint(3, vocab, (1, 8)))   # warm: kernels built, pages touched
        ids = torch.randint(3, vocab, (1, 32), generator=torch.Generator().manual_seed(0))
        out = model(ids, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        started = time.perf_counter()
        for _ in range(new_tokens):
            out = model(token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        decode = new_tokens / (time.perf_counter() - started)
        prompt = torch.randint(3, vocab, (1, prefill_tokens), generator=torch.Generator().manual_seed(1))
        started = time.perf_counter()
        model(prompt, use_cache=True, logits_to_keep=1)
        prefill = prefill_tokens / (time.perf_counter() - started)
    return {"decode": decode, "prefill": prefill}


def model_speed(args) -> str:
    paths = stores(args)
    runs: dict[str, list[dict]] = {method: [] for method in METHODS}
    for _ in range(args.rounds):
        for method in METHODS:
            command = [sys.executable, __file__, "--child", str(paths[method]), "--prefill-tokens",
                       str(args.prefill_tokens), "--new-tokens", str(args.new_tokens)]
            run = subprocess.run(command, capture_output=True, text=True, check=True)
            runs[method].append(json.loads(run.stdout.strip().splitlines()[-1]))
    lines = []
    for what in ("decode", "prefill"):
        values = {m: [r[what] for r in runs[m]] for m in METHODS}
        ratios = [i / n for n, i in zip(values["4bit"], values["int4"])]
        lines.append([f"{what} tok/s" + (f" ({args.prefill_tokens} tokens)" if what == "prefill" else ""),
                      *(" / ".join(f"{v:.1f}" for v in values[m]) for m in METHODS),
                      " / ".join(f"{r:.2f}x" for r in ratios)])
    return markdown_table(["per round", "NF4 store", "int4 store", "int4 / NF4"], lines)


# -- accuracy -------------------------------------------------------------------------------------

def accuracy(args) -> str:
    import torch
    from real_shapes import write_checkpoint
    from tiny_models import save_checkpoint

    work = Path(args.workdir)
    lines = []
    models = {f"{SHAPE}, 2 layers": (write_checkpoint(SHAPE, work / "ckpt-2layers", layers=2), 128256),
              "tiny llama (hidden 32)": (work / "tiny-llama", 128)}
    if not (work / "tiny-llama" / "config.json").exists():
        save_checkpoint("llama", work / "tiny-llama", dtype=torch.bfloat16)
    for label, (ckpt, vocab) in models.items():
        ids = torch.randint(3, vocab, (1, 64), generator=torch.Generator().manual_seed(0))
        reference = reference_logits(ckpt, ids)
        for method, kernel_on in (("4bit", True), ("int4", True), ("int4", False)):
            weight_error, logits = quantized_run(ckpt, work / f"{ckpt.name}-{method}", method, ids, kernel_on)
            logit_error = ((logits - reference).norm(dim=-1) / reference.norm(dim=-1)).mean().item()
            agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
            name = {"4bit": "NF4", "int4": "int4" if kernel_on else "int4 dequantized (x not rounded to int8)"}[method]
            lines.append([label, name, f"{weight_error:.4f}", f"{logit_error:.4f}", f"{agree:.3f}"])
    return markdown_table(["model", "method", "weights' relative error", "mean relative logit error",
                           "top-1 agreement"], lines)


def reference_logits(ckpt: Path, ids):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()(ids).logits[0]


def quantized_run(ckpt: Path, store: Path, method: str, ids, kernel_on: bool) -> tuple[float, "torch.Tensor"]:
    """The weights' relative error over every quantized matrix of the store, and its logits in float32 (an int4
    store's without its kernel where not `kernel_on`: dequantized weights, x as it is)."""
    import os

    import torch
    from safetensors import safe_open

    from shardstream.convert import convert
    from shardstream.store import open_store
    from shardstream import AutoModel
    from shardstream.stream import int4_linear
    from shardstream.switches import INT4_KERNEL

    if not (store / "manifest.json").exists():
        convert(ckpt, store, compression=method, progress=False)
    opened = open_store(store)
    error = total = 0.0
    for file in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(file), "pt") as original:
            for name in original.keys():
                record = opened.manifest.tensors.get(name)
                if record is None or not record.quant:
                    continue
                want = original.get_tensor(name).float()
                error += (opened.load_tensor(name).float() - want).square().sum().item()
                total += want.square().sum().item()
    os.environ[INT4_KERNEL.name] = "1" if kernel_on else "0"
    int4_linear._library.cache_clear()
    try:
        with AutoModel.from_pretrained(store, compute_dtype="float32", max_resident_memory=None) as model, torch.no_grad():
            logits = model(ids).logits[0].float()
    finally:
        del os.environ[INT4_KERNEL.name]
        int4_linear._library.cache_clear()
    return (error / total) ** 0.5, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="kernel,model,accuracy")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=lambda text: [int(r) for r in text.split(",") if r], default=[512],
                        help="more rows for the MLP's product besides 1 (comma-separated)")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--workdir", default="artifacts/bench-int4")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(model_child(Path(args.child), args.prefill_tokens, args.new_tokens)))
        return
    print(machine())
    print(f"date: {time.strftime('%Y-%m-%d')}; command: {' '.join(sys.argv)}\n")
    sections = {"kernel": kernel, "model": model_speed, "accuracy": accuracy}
    for name in args.sections.split(","):
        print(f"## {name}\n\n{sections[name](args)}\n", flush=True)


if __name__ == "__main__":
    main()
