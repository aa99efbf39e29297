"""Progress output. Everything goes to stderr so stdout stays parseable."""

import sys
import time
from contextlib import contextmanager


def info(msg: str) -> None:
    print(f"[forge] {msg}", file=sys.stderr, flush=True)


def warn(msg: str) -> None:
    print(f"[forge] warning: {msg}", file=sys.stderr, flush=True)


@contextmanager
def step(name: str):
    """Announce a stage, report its duration; re-raises failures after saying which stage failed."""
    t0 = time.monotonic()
    info(f"{name} ...")
    try:
        yield
    except BaseException:
        info(f"{name}: FAILED after {time.monotonic() - t0:.1f}s")
        raise
    info(f"{name}: done in {time.monotonic() - t0:.1f}s")


class Progress:
    """Byte/step progress on one line when stderr is a terminal, every ~10 % otherwise."""

    def __init__(self, label: str, total: int | None):
        self.label, self.total, self.done = label, total, 0
        self._last_pct = -10
        self._tty = sys.stderr.isatty()

    def update(self, n: int) -> None:
        self.done += n
        if not self.total:
            return
        pct = int(100 * self.done / self.total)
        if self._tty:
            print(f"\r[forge] {self.label}: {pct:3d}% ({self.done >> 20} / {self.total >> 20} MiB)",
                  end="", file=sys.stderr, flush=True)
        elif pct >= self._last_pct + 10:
            self._last_pct = pct
            info(f"{self.label}: {pct}%")

    def close(self) -> None:
        if self._tty and self.total:
            print(file=sys.stderr)


def pyplot():
    """matplotlib's pyplot on the file-only backend, or None (with a warning) where matplotlib is not
    installed: charts are optional, the tables and JSON beside them are the record."""
    try:
        # heavy and optional (the contest extra): the charts only
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # once the file-only backend is chosen
    except ImportError:
        warn("matplotlib is not installed; chart skipped (pip install matplotlib)")
        return None
    return plt
