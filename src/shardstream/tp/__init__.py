"""Tensor-parallel execution over torch.distributed (started with `torchrun`): every rank reads only
its share of the store's weights and runs its share of every block (see docs/TENSOR_PARALLEL.md).

`TensorParallelModel` loads on first use, so the generate command imports this package without torch.
"""

__all__ = ["TensorParallelModel"]


def __getattr__(name: str):
    if name in __all__:
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module 'shardstream.tp' has no attribute {name!r}")
