"""llm_sepweight interop: dump a state dict with a decider, and import such a folder as a store.

The sepweight contract: `decider(key)` returns a path such as ["start", "wte.weight"] or
["mid", "0", "attn.q.weight"]; each key becomes `<out>/<path...>.pth`, and several calls into the
same folder combine. Importing turns that folder into a checksummed store with the same parts.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Callable, Mapping

import torch

from .errors import InvalidOption, StoreIncomplete
from .store import Manifest, StoreWriter
from .atomic import write_bytes_atomic
from .store.manifest import check_relative

SECTIONS = ("start", "mid", "end")
Decider = Callable[[str], list[str]]
Renamer = Callable[[str, str], str]


def dump_to_directory(decider: Decider, state_dict: Mapping[str, torch.Tensor], out_path: str | Path) -> None:
    """Write each tensor to `out_path/<decider(key)...>.pth` (atomically; existing files are replaced)."""
    out = Path(out_path)
    for key, tensor in state_dict.items():
        goal = decider(key)
        _check_goal(key, goal)
        buffer = io.BytesIO()
        torch.save(tensor.detach().cpu().contiguous(), buffer)
        write_bytes_atomic(out.joinpath(*goal[:-1]) / f"{goal[-1]}.pth", buffer.getvalue())


def _check_goal(key: str, goal: object) -> None:
    if not isinstance(goal, (list, tuple)) or len(goal) < 2 or goal[0] not in SECTIONS:
        raise InvalidOption(
            f"the decider returned {goal!r} for {key!r}; it must return a list starting with "
            "'start', 'mid' or 'end' and ending with a file name."
        )
    if goal[0] == "mid" and (len(goal) < 3 or not str(goal[1]).isdigit()):
        raise InvalidOption(f"the decider returned {goal!r} for {key!r}; a 'mid' path needs the layer number second.")
    check_relative("/".join(str(p) for p in goal), f"the decider's path for {key!r}")


def default_name(part: str, stem: str) -> str:
    """sepweight keeps only the stem; prefixing the part keeps names unique across layers."""
    return f"{part.replace('/', '.')}.{stem}"


def import_directory(sep_dir: str | Path, out: str | Path, *, config: dict | None = None,
                     rename: Renamer = default_name, compression: str | None = None) -> Path:
    """Turn a sepweight folder into a store at `out` (one part per start, mid/<i>, end folder).

    `rename(part, stem)` gives each tensor its store name; pass one that restores the model's own
    names (e.g. `lambda part, stem: f"transformer.h.{part[4:]}.{stem}"`) to stream the result.
    """
    sep_dir, out = Path(sep_dir), Path(out)
    parts = _sepweight_parts(sep_dir)
    if config is None and (sep_dir / "config.json").exists():
        config = json.loads((sep_dir / "config.json").read_text())
    manifest = Manifest(source=str(sep_dir), config=config or {}, family="sepweight",
                        compression=compression, expected_parts=list(parts))
    writer = StoreWriter.open(out, manifest)
    writer.begin()
    for part, folder in parts.items():
        if part in writer.manifest.parts:
            continue
        tensors = {rename(part, f.stem): torch.load(f, map_location="cpu", weights_only=True)
                   for f in sorted(folder.glob("*.pth"))}
        writer.write(part, tensors, {}, piece=None, complete=True)
    if config is not None:
        write_bytes_atomic(out / "config.json", json.dumps(config, indent=2).encode())
    writer.finish()
    return out


def _sepweight_parts(sep_dir: Path) -> dict[str, Path]:
    if not (sep_dir / "mid").is_dir() and not (sep_dir / "start").is_dir():
        raise StoreIncomplete(f"{sep_dir} has no start/ or mid/ folder; it is not a sepweight directory.")
    layers = sorted((int(p.name), p) for p in (sep_dir / "mid").iterdir() if re.fullmatch(r"\d+", p.name)) \
        if (sep_dir / "mid").is_dir() else []
    parts = {}
    if (sep_dir / "start").is_dir():
        parts["start"] = sep_dir / "start"
    parts.update({f"mid/{i}": p for i, p in layers})
    if (sep_dir / "end").is_dir():
        parts["end"] = sep_dir / "end"
    return parts
