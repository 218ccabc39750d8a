"""`make demo`: the main job on the embedded Shakespeare model, as a user would type it.

Copies the shipped checkpoint (sequential conversion deletes source shards), converts it one shard
at a time into a layer store, inspects and verifies the store, then streams generated text from it
layer by layer. Then it converts the shipped draft model and generates again with speculative
sampling: the draft proposes tokens, one pass over the streamed blocks checks them all (keeping
the target's distribution), and `--profile` reports how many tokens each pass over the weights
produced. Both sample (temperature 0.8): greedy decoding of a model this small soon repeats one
line. The stores are cached in the work dir; a second run reuses them.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "assets" / "demo-model"
DRAFT = ROOT / "assets" / "demo-draft"
SAMPLING = ("--temperature", "0.8", "--top-p", "0.95", "--seed", "0")


def shardstream(*args: str) -> None:
    print(f"\n$ shardstream {shlex.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "shardstream.cli", *args], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", type=Path, default=ROOT / "artifacts" / "demo")
    parser.add_argument("--prompt", default="ROMEO:\n")
    parser.add_argument("--max-new-tokens", type=int, default=120)
    args = parser.parse_args()
    work = args.workdir.resolve()
    store = work / "store"
    manifest = store / "manifest.json"
    if not manifest.exists() or not json.loads(manifest.read_text()).get("complete"):
        checkpoint = work / "checkpoint"
        if not manifest.exists():   # a fresh start; an interrupted one resumes from what is left
            shutil.rmtree(checkpoint, ignore_errors=True)
            shutil.copytree(MODEL, checkpoint)
        shardstream("convert", str(checkpoint), str(store), "--sequential", "--profile")
    shardstream("inspect", str(store))
    shardstream("verify", str(store))
    shardstream("generate", str(store), "--prompt", args.prompt,
                "--max-new-tokens", str(args.max_new_tokens), "--max-resident-memory", "0", *SAMPLING)
    draft = work / "draft-store"
    if not (draft / "manifest.json").exists() or not json.loads((draft / "manifest.json").read_text()).get("complete"):
        shardstream("convert", str(DRAFT), str(draft))
    shardstream("generate", str(store), "--prompt", args.prompt, "--max-new-tokens", str(args.max_new_tokens),
                "--max-resident-memory", "0", *SAMPLING, "--draft", str(draft), "--profile")


if __name__ == "__main__":
    try:
        main()
    except subprocess.CalledProcessError as exc:
        sys.exit(exc.returncode)
