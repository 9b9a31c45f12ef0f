"""Who registered each namespace, and the limits on namespaces: the size of a description, the
namespaces one uid's connections hold registered, and the namespaces the store knows in all. Why:
each namespace costs the server memory, a storage index number and a line of stats; without a
bound one client could register them until none is left for anyone else.

A namespace is held by the owners (client connections) that registered it; an owner's go when
it does (`drop_owner`). One that no owner holds is the store's to forget once it has no entry in
DRAM (`lookup.Lookups`); its files stay on storage.
Primitives: `NamespaceLimits`, `NamespaceLimit` (the error, naming the limit and the key to
raise), `check`, `check_size`, `refuse_total`, `add`, `drop_owner`, `held`, `refused`. Not
thread-safe: the store calls it under its lock. A store built without limits has none; the server sets them from
HPKV_SERVER_MAX_NAMESPACE_BYTES, HPKV_SERVER_MAX_NAMESPACES_PER_UID and HPKV_SERVER_MAX_NAMESPACES.
Must not know: the tiers, the protocol.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..errors import HpkvError


@dataclass(frozen=True)
class NamespaceLimits:
    max_desc_bytes: int | None = None  # None: no limit
    max_per_uid: int | None = None
    max_total: int | None = None


class NamespaceLimit(HpkvError):
    """A Register past a limit on namespaces; the message names the limit and its key."""


class NamespaceOwners:
    def __init__(self, limits: NamespaceLimits | None = None) -> None:
        self.limits = limits if limits is not None else NamespaceLimits()
        self._owners: dict[str, set[int]] = {}  # ns -> the owners that registered it
        self._of_owner: dict[int, set[str]] = {}
        self._uid_of: dict[int, int | None] = {}
        self._per_uid: dict[int, Counter[str]] = {}  # uid -> ns -> its owners that hold it
        self.refused = 0

    def check(self, ns: str, desc_bytes: int, owner: int, uid: int | None) -> None:
        """NamespaceLimit where `owner` (of `uid`; None: in process) may not register `ns`: a
        description too large, or a new namespace past its uid's share."""
        limits = self.limits
        self.check_size(desc_bytes)
        held = self._per_uid.get(uid) if uid is not None else None
        if limits.max_per_uid is not None and held is not None and ns not in held and len(held) >= limits.max_per_uid:
            self._refuse(
                f"uid {uid} holds {len(held)} namespaces registered, the most "
                f"HPKV_SERVER_MAX_NAMESPACES_PER_UID={limits.max_per_uid} allows; close engines (or clients) "
                "of that user, or raise the limit in the server's environment or config file"
            )

    def check_size(self, desc_bytes: int) -> None:
        """NamespaceLimit where a description of `desc_bytes` is too large (checked before it is parsed too)."""
        limit = self.limits.max_desc_bytes
        if limit is not None and desc_bytes > limit:
            self._refuse(
                f"a namespace description of {desc_bytes} bytes is larger than "
                f"HPKV_SERVER_MAX_NAMESPACE_BYTES={limit}; raise it in the server's environment or config "
                "file if a model's description (its quantization config, overrides) is that large"
            )

    def refuse_total(self, known: int) -> None:
        """NamespaceLimit: the store knows `known` namespaces, the most it may."""
        self._refuse(
            f"the server holds {known} namespaces, the most HPKV_SERVER_MAX_NAMESPACES={self.limits.max_total} "
            "allows (registered by engines running now, or still with entries in the DRAM pool); stop "
            "engines of models no longer served, or raise the limit in the server's environment or config file"
        )

    def add(self, ns: str, owner: int, uid: int | None) -> None:
        owned = self._of_owner.setdefault(owner, set())
        if ns in owned:
            return
        owned.add(ns)
        self._owners.setdefault(ns, set()).add(owner)
        self._uid_of[owner] = uid
        if uid is not None:
            self._per_uid.setdefault(uid, Counter())[ns] += 1

    def drop_owner(self, owner: int) -> list[str]:
        """`owner` is gone: the namespaces no owner holds now."""
        uid = self._uid_of.pop(owner, None)
        unheld = []
        for ns in self._of_owner.pop(owner, ()):
            owners = self._owners[ns]
            owners.discard(owner)
            if not owners:
                del self._owners[ns]
                unheld.append(ns)
            if uid is not None:
                held = self._per_uid[uid]
                held[ns] -= 1
                if not held[ns]:
                    del held[ns]
                if not held:
                    del self._per_uid[uid]
        return unheld

    def held(self, ns: str) -> bool:
        return ns in self._owners

    def _refuse(self, message: str) -> None:
        self.refused += 1
        raise NamespaceLimit(message)
