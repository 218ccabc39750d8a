"""AirLLM's `AutoModel.from_pretrained` parameters that shardstream names otherwise or does not have.

AirLLM 4.0 also takes compression, profiling_mode, layer_shards_saving_path, prefetching,
delete_original, max_seq_len, device and dtype: parameters of ours with the same meaning (the table
in docs/STREAMING.md). Code written for AirLLM then runs unchanged, or is told by name what to change.
"""

from __future__ import annotations

from ..errors import InvalidOption


def hub_token(token: str | None, hf_token: str | None) -> str | None:
    """`hf_token` is AirLLM's name for `token`."""
    if token is not None and hf_token is not None and token != hf_token:
        raise InvalidOption("token and hf_token (AirLLM's name for it) were both given and differ; give one of them.")
    return hf_token if token is None else token


def refuse_training_switches(install_hooks: bool, load_resident: bool) -> None:
    """AirLLM's two switches for its LoRA training; shardstream's AutoModel only runs the model."""
    if not install_hooks:
        raise InvalidOption("install_hooks=False (AirLLM's switch for LoRA training) is not supported: the hooks "
                            "are what stream the blocks; leave it out, and train with `shardstream train`.")
    if not load_resident:
        raise InvalidOption("load_resident=False (AirLLM's switch for LoRA training) is not supported: the weights "
                            "outside the blocks must be in memory to run the model; leave it out.")
