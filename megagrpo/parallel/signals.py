"""Stopping on a signal: SIGTERM, SIGINT or SIGUSR1 (preemption, Ctrl-C, Slurm's warning
before the time limit) asks the run to stop at the next step boundary, write a checkpoint
and exit 0; ``--resume`` then continues exactly as if it had not stopped.

The handler only records the signal; the loop asks :meth:`StopSignals.agreed` once per step
boundary, a MAX all-reduce of the recorded signal over the world, so every rank stops after
the same step even when only some ranks were signalled. The current step is finished, not
abandoned (its generation has already advanced the samplers and RNGs); the grace period a
launcher gives must therefore cover one step plus one checkpoint. A second SIGINT raises
KeyboardInterrupt at once (no checkpoint); other repeats are ignored (torchrun forwards the
terminal's Ctrl-C as SIGTERM too). Handlers can only be installed on the main
thread; elsewhere (an embedding application's worker thread) nothing is installed.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

from megagrpo.parallel.comm import Comm

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopSignals:
    """Records SIGTERM / SIGINT / SIGUSR1 for the loop (see module docstring)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        """The first stop signal received (None: none yet)."""
        self.interrupts = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> StopSignals:
        """Handle the stop signals in this process (idempotent: calling it again re-asserts
        the handlers, e.g. after an engine replaced them)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in STOP_SIGNALS:
            previous = signal.signal(signum, self._handle)
            if signum not in self._previous:
                self._previous[signum] = previous
        return self

    def restore(self) -> None:
        """Put the handlers back as they were before :meth:`install`."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                raise KeyboardInterrupt("second interrupt: stopping without a checkpoint")
        if self.signum is None:
            log.warning(
                "caught %s: finishing the current step, then writing a checkpoint and "
                "exiting (Ctrl-C again to stop at once, without a checkpoint)",
                signal.Signals(signum).name,
            )
            self.signum = signum

    def adopt(self, signum: int, where: str = "an engine rank") -> None:
        """Stop as if this process had received ``signum`` (0: nothing), a stop signal that
        only another process received (``where``: an engine rank of placement separate)."""
        if signum and self.signum is None:
            log.warning(
                "%s caught %s: finishing the current step, then writing a checkpoint and exiting",
                where,
                signal.Signals(signum).name,
            )
            self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def agreed(self, comm: Comm) -> str | None:
        """Collective, once per step boundary on every rank: the name of the stop signal
        some rank received (the highest number when several), else None."""
        received = comm.max_over(float(self.signum or 0))
        return signal.Signals(int(received)).name if received > 0 else None
