"""
Stops, waits and failures across ranks. A signal reaches the ranks at different moments (StopFlag: they agree
on a safe point to stop at), a rank can wait on one that is stuck (Watchdog), and a rank that fails leaves the
others in a collective: the first to fail is claimed in the launcher's store and prints the one error line
(report_failure), the others a short line pointing to it; exit codes say which kind of failure it was.
"""
import contextlib
import os
import signal
import sys
import threading
import time

import torch.distributed as dist

import parallel


FAILED_RANK_KEY = "nanodapo/failed_rank"


def _launcher_store():
    """The key-value store of the process group (torchrun's, which outlives any one rank), or None."""
    if parallel.shared_store() is not None:  # asynchronous rollout: one store for both sides' ranks
        return parallel.shared_store()
    if not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_store()  # private, but the only handle on the group's store


def claim_failure(rank: int) -> int | None:
    """Record that `rank` stops on an error -> the rank that recorded one first (this one, unless another
    rank failed before); None without a process group."""
    store = _launcher_store()
    if store is None:
        return None
    try:
        return int(store.compare_set(FAILED_RANK_KEY, "", str(rank)))
    except (RuntimeError, ValueError):  # the store is gone (the launcher is exiting)
        return None


def failed_rank() -> int | None:
    """The rank that claimed a failure first, if any did."""
    store = _launcher_store()
    try:
        if store is not None and store.check([FAILED_RANK_KEY]):
            return int(store.get(FAILED_RANK_KEY))
    except (RuntimeError, ValueError):
        pass
    return None


def is_peer_failure(e: BaseException) -> bool:
    """Whether e is a collective or point-to-point call failing because another rank went away."""
    if isinstance(e, dist.DistError):
        return True
    closed = ("Connection closed by peer", "Connection reset by peer", "remote worker")
    return isinstance(e, RuntimeError) and any(s in str(e) for s in closed)


class StopRequested(Exception):
    """Every rank agreed to stop (a signal); raised where work can still be dropped."""


class StopFlag:
    """SIGTERM / SIGINT (preemption, Ctrl-C) on this rank: `requested` is set and polled where work can stop
    (train_dapo: a step not yet updating is dropped, one already updating finishes, then a checkpoint); every
    rank learns of it at the same points through agreed(). A second signal calls on_force_exit (the reward
    workers) and exits at once with 128 + the signal number."""

    def __init__(self, log, on_force_exit=lambda: None):
        self.requested, self.log, self.on_force_exit, self.previous = False, log, on_force_exit, {}
        self.signalled_at = None  # time.monotonic() of the first signal
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.handler) for s in (signal.SIGTERM, signal.SIGINT)}

    def handler(self, signum, frame):
        if self.requested:
            self.log("second signal: exiting now without a checkpoint")
            self.on_force_exit()
            os._exit(128 + signum)
        self.requested, self.signalled_at = True, time.monotonic()
        self.log(f"signal {signal.Signals(signum).name}: stopping at the next safe point, then writing a "
                 "checkpoint (send it again to exit now)")

    def signalled(self) -> bool:
        """Whether this rank got a signal (local: polled inside generation and scoring)."""
        return self.requested

    def agreed(self, dims) -> bool:
        """True on every rank once any rank was signalled
        (a collective: call it at the same point on all ranks)."""
        return parallel.all_reduce_max(int(self.requested), dims) > 0

    def seconds_since(self) -> float:
        """Seconds since this rank's signal (0 on a rank stopped by another's)."""
        if self.signalled_at is None:
            return 0.0
        return time.monotonic() - self.signalled_at

    def restore(self):
        for s, h in self.previous.items():
            signal.signal(s, h)


class WaitTimeout(RuntimeError):
    """A rank waited on another longer than the watchdog allows."""


class Watchdog:
    """For a rank that waits on another. Polled (recv_object's poll): a line every log_s naming whom it waits
    for and since when, WaitTimeout after timeout_s, and with `stop`, StopRequested once this rank got a stop
    signal. guarding(): the same lines and limit for a blocking call that cannot be polled (a collective),
    from a thread that ends the process at the limit."""

    def __init__(self, waited_for: str, log_s: float, timeout_s: float, log, stop: StopFlag | None = None):
        self.waited_for, self.log, self.stop = waited_for, log, stop
        self.log_s, self.timeout_s = log_s, timeout_s
        self.start, self.since = time.monotonic(), time.strftime("%H:%M:%S")
        self.next_line = log_s

    def __call__(self):
        if self.stop is not None and self.stop.signalled():
            raise StopRequested
        problem = self.check()
        if problem is not None:
            raise WaitTimeout(problem)

    def check(self) -> str | None:
        """Say the line when one is due -> what is wrong once past the limit, else None."""
        waited = time.monotonic() - self.start
        if waited > self.timeout_s:
            return (f"waited {waited:.0f} s for {self.waited_for} (since {self.since}), more than "
                    f"watchdog_timeout_s={self.timeout_s:g}: that rank is stuck or gone "
                    "(a stopped process, a hung reward function, a lost node; its own output may say which). "
                    "Raise watchdog_timeout_s if it is only slow")
        if waited >= self.next_line:
            self.log(f"waiting for {self.waited_for} since {self.since} ({waited:.0f} s; the run stops after "
                     f"watchdog_timeout_s={self.timeout_s:g})")
            self.next_line += self.log_s
        return None

    @contextlib.contextmanager
    def guarding(self, exit_code: int, on_timeout=lambda: None):
        """Around a blocking call: past the limit, report_failure, on_timeout(), os._exit(exit_code)."""
        done = threading.Event()

        def watch():
            while not done.wait(min(1.0, self.log_s)):
                problem = self.check()
                if problem is not None:  # the main thread is blocked in the call: end the process here
                    report_failure(WaitTimeout(problem))
                    on_timeout()
                    os._exit(exit_code)

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()


# exit codes of a rank that stops on an error: 2 bad input (config, data, model, checkpoint), 3 the run could
# not continue (a watchdog's timeout included)
EXIT_BAD_INPUT, EXIT_RUN_FAILED = 2, 3


def report_failure(e: Exception):
    """One clear line for the run's failure: the `error:` line on the rank that failed first, a short line
    naming it on the others (which fail after it, in a collective or with the same error)."""
    rank = parallel.torchrun_rank()
    if is_peer_failure(e):
        first = failed_rank()
    else:
        first = claim_failure(rank)
    if first is None and is_peer_failure(e):
        line = (f"rank {rank}: stopped because another rank exited (killed, or out of memory?); its output "
                "says why")
    elif first is None or first == rank:
        line = f"error: {e}"
    else:
        line = f"rank {rank}: stopped because rank {first} failed (its error is above)"
    sys.stderr.write(line + "\n")  # one write: print's separate newline let two ranks' lines run together
    sys.stderr.flush()
