"""The user's entrance: `AutoModel.from_pretrained` (convert if needed, then open the streaming engine or a
tensor-parallel rank), the speculative draft, and the `generate` and `serve` commands for one process and
for a rank of `torchrun`. It stands above the engine (stream/), tensor parallelism (tp/) and serving/;
nothing below imports it."""
