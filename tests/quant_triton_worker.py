"""The Triton kernel of stream/quant_triton.py run by Triton's interpreter on the CPU, for tests/test_quant_triton.py.

Started with TRITON_INTERPRET=1, which Triton reads when a kernel is defined: in a process of its own, so that
no other test's process gets an interpreted kernel. Reads a JSON list of cases on stdin, each
{"id", "method", "dtype" (stored), "x_dtype", "rows", "shape": [out_features, in_features, blocksize], "bias",
and optionally "lead" (x's leading dimensions, its last one strided) or "alone" (each row again by itself)};
prints one JSON object: id -> {"got", "want" (dequantize + F.linear in float32), "dtype", "shape", "alone"}.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch
import torch.nn.functional as F

from shardstream import quant
from shardstream.stream import quant_triton


def run(case: dict) -> dict:
    generator = torch.Generator().manual_seed(case["id"])
    out_features, in_features, blocksize = case["shape"]
    dtype, x_dtype = quant.DTYPES[case["dtype"]], quant.DTYPES[case["x_dtype"]]
    weight = quant.quantize((torch.randn(out_features, in_features, generator=generator) * 0.05).to(dtype),
                            case["method"], blocksize)
    dense = quant.dequantize(weight.data, weight.absmax, weight.meta).view(out_features, in_features)
    lead = case.get("lead", [case["rows"]])
    x = torch.randn(*lead, 2 * in_features, generator=generator).to(x_dtype)[..., ::2]   # last dimension strided
    if "lead" not in case:
        x = x.contiguous()
    bias = torch.randn(out_features, generator=generator).to(dtype) if case["bias"] else None
    got = quant_triton.linear(x, weight, bias)
    want = F.linear(x.float(), dense.float(), None if bias is None else bias.float())
    result = {"got": got.float().reshape(-1).tolist(), "want": want.reshape(-1).tolist(), "dtype": case["x_dtype"]
              if got.dtype == x_dtype else str(got.dtype), "shape": list(got.shape)}
    if case.get("alone"):
        rows = x.reshape(-1, in_features)
        alone = torch.cat([quant_triton.linear(rows[i:i + 1], weight, bias) for i in range(math.prod(lead))])
        result["alone"] = torch.equal(alone, got.reshape(alone.shape))
    return result


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    print(json.dumps({case["id"]: run(case) for case in json.load(sys.stdin)}))


if __name__ == "__main__":
    main()
