"""What a call leaves on the device, read back on the host: its control words — at once
under the interpreter, natively once the copy queued behind the kernel has landed
(:class:`Readback`; ``rdepc.runtime.records`` reads them as exceptions) — and its
statistics (:func:`call_stats`, the module's ``last_stats``).

After each call ``last_stats`` (copied when read) holds ``rows_per_expert`` [E] (admitted),
``received_per_expert`` [E], ``dropped_per_expert`` [E], ``rows_per_owner`` [W],
``dropped_rows``, ``dropped_per_source`` [W] (route rows of each front-end's tokens the
capacity dropped), ``accepted`` [W, T', K] (bool: the accepted set), ``m_tiles`` [W] (m-tiles
the grouped GEMM ran per owner), ``capacity`` (cap_e at this T', None when dropless),
``dispatched_rows`` [W] (payload rows each front-end sent with their data: one per accepted
route row, under ``dedup`` one per (token, owner)), ``returned_rows`` [W] (rows each owner
sent back with their data) and ``launches`` (per-rank backends: the same for the rank's own
experts, ``[E_loc]``, and its own tokens, ``[T', K]``, ``dropped_per_source`` ``[1]``). The
module's ``last_context`` is the routing context the backward walks
(``rdepc.runtime.autograd.RoutingContext``): the accepted set, each accepted row's slot in
its owner's payload (-1 when dropped) and the combine weights g'."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rdepc.ir.contract import INT32_MAX, KernelContract
from rdepc.ir.interface import stats_columns


class Readback:
    """The control words of a module's native calls on their way to the host: a call never
    waits for the device; its words are read (handed to ``read``) when they have landed —
    at the next call, at ``synchronize()`` or when ``last_stats`` is read."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pending: list[tuple] = []  # (event or None when captured, words, ids, gates, backward)

    def capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def queue(self, words: torch.Tensor, ids, gates, backward: bool) -> None:
        """Queue the copy of a native call's ``words`` to pinned host memory behind the kernel."""
        if self.capturing():
            # Captured into a CUDA graph: its replays run no host code, so the words are read
            # where the user asks for them — synchronize() copies them then.
            self.pending.append((None, words, ids, gates, backward))
            return
        host = torch.empty(words.shape, dtype=words.dtype, pin_memory=True)
        host.copy_(words, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending.append((event, host, ids, gates, backward))

    def settle(self, wait: bool, read: Callable[[list[int], object, object, bool], None]) -> None:
        """``read`` the words of the calls that have landed (all, with ``wait``), oldest first;
        it raises the first error they recorded."""
        while self.pending and not self.capturing():  # nothing is read while a graph is captured
            event, host, ids, gates, backward = self.pending[0]
            if event is None:  # a captured call: only an explicit synchronize() reads its words
                if not wait:
                    return
                torch.cuda.current_stream(self.device).synchronize()
            elif not wait and not event.query():
                return
            else:
                event.synchronize()
            self.pending.pop(0)
            read(host.tolist(), ids, gates, backward)

    def clear(self) -> None:
        self.pending.clear()


def call_stats(
    p: KernelContract,
    stats: torch.Tensor,
    topk_ids: torch.Tensor,
    accepted: torch.Tensor,
    launches: int,
    own_experts: tuple[int, ...] | None = None,
) -> dict:
    """The call's statistics (``RDEPModule.last_stats``) from its ``stats`` buffer, the route
    rows it took (``topk_ids``) and accepted, and its launches; ``own_experts``: a per-rank
    module's experts, in local order (None: one process, every expert)."""
    st = stats.to("cpu", torch.long)
    at = stats_columns(p.E_MAX)
    owner = torch.tensor(p.owner, dtype=torch.long)
    local = torch.tensor(p.local, dtype=torch.long)
    if own_experts is not None:  # this rank's own experts, in local order
        mine = local[list(own_experts)]
        arrived, admitted = st[0, at["arrived"] + mine], st[0, at["admitted"] + mine]
    else:
        arrived = st[owner, at["arrived"] + local]
        admitted = st[owner, at["admitted"] + local]
    dropped = arrived - admitted
    ids = topk_ids.to("cpu")
    routed = (ids >= 0) & (ids < p.E)  # an id of -1 routes nowhere: no row to drop
    lost = (routed & ~accepted.to("cpu")).sum(dim=(-2, -1))  # per source rank (this rank's, per-rank)
    cap = int(st[:, at["cap"]].max())  # what the scans applied (every owner the same)
    cap = None if cap == INT32_MAX else cap
    return {
        "rows_per_expert": admitted,
        "received_per_expert": arrived,
        "dropped_per_expert": dropped,
        "rows_per_owner": st[:, at["admitted"] : at["admitted"] + p.E_MAX].sum(dim=1),
        "dropped_rows": int(dropped.sum()),
        "dropped_per_source": lost.reshape(-1),
        "accepted": accepted,
        "m_tiles": st[:, at["mtiles"]].clone(),
        "dispatched_rows": st[:, at["sent"]].clone(),
        "returned_rows": st[:, at["returned"]].clone(),
        "capacity": cap,
        "launches": launches,
    }


__all__ = ["Readback", "call_stats"]
