"""The namespaces behind stored blocks: fingerprint -> the fields an invalidation names.

A page carries its namespace's fingerprint, tenant and model, not its revision or adapter (a
hash cannot be read back). To evict by revision, adapter or weights epoch the store keeps what
each fingerprint it wrote stands for, saved beside the pins (0600 JSON in the persistent tier's
directory) so blocks restored after a restart can still be matched. A restored block whose
fingerprint the file does not know matches only filters on tenant, model and fingerprint.

The records are bounded by what is stored: ``prune`` drops fingerprints no stored block has,
and runs whenever the table has doubled since the last prune (amortised over the writes).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvstore.keys import Namespace
from kvstore.store.pins import StateFile

log = logging.getLogger("kvstore.namespaces")

NAMESPACES_FILE = "namespaces.json"
MIN_PRUNE_RECORDS = 1024  # below this many records a prune is not worth a directory scan


@dataclass(frozen=True, slots=True)
class NamespaceRecord:
    """What an invalidation may name of one namespace."""

    tenant: str
    model_id: str
    revision: str
    adapter_id: str


class NamespaceRecords:
    """Fingerprint -> ``NamespaceRecord`` of every namespace the store wrote blocks in.

    Args:
        path: the file the records are saved to; None: kept as long as the store.
    """

    def __init__(self, path: Path | None = None) -> None:
        self._file = None if path is None else StateFile(path)
        self._records: dict[bytes, NamespaceRecord] = {}
        self._pruned_at = MIN_PRUNE_RECORDS
        self.dirty = False

    def __len__(self) -> int:
        return len(self._records)

    def note(self, ns: Namespace) -> None:
        """Blocks of ``ns`` are being written: remember what its fingerprint stands for."""
        if ns.fingerprint not in self._records:
            self._records[ns.fingerprint] = NamespaceRecord(ns.tenant, ns.model_id, ns.revision,
                                                            ns.adapter_id)
            self.dirty = True

    def needs_prune(self) -> bool:
        return len(self._records) >= 2 * self._pruned_at

    def prune(self, stored: Iterable[bytes]) -> None:
        """Keep only the fingerprints in ``stored`` (those some stored block has)."""
        keep = set(stored)
        self._records = {fp: rec for fp, rec in self._records.items() if fp in keep}
        self._pruned_at = max(MIN_PRUNE_RECORDS, len(self._records))
        self.dirty = True

    def matching(self, *, revision: str | None = None, adapter_id: str | None = None
                 ) -> set[bytes]:
        """Fingerprints whose namespace has ``revision`` and ``adapter_id`` (None: any)."""
        return {fp for fp, rec in self._records.items()
                if (revision is None or rec.revision == revision)
                and (adapter_id is None or rec.adapter_id == adapter_id)}

    async def save(self) -> None:
        self.dirty = False
        if self._file is None:
            return
        rows = [[fp.hex(), r.tenant, r.model_id, r.revision, r.adapter_id]
                for fp, r in self._records.items()]
        await self._file.write(json.dumps(rows).encode())

    async def load(self) -> None:
        """Take back the saved records (a file that cannot be read is logged and set aside)."""
        raw = None if self._file is None else await self._file.read()
        if raw is None:
            return
        try:
            rows = json.loads(raw)
            for fp, tenant, model_id, revision, adapter_id in rows:
                self._records[bytes.fromhex(fp)] = NamespaceRecord(
                    str(tenant), str(model_id), str(revision), str(adapter_id))
        except (OSError, ValueError, TypeError) as exc:
            log.warning("namespace records in %s not restored: %s", self._file.path, exc)
