"""The tiered store (`TieredStore`, in `tiered.py`) and its parts, one concept per module:
`lookup.py`, `leases.py`, `reservations.py`, `writethrough.py`."""

from ..pool.lru import PrefixOrder
from .leases import Lease
from .reservations import HOLD_QUARANTINE_S
from .tiered import StorePolicy, TieredStore, create_store
from .writethrough import BACKLOG_LIMIT_SHARE, write_threads

__all__ = [
    "BACKLOG_LIMIT_SHARE",
    "HOLD_QUARANTINE_S",
    "Lease",
    "PrefixOrder",
    "StorePolicy",
    "TieredStore",
    "create_store",
    "write_threads",
]
