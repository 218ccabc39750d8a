"""One rank of the tensor-parallel tests, started by `python -m torch.distributed.run` (test_tp.py).

argv[1] is a JSON file of jobs: {"name", "stores": [one store per rank], "out": folder, and optionally
"compute_dtype" and "options" (more from_pretrained arguments)}. For each job this rank opens its store with
`AutoModel.from_pretrained(..., tensor_parallel=True)` and writes `<name>.<rank>.json` (bytes read at
opening and from the store's part files, bytes read per pass of the greedy generation, resident blocks,
the rank's store, sampled tokens, the logits' dtype and what experts on demand read, or the refusal's
message); rank 0 also writes
`<name>.pt` (logits and greedy tokens). One launch runs every job: starting ranks is most of a test's time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardstream.errors import ShardstreamError
from shardstream import AutoModel

IDS = torch.tensor([[1, 5, 9, 20, 33, 40, 7]])


def run(job: dict, rank: int) -> None:
    out = Path(job["out"])
    try:
        model = AutoModel.from_pretrained(job["stores"][rank], tensor_parallel=True, progress=False,
                                          compute_dtype=job.get("compute_dtype", "auto"), **job.get("options", {}))
    except ShardstreamError as error:
        (out / f"{job['name']}.{rank}.json").write_text(json.dumps({"refused": str(error)}))
        return
    opened = model.bytes_read
    logits = model(IDS).logits
    before = model.bytes_read
    tokens = model.generate(IDS, max_new_tokens=8, do_sample=False)
    passes = model.forward_passes
    per_pass = (model.bytes_read - before) / passes
    torch.manual_seed(rank)   # each rank its own random state: rank 0's must be used
    sampled = model.generate(IDS, max_new_tokens=8, do_sample=True, temperature=1.5)
    (out / f"{job['name']}.{rank}.json").write_text(json.dumps({
        "bytes_read": opened, "share_bytes_read": model.share_bytes_read, "per_pass": per_pass, "passes": passes,
        "resident_blocks": len(model.resident_blocks), "rank_store": str(model.rank_store.root),
        "sampled": sampled.tolist(), "dtype": str(logits.dtype),
        "experts": model.experts.report() if model.experts else None}))
    model.close()
    if rank == 0:
        torch.save({"logits": logits, "tokens": tokens}, out / f"{job['name']}.pt")


def main() -> None:
    dist.init_process_group("gloo")
    for job in json.loads(Path(sys.argv[1]).read_text()):
        run(job, dist.get_rank())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
