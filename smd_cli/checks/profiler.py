"""Peak memory per phase of a training step (rollout, learner), on CUDA and on CPU; live tensor bytes.

CUDA: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats` at the start of the phase, i.e.
the tensors torch held at their peak (weights, optimizer state, activations, KV cache): the number that
SMD's memory claim is about.

CPU (Linux): the process's peak resident set during the phase. Writing "5" to `/proc/self/clear_refs`
resets the kernel's high-water mark (`VmHWM`), which is then read back from `/proc/self/status`; it counts
everything resident (Python, libraries, allocator caches), so it is an upper bound on the tensors, and
cheap (two small file operations). Where that reset is not possible (not Linux, or /proc read-only) a
per-phase number would be the lifetime peak in disguise, so the phase keys are left out and only
`memory/peak_rss_bytes` (the process's lifetime peak, `resource.getrusage`) is reported.

`live_tensor_peak` measures what the planner predicts, on any device: the peak of the bytes held by live
tensors above those held when the block started, from the allocation and free events that
`torch.profiler` records with `profile_memory=True` (CUDA: the caching allocator's own counters).
Slower than a plain run (every allocation is an event): for benchmarks and tests.
"""

from __future__ import annotations

import resource
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

_CLEAR_REFS, _STATUS = Path("/proc/self/clear_refs"), Path("/proc/self/status")


def _reset_rss_peak() -> bool:
    """Reset the process's VmHWM; False where the kernel interface is missing or read-only."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def _rss_peak_bytes() -> float:
    for line in _STATUS.read_text().splitlines():
        if line.startswith("VmHWM:"):
            return float(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"no VmHWM line in {_STATUS}")


def lifetime_peak_rss_bytes() -> float:
    """The process's peak resident set since it started (ru_maxrss is kB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak if sys.platform == "darwin" else peak * 1024)


class PhaseMemory:
    """Collects `memory/{phase}_peak_bytes` for the phases of one step: `with mem.phase("rollout"): ...`."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.metrics: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self.metrics[f"memory/{name}_peak_bytes"] = float(torch.cuda.max_memory_allocated(self.device))
            return
        resettable = _reset_rss_peak()
        yield
        if resettable:
            self.metrics[f"memory/{name}_peak_bytes"] = _rss_peak_bytes()
        else:
            self.metrics["memory/peak_rss_bytes"] = lifetime_peak_rss_bytes()

    def take(self) -> dict[str, float]:
        """This step's numbers, cleared for the next step."""
        out, self.metrics = self.metrics, {}
        return out


@dataclass
class LivePeak:
    """Bytes of live tensors above the start of a block: at its peak, and at its end."""

    peak: float = 0.0
    end: float = 0.0


@contextmanager
def live_tensor_peak(device: torch.device | str = "cpu"):
    """`with live_tensor_peak() as live: ...` then `live.peak`: the most tensor bytes alive at once during the
    block, above what was alive when it started."""
    live = LivePeak()
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield live
        torch.cuda.synchronize(device)
        live.peak = float(torch.cuda.max_memory_allocated(device) - start)
        live.end = float(torch.cuda.memory_allocated(device) - start)
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield live
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    live.peak, live.end = float(peak), float(running)
