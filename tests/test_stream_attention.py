"""The attention kernels a streamed pass on a CUDA GPU may use: never cuDNN's, whose per-shape plans are rebuilt
on every decode step (the keys grow by one). The switches are torch's own flags, so this runs on any build."""

import torch

from shardstream.stream.attention import attention_kernels


def _enabled() -> dict[str, bool]:
    cuda = torch.backends.cuda
    return {"cudnn": cuda.cudnn_sdp_enabled(), "flash": cuda.flash_sdp_enabled(),
            "efficient": cuda.mem_efficient_sdp_enabled(), "math": cuda.math_sdp_enabled()}


def test_a_cuda_pass_leaves_out_cudnn_attention_and_only_it():
    before = _enabled()
    with attention_kernels(torch.device("cuda")):
        assert _enabled() == {"cudnn": False, "flash": True, "efficient": True, "math": True}
    assert _enabled() == before


def test_a_cpu_pass_changes_nothing():
    before = _enabled()
    with attention_kernels(torch.device("cpu")):
        assert _enabled() == before
