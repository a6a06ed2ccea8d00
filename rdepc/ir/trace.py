"""The Chrome trace-event format both traces of a layer share — the scheduler's prediction
(``rdepc viz --trace``) and the measured profile (``rdepc.runtime.profile``) — so the two
open side by side in Perfetto with the same processes and threads."""

from __future__ import annotations


def rank_metadata(W: int, threads: list[tuple[int, str]]) -> list[dict]:
    """Trace metadata: one process per rank, in rank order, holding ``threads`` (tid, name)
    (shared by the predicted trace and the measured one, rdepc.runtime.profile)."""
    events: list[dict] = []
    for r in range(W):
        events.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for tid, name in threads:
            events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": name}})
    return events


__all__ = ["rank_metadata"]
