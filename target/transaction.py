"""One management change as a transaction: a log of how to undo each step applied, saved once.

TargetService (target/service/) applies every change in memory step by step; each step records here
how to take it back. The change is then saved once (the gateway group's store, then the config file);
if the save refuses, or a later step fails, the whole log is run backwards, newest step first, so each
undo sees the state its own step left, and memory matches the saved file again. A single API call is a
transaction of one step; a replayed configuration (start-up, import, retry) and a reload are one
transaction of many. What hosts are told about the change (AENs, disconnects, closing storage) can
wait in ``after`` until the change is saved, so they never hear of a step that is then undone.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

Undo = Callable[[], Awaitable[None]]


def sync(fn: Callable[[], object]) -> Undo:
    """A plain call as an entry of an undo or notice log (whose entries are awaited)."""
    async def run() -> None:
        fn()
    return run


class Transaction:
    def __init__(self) -> None:
        self._undo: list[Undo] = []
        self._after: list[Undo] = []
        self.saved = False

    def undo(self, step: Undo) -> None:
        """Record how to take back a step just applied."""
        self._undo.append(step)

    def undo_sync(self, fn: Callable[[], object]) -> None:
        self._undo.append(sync(fn))

    def after(self, notice: Undo) -> None:
        """Something to do once the whole change is saved (announce())."""
        self._after.append(notice)

    def after_sync(self, fn: Callable[[], object]) -> None:
        self._after.append(sync(fn))

    async def roll_back(self) -> None:
        """Undo every step recorded, newest first; the notices waiting are dropped with them (once saved:
        nothing). An undo that raises stops nothing: the older steps are still taken back, then the first
        error is raised."""
        if self.saved:
            return
        self._after.clear()
        first: BaseException | None = None
        while self._undo:
            step = self._undo.pop()
            try:
                await step()
            except BaseException as exc:  # the older steps must still be undone
                first = first or exc
        if first is not None:
            raise first

    async def commit(self, save: Callable[[], Awaitable[None]]) -> None:
        """Save the change once; whatever ``save`` raises undoes every step first, then propagates.
        Saved, the undo log is dropped (the notices stay for announce())."""
        try:
            await save()
        except BaseException:
            await self.roll_back()
            raise
        self._undo.clear()
        self.saved = True

    async def announce(self) -> None:
        """Run the notices recorded with after(), oldest first (once saved)."""
        notices, self._after = self._after, []
        for notice in notices:
            await notice()
