"""The native kernels' own threads for a decode step's products (stream/work_pool.h): used where OpenMP's threads
sleep, the same bits as torch's OpenMP split in every kernel, from one caller or several at once, and left alone
where OpenMP's threads spin or the user turns them off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from shardstream import native, openmp, quant
from shardstream.stream import half_linear, int4_linear, quant_linear

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("environ, torch_loaded, spin", [
    ({}, False, False),                                   # shardstream sets PASSIVE before torch loads
    ({}, True, True),                                     # torch loaded libgomp first: its default spins
    ({"OMP_WAIT_POLICY": "passive"}, True, False),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, False, True),
    ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "20000"}, False, True),   # libgomp obeys the count
    ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}, False, False),
])
def test_openmp_spins_as_libgomp_reads_its_settings(environ, torch_loaded, spin):
    assert openmp.spins(environ, torch_loaded) is spin


def _probe(code: str, env: dict[str, str] | None = None) -> dict:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "SHARDSTREAM_WORK_POOL")}
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})})
    assert ran.returncode == 0, ran.stderr
    return json.loads(ran.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("first, env, used", [
    ("shardstream", {}, True),
    ("torch", {}, False),
    ("shardstream", {"OMP_WAIT_POLICY": "ACTIVE"}, False),
    ("shardstream", {"GOMP_SPINCOUNT": "20000"}, False),
    ("shardstream", {"SHARDSTREAM_WORK_POOL": "0"}, False),
])
def test_the_pool_is_used_only_where_openmp_threads_sleep(first, env, used):
    got = _probe(f"import json, {first}, shardstream, shardstream.native as n; print(json.dumps(n.use_work_pool()))",
                 env)
    assert got is used


def test_the_pool_runs_products_on_a_thread_of_its_own():
    """With two threads, the first product through the pool starts one worker (the caller is the other)."""
    got = _probe(
        "import json, os, shardstream, torch\n"
        "from shardstream.stream import half_linear\n"
        "torch.set_num_threads(2)\n"
        "library, w, x = half_linear._library(), torch.randn(512, 256).bfloat16(), torch.randn(1, 256)\n"
        "threads = lambda: len(os.listdir('/proc/self/task'))\n"
        "library.work_pool_use(0); half_linear.linear(x, w, None); before = threads()\n"
        "library.work_pool_use(1); half_linear.linear(x, w, None); half_linear.linear(x, w, None)\n"
        "print(json.dumps([before, threads()]))")
    assert got[1] == got[0] + 1, got


def _products() -> dict[str, callable]:
    """Each kernel entry a decode step takes, on weights with odd widths, as a function of x (4 x 200)."""
    generator = torch.Generator().manual_seed(0)
    dense = [torch.randn(336, 200, generator=generator).bfloat16() for _ in range(3)]
    int4 = [quant.quantize(w, "int4") for w in dense]
    nf4 = quant.quantize(dense[0], "4bit", 64)
    found = {}
    for rows in (1, 2, 3, 4):
        found[f"half {rows}"] = lambda x, r=rows: half_linear.linear(x[:r], dense[0], None)
        found[f"int4 {rows}"] = lambda x, r=rows: int4_linear.linear(x[:r], int4[0], None)
        found[f"nf4 {rows}"] = lambda x, r=rows: quant_linear.linear(x[:r], nf4, None)
    found["half rows"] = lambda x: half_linear.rows(x[:3], dense)
    found["int4 rows"] = lambda x: int4_linear.rows(x[:3], int4)
    return found


@pytest.fixture
def pool_switch():
    libraries = [library for library in (half_linear._library(), int4_linear._library(), quant_linear._library())
                 if library is not None]
    if len(libraries) < 3:
        pytest.skip("the native kernels do not build here")

    def use(on: bool) -> None:
        for library in libraries:
            library.work_pool_use(int(on))

    yield use
    use(native.use_work_pool())


def test_the_pool_gives_the_bits_of_openmp_in_every_kernel(pool_switch):
    x = torch.randn(4, 200, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for name, product in _products().items():
            pool_switch(False)
            expected = product(x)
            pool_switch(True)
            for _ in range(20):   # a worker awake, asleep or waking: any share of the chunks
                assert torch.equal(product(x), expected), name
    finally:
        torch.set_num_threads(threads)


def test_callers_on_several_threads_at_once_get_their_own_bits(pool_switch):
    """One caller holds the pool; another thread's product runs through torch's split meanwhile."""
    x = torch.randn(4, 200, generator=torch.Generator().manual_seed(2))
    products = _products()
    pool_switch(False)
    expected = {name: product(x) for name, product in products.items()}
    pool_switch(True)
    wrong: list[str] = []

    def run() -> None:
        for _ in range(30):
            wrong.extend(name for name, product in products.items() if not torch.equal(product(x), expected[name]))

    callers = [threading.Thread(target=run) for _ in range(3)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert wrong == []
