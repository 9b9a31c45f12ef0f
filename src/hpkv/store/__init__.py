"""The tiered store (`TieredStore`, in `tiered.py`) and its parts, one concept per module:
`lookup.py`, `leases.py`, `reservations.py`, `writethrough.py`, `counters.py`, `policies.py`."""

from .leases import Lease
from .policies import BACKLOG_LIMIT_SHARE, PrefixOrder, StorePolicy
from .reservations import HOLD_QUARANTINE_S
from .tiered import TieredStore
from .writethrough import write_threads

__all__ = [
    "BACKLOG_LIMIT_SHARE",
    "HOLD_QUARANTINE_S",
    "Lease",
    "PrefixOrder",
    "StorePolicy",
    "TieredStore",
    "write_threads",
]
