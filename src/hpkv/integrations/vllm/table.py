"""The vLLM scheduler half's request table: the state both the step-building code (`scheduler.py`)
and the output-settling code (`outputs.py`) work on, owned here so neither reaches into the other.

Owns: the requests tracked (`RequestState` by request id), the step sequence number, the loads in
flight (by step: the request, the leases it loaded under, the blocks loaded) until that step's
output is back, and the pending saves (`PendingSaves`: the saves held until their steps' outputs
say no load they rest on failed).
Primitives: `get`, `state_of(request)`, `pop`, `states`, `begin_step(has_loads)` -> (seq, hold),
`loading(seq, loads)`, `loads_done(up_to_seq)`.
Must not know: the server (the callers release what a request holds), vLLM's objects beyond the
request a state wraps.
"""

from __future__ import annotations

from collections.abc import Iterable

from .pending import PendingSaves
from .requests import RequestState

# (request, the leases of its load, the blocks it loaded into)
InFlight = tuple[str, dict, list[int]]


class RequestTable:
    def __init__(self) -> None:
        self.reqs: dict[str, RequestState] = {}
        self.seq = 0  # steps built
        self.pending = PendingSaves()
        self._loading: dict[int, list[InFlight]] = {}  # step -> its loads, until its output is back

    def get(self, req_id: str) -> RequestState | None:
        return self.reqs.get(req_id)

    def state_of(self, request) -> RequestState:
        """The state of `request`, tracked from now on if it was not."""
        state = self.reqs.get(request.request_id)
        if state is None:
            state = self.reqs[request.request_id] = RequestState(request)
        return state

    def pop(self, req_id: str) -> RequestState | None:
        return self.reqs.pop(req_id, None)

    def states(self) -> list[RequestState]:
        return list(self.reqs.values())

    def begin_step(self, has_loads: bool) -> tuple[int, str]:
        """A new step is built: its sequence number, and the hold its saves are reserved in ("": none)."""
        self.seq += 1
        return self.seq, self.pending.begin_step(self.seq, has_loads)

    def loading(self, seq: int, loads: Iterable[tuple[str, list[int]]]) -> None:
        """Step `seq` loads these (request, blocks): their leases stay taken until its output is back."""
        inflight = [(req_id, self.reqs[req_id].leases, blocks) for req_id, blocks in loads if req_id in self.reqs]
        if inflight:
            self._loading[seq] = inflight

    def loads_done(self, up_to_seq: int) -> list[RequestState]:
        """The output of every step up to `up_to_seq` is back: the requests whose leases were only
        needed for those steps' loads (not a lease taken since)."""
        done = []
        for seq in [seq for seq in self._loading if seq <= up_to_seq]:
            for req_id, leases, _ in self._loading.pop(seq):
                state = self.reqs.get(req_id)
                if state is not None and state.leases is leases:
                    done.append(state)
        return done
