"""The vocabulary shared by the server and the engines: tiers, lookup results, hold deadlines.

Owns: `Tier`, `Lookup`, `HOLD_TIMEOUT_S`. Engine processes import this module, never the store
or the storage tier, so it must not import anything server-side (a test checks the imports).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# A hold (`reserve(..., hold=)`) nobody settles within this long is aborted: its slots are not
# pinned for ever by a settler that died or forgot it.
HOLD_TIMEOUT_S = 60.0


class Tier(enum.IntEnum):
    DRAM = 1
    STORAGE = 2


@dataclass(frozen=True)
class Lookup:
    tiers: tuple[Tier, ...]  # the tier of each leading hit key

    @property
    def num_hit(self) -> int:
        return len(self.tiers)

    @property
    def num_dram(self) -> int:
        return self.tiers.count(Tier.DRAM)

    @property
    def num_storage(self) -> int:
        return self.tiers.count(Tier.STORAGE)
