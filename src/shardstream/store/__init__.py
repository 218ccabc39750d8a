"""The on-disk layer store: layout, manifest, checksums, atomic writes, reading and verifying."""

from .manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, load_manifest
from .reader import Store, open_store
from .verify import Problem, verify_store
from .writer import StoreWriter, part_file

__all__ = [
    "FORMAT_VERSION", "MANIFEST_NAME", "Manifest", "Problem", "Store", "StoreWriter",
    "load_manifest", "open_store", "part_file", "verify_store",
]
