"""The GPU beside an end-to-end run: its clocks, power, temperature, utilization and memory, and the
processes on it, every few seconds into the results folder (`logs/gpu-monitor.log`), so that a slow
window in one profile's tier can be told apart from another process on the card or a throttled clock
(a comparison is made within one run: what else ran on the GPU during it is part of its record).

The card's own management tool is asked (the first of nvidia-smi, hy-smi, rocm-smi on PATH, the tools
the run's memory check reads); without one the run records that it had no monitor. Each sample is a
time stamp and the tool's answers as it printed them; a query that fails or hangs is written as such
and the monitor goes on."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

from .. import proc
from ..errors import ForgeError
from .gpufit import SMI

INTERVAL_S = 5.0
QUERY_TIMEOUT_S = 10.0
# per tool (gpufit.SMI's, in its order), the queries of one sample
QUERIES = {
    "nvidia-smi": [["--query-gpu=index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,memory.used",
                    "--format=csv,noheader"],
                   ["--query-compute-apps=gpu_uuid,pid,process_name,used_memory", "--format=csv,noheader"]],
    "hy-smi": [["--showuse", "--showpower", "--showmemuse", "--showpids"]],
    "rocm-smi": [["--showuse", "--showpower", "--showmemuse", "--showclocks", "--showtemp", "--showpids"]],
}
# what a sample holds, per tool (the summary says it)
WHAT = {"nvidia-smi": "clocks, power, temperature, utilization, memory and the processes on the card",
        "hy-smi": "utilization, power, memory and the processes on the card",
        "rocm-smi": "utilization, power, memory, clocks, temperature and the processes on the card"}


class Monitor:
    """Samples the card into `path` (appended: a resumed folder keeps the earlier invocations' samples)
    from start() until stop()."""

    def __init__(self, path: Path, interval_s: float = INTERVAL_S):
        self.path, self.interval_s = path, interval_s
        self.tool = next((t for t, _ in SMI if shutil.which(t)), None)    # as the run's memory check finds it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples = 0

    def record(self) -> dict:
        """What the run's summary says of the monitor."""
        if self.tool is None:
            return {"tool": None, "why": "no nvidia-smi, hy-smi or rocm-smi on PATH: the GPU was not sampled"}
        return {"tool": self.tool, "what": WHAT[self.tool], "interval_s": self.interval_s,
                "log": f"logs/{self.path.name}", "samples": self.samples}

    def _sample(self) -> str:
        lines = [time.strftime("%Y-%m-%dT%H:%M:%S%z")]
        for args in QUERIES[self.tool]:
            try:
                r = proc.run([self.tool, *args], check=False, capture=True, timeout=QUERY_TIMEOUT_S,
                             what=f"{self.tool} (GPU monitor)")
                out = r.stdout.strip() or f"(no output; exit {r.returncode})"
            except ForgeError as e:         # it hung (cut at the timeout) or went from PATH
                out = f"(no answer in {QUERY_TIMEOUT_S:g} s)" if "timed out" in e.message else f"({e.message})"
            except OSError as e:
                out = f"({type(e).__name__}: {e})"
            lines.append("\n".join("  " + x for x in out.splitlines()))
        return "\n".join(lines) + "\n"

    def _loop(self) -> None:
        while True:
            text = self._sample()
            if self._stop.is_set():
                return                 # stopped while the tool answered: the run has ended
            try:
                with self.path.open("a") as f:
                    f.write(text)
                self.samples += 1
            except OSError:
                return                 # the folder went away: nothing more to record
            if self._stop.wait(self.interval_s):
                return

    def start(self) -> None:
        if self.tool is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(f"# {self.tool}, every {self.interval_s:g} s; queries: "
                    + " | ".join(" ".join(q) for q in QUERIES[self.tool]) + "\n")
        self._thread = threading.Thread(target=self._loop, name="gpu-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ends the sampling without waiting for a query in flight (the run's end is not held up by a tool
        that hangs: the thread writes nothing more and ends with the query)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
