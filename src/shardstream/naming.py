"""Which store part each checkpoint tensor belongs to.

The store keeps one folder per part, `start` (embeddings), `mid/<i>` (transformer block i) and `end`
(final norm, LM head), so that a reader can load one block without touching the others. Known
families are read from one table (`FAMILIES`); other checkpoints fall back to a block-name pattern,
and as a last resort to one tensor per part.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace
from urllib.parse import quote, unquote

from shardstream.errors import CorruptShard, InvalidOption, UnsupportedModel

_KIND_ORDER = {"start": 0, "mid": 1, "end": 2, "tensor": 3}


@dataclass(frozen=True)
class Part:
    """One unit of the store that a reader can load alone; `path` is its folder in the store."""

    kind: str
    index: int | None = None
    tensor: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KIND_ORDER:
            raise InvalidOption(f"Part kind {self.kind!r} is unknown; use 'start', 'mid', 'end' or 'tensor'.")
        if self.kind == "mid":
            if type(self.index) is not int or self.index < 0:
                raise InvalidOption(f"Part 'mid' needs a block index >= 0, got {self.index!r}; pass index=<block number>.")
        elif self.index is not None:
            raise InvalidOption(f"Part {self.kind!r} takes no block index, got {self.index!r}; leave index unset.")
        if self.kind == "tensor":
            if not isinstance(self.tensor, str) or not self.tensor:
                raise InvalidOption(f"Part 'tensor' needs a tensor name, got {self.tensor!r}; pass tensor=<name>.")
        elif self.tensor is not None:
            raise InvalidOption(f"Part {self.kind!r} takes no tensor name, got {self.tensor!r}; leave tensor unset.")

    @property
    def path(self) -> str:
        """Folder of the part in the store; a tensor name is percent-encoded so it stays one folder
        below `tensor/` (checkpoint names are untrusted: "a/b" or ".." must not escape it)."""
        if self.kind == "mid":
            return f"mid/{self.index}"
        if self.kind == "tensor":
            encoded = quote(self.tensor, safe="")
            return "tensor/" + (encoded.replace(".", "%2E") if encoded in (".", "..") else encoded)
        return self.kind

    @classmethod
    def parse(cls, path: str) -> Part:
        """Read back a `path`; only the exact spelling `path` writes is accepted (no 'mid/03')."""
        kind, _, rest = path.partition("/")
        try:
            if kind == "mid":
                part = cls("mid", index=int(rest))
            elif kind == "tensor":
                part = cls("tensor", tensor=unquote(rest))
            else:
                part = cls(kind)
            canonical = part.path == path
        except ValueError:
            canonical = False
        if not canonical:
            raise InvalidOption(
                f"Store part path {path!r} is not valid; use 'start', 'mid/<block number>', 'end' or 'tensor/<name>'."
            )
        return part

    def sort_key(self) -> tuple:
        """Model order: start, blocks by number (mid/2 before mid/10), end, then loose tensors by name."""
        return (_KIND_ORDER[self.kind], self.index or 0, self.tensor or "")


START = Part("start")
END = Part("end")


def mid(i: int) -> Part:
    """The part of transformer block `i`."""
    return Part("mid", index=i)


@dataclass(frozen=True)
class Route:
    """Where one tensor goes; `expert` is set for per-expert MoE names so experts can be placed apart."""

    part: Part
    expert: int | None = None


@dataclass(frozen=True)
class _Scheme:
    """How one family names its tensors, matched from the start of a name.

    `block` captures the block index in group 1; `start` matches the names that come before the
    first block; every other name is after the last block (end). `heads` and `embeddings` list the
    spellings of the LM head and the input embedding (the first one present in a checkpoint wins).
    """

    block: re.Pattern[str]
    start: re.Pattern[str]
    embeddings: tuple[str, ...]
    heads: tuple[str, ...] = ("lm_head.weight",)
    ties_by_default: bool = False


def _scheme(block: str, start: str, embeddings: tuple[str, ...], **options) -> _Scheme:
    return _Scheme(re.compile(block), re.compile(start), embeddings, **options)


_HF_DECODER = _scheme(r"model\.layers\.(\d+)\.", r"model\.embed_tokens\.", ("model.embed_tokens.weight",))
_HF_DECODER_TIED = replace(_HF_DECODER, ties_by_default=True)

# config.json model_type -> naming scheme. `ties_by_default` is the family's config default for
# tie_word_embeddings in transformers, used when config.json leaves the key out.
FAMILIES: dict[str, _Scheme] = {
    "llama": _HF_DECODER,
    "qwen2": _HF_DECODER,
    "qwen3": _HF_DECODER,
    "mistral": _HF_DECODER,
    "phi3": _HF_DECODER,
    "mixtral": _HF_DECODER,
    "qwen2_moe": _HF_DECODER,
    "qwen3_moe": _HF_DECODER,
    "gemma": _HF_DECODER_TIED,
    "gemma2": _HF_DECODER_TIED,
    "gemma3_text": _HF_DECODER_TIED,
    # Hub GPT-2 checkpoints name tensors without the "transformer." prefix ("h.0.attn...", "wte.weight").
    "gpt2": _scheme(
        r"(?:transformer\.)?h\.(\d+)\.",
        r"(?:transformer\.)?(?:wte|wpe)\.",
        ("transformer.wte.weight", "wte.weight"),
        ties_by_default=True,
    ),
    # Pythia checkpoints on the Hub call the head "embed_out.weight".
    "gpt_neox": _scheme(
        r"gpt_neox\.layers\.(\d+)\.",
        r"gpt_neox\.embed_in\.",
        ("gpt_neox.embed_in.weight",),
        heads=("lm_head.weight", "embed_out.weight"),
    ),
    "falcon": _scheme(
        r"transformer\.h\.(\d+)\.",
        r"transformer\.word_embeddings\.",
        ("transformer.word_embeddings.weight",),
        ties_by_default=True,
    ),
}

# Per-expert MoE names inside a block: Mixtral "block_sparse_moe.experts.3.w1.weight", Qwen-MoE
# "mlp.experts.3.gate_proj.weight". Fused 3-D expert tensors ("mlp.experts.gate_up_proj") carry no id.
_EXPERT = re.compile(r"\.experts\.(\d+)\.")

# Fallback for unknown families: the outermost "<prefix>.layers.<N>." style container.
_BLOCK_CONTAINER = re.compile(r"((?:[^.]+\.)*?(?:layers|layer|h|blocks|block)\.)\d+\.")
_EMBEDDING_LIKE = re.compile(
    r"(?:[^.]+\.)*?(?!embed_out(?:\.|$))(?:embed|wte|wpe|tok|word_emb|pos_emb|position_emb)[^.]*(?:\.|$)"
)
_WORD_EMBEDDING = re.compile(r"(?:.*\.)?(?:embed_tokens|wte|word_embeddings|tok_embeddings|embed_in)\.weight")

LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def _first_present(candidates: tuple[str, ...], names: set[str]) -> str:
    return next((name for name in candidates if name in names), candidates[0])


class TensorRouter:
    """Routes the tensor names of one checkpoint to store parts; build it with `router_for`."""

    def __init__(self, family: str, num_layers: int, scheme: _Scheme | None, ties: bool, tensor_names: list[str]):
        self.family = family
        self.num_layers = num_layers
        self._scheme = scheme
        self._ties = ties
        self._names = set(tensor_names)
        self._parts = sorted({self.route(name).part for name in tensor_names}, key=Part.sort_key)

    def route(self, name: str) -> Route:
        """Part (and MoE expert id) of one tensor; raises CorruptShard for a block the config lacks."""
        if self._scheme is None:
            return Route(Part("tensor", tensor=name))
        block = self._scheme.block.match(name)
        if block is None:
            return Route(START if self._scheme.start.match(name) else END)
        index = int(block[1])
        if index >= self.num_layers:
            raise CorruptShard(
                f"Tensor {name!r} belongs to block {index} but config.json gives {self.num_layers} layers; "
                "use the config.json that came with this checkpoint."
            )
        expert = _EXPERT.search(name)
        return Route(mid(index), int(expert[1]) if expert else None)

    def tied_head(self) -> tuple[str, str] | None:
        """(head, embedding) names when the config ties them, so the converter stores the tensor once."""
        if not self._ties or self._scheme is None or not self._scheme.embeddings:
            return None
        return _first_present(self._scheme.heads, self._names), _first_present(self._scheme.embeddings, self._names)

    def embedding(self) -> str | None:
        """The input embedding's tensor name, when the family or pattern knows it and the checkpoint has it."""
        embeddings = self._scheme.embeddings if self._scheme is not None else ()
        return next((name for name in embeddings if name in self._names), None)

    def blocks(self) -> set[int]:
        """The numbers of the blocks the checkpoint's tensors fill."""
        return {part.index for part in self._parts if part.kind == "mid"}

    def parts(self) -> list[Part]:
        """Every part the checkpoint's tensors fill, in model order."""
        return list(self._parts)


def _pattern_scheme(names: list[str]) -> _Scheme | None:
    """Guess a scheme from the most common block container, or None when the names have no blocks."""
    containers = Counter(found[1] for name in names if (found := _BLOCK_CONTAINER.match(name)))
    if not containers:
        return None
    container = containers.most_common(1)[0][0]
    block = re.compile(re.escape(container) + r"(\d+)\.")
    embeddings = tuple(name for name in names if _WORD_EMBEDDING.fullmatch(name) and not block.match(name))
    # No family default is known: a checkpoint without its head tensor can only work tied.
    return _Scheme(block, _EMBEDDING_LIKE, embeddings, ties_by_default="lm_head.weight" not in names)


def _num_layers(config: dict, indices: set[int]) -> int:
    for key in LAYER_COUNT_KEYS:
        if key in config:
            value = config[key]
            if type(value) is not int or value < 0:
                raise UnsupportedModel(f"config.json {key} must be a non-negative integer, got {value!r}; fix config.json.")
            return value
    return max(indices) + 1 if indices else 0


def router_for(config: dict, tensor_names: Iterable[str]) -> TensorRouter:
    """Router for a checkpoint from its config.json (as a dict) and all its tensor names."""
    names = list(tensor_names)
    model_type = config.get("model_type")
    scheme = FAMILIES.get(model_type)
    family = model_type if scheme is not None else "pattern"
    if scheme is None:
        scheme = _pattern_scheme(names)
    if scheme is None:
        warnings.warn(
            f"No transformer blocks found in the tensor names of model_type {model_type!r}; "
            "storing one tensor per part, so streaming cannot load the model block by block.",
            stacklevel=2,
        )
        return TensorRouter("per-tensor", 0, None, False, names)
    indices = {int(found[1]) for name in names if (found := scheme.block.match(name))}
    num_layers = _num_layers(config, indices)
    if names and num_layers and not indices:
        raise UnsupportedModel(
            f"config.json model_type {model_type!r} expects block tensors matching {scheme.block.pattern!r} "
            "but no tensor name matches; check that config.json belongs to this checkpoint."
        )
    ties = bool(config.get("tie_word_embeddings", scheme.ties_by_default))
    return TensorRouter(family, num_layers, scheme, ties, names)
