"""The on-disk layer store: layout, manifest, checksums, atomic writes, reading and verifying."""

from .manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, load_manifest
from .opening import open_store
from .reader import Store
from .verify import Problem, verify_sharding, verify_store
from .writer import StoreWriter, part_file

__all__ = [
    "FORMAT_VERSION", "MANIFEST_NAME", "Manifest", "Problem", "Store", "StoreWriter",
    "load_manifest", "open_store", "part_file", "verify_sharding", "verify_store",
]
