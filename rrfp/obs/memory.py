"""The process's memory peak per step and the headroom left under its limit.

What is read, and why:

* **CPU: peak RSS** from ``VmHWM`` in ``/proc/self/status`` (the kernel's high-water mark of
  the process's resident pages: every allocation counts, torch's allocator, the libraries and
  the transport's buffers alike), reset at each step's start by writing ``5`` to
  ``/proc/self/clear_refs`` (Linux >= 4.0, ``Documentation/filesystems/proc.rst``), so the peak
  is the step's. ``ru_maxrss`` cannot be reset (one peak for the whole life, the build
  included), and the current RSS (``/proc/self/statm``) misses what a step frees before it ends.
  Where the reset is refused, the peak is the process's since start (``rss_source`` says so);
  off Linux, ``ru_maxrss``.
* **CUDA: peak allocated and reserved** (``torch.cuda.max_memory_allocated`` /
  ``max_memory_reserved``), reset at each step's start (``reset_peak_memory_stats``).
* **Headroom**: bytes left at the step's peak under the limit that binds the process.
  CUDA: ``torch.cuda.mem_get_info`` (cudaMemGetInfo: free and total bytes of the device, other
  processes' use included): ``free + reserved now - peak reserved``. CPU: the bytes available
  now, the smaller of the cgroup's (``memory.max`` minus the working set ``memory.current -
  inactive_file``, as the kubelet computes it for eviction; cgroup v1:
  ``memory.limit_in_bytes``, ``memory.usage_in_bytes``, ``total_inactive_file``) and the host's
  ``MemAvailable`` (``/proc/meminfo``), plus the RSS held now, minus the step's peak RSS: what
  would be left had the rest of the host stayed as it is now. Ranks sharing a host each see the
  same pool, so the smallest headroom of a host's ranks is the one to alert on.

Every function here reads files or torch's counters only: no allocation, no collective.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

__all__ = ["ProcessPeak", "PeakMeter", "memory_limit", "read_status_bytes"]

_PROC = Path("/proc")
_CGROUP = Path("/sys/fs/cgroup")
_NO_LIMIT = 1 << 62  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


@dataclasses.dataclass(frozen=True)
class ProcessPeak:
    """One step's process peak and headroom, bytes (None: not measured here).

    Attributes:
        rss: peak resident set size of the step (or since start: ``rss_source``).
        rss_source: ``"VmHWM, reset per step"``, ``"VmHWM since start"`` or ``"ru_maxrss since start"``.
        cuda_allocated, cuda_reserved: peak CUDA bytes of the step (None off CUDA).
        limit: the limit the headroom is taken against (device total, cgroup or host memory).
        limit_source: ``"cuda device"``, ``"cgroup v2"``, ``"cgroup v1"`` or ``"host"``.
        headroom: bytes left at the step's peak (may be negative: the peak needed swap or
            another process gave memory back since).
    """

    rss: int | None
    rss_source: str
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    limit: int | None = None
    limit_source: str = ""
    headroom: int | None = None


def read_status_bytes(field: str, status: Path = _PROC / "self" / "status") -> int | None:
    """``field`` (``VmHWM``, ``VmRSS``) of ``/proc/self/status`` in bytes, None if absent."""
    try:
        text = status.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" or not text.lstrip("-").isdigit() else int(text)


def _stat_value(path: Path, keys: tuple[str, ...]) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    got = dict(line.split()[:2] for line in lines if len(line.split()) >= 2)
    for k in keys:
        if k in got and got[k].isdigit():
            return int(got[k])
    return 0


def _cgroup_dirs(proc_cgroup: Path, root: Path) -> list[tuple[str, Path]]:
    """``(version, folder)`` of this process's memory cgroup and its ancestors up to the
    mount, innermost first (a cgroup namespace shows the process at its mount's root)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and (root / "cgroup.controllers").exists():
            version, mount = "cgroup v2", root
        elif "memory" in controllers.split(","):
            version, mount = "cgroup v1", root / "memory"
        else:
            continue
        leaf = mount / path.lstrip("/")
        if not leaf.is_dir():
            leaf = mount
        dirs, d = [], leaf
        while True:
            dirs.append((version, d))
            if d == mount or mount not in d.parents:
                break
            d = d.parent
        return dirs
    return []


def memory_limit(proc: Path = _PROC, cgroup: Path = _CGROUP) -> tuple[int | None, int | None, str]:
    """``(limit bytes, available bytes now, source)`` of the host memory that binds this
    process: the tightest cgroup limit on its way to the mount (available = limit - working
    set), or the host's ``MemTotal`` / ``MemAvailable``; the smaller availability of the two
    when both exist. ``(None, None, "")`` where neither can be read (not Linux)."""
    host_total = host_avail = None
    try:
        info = dict(line.split(":", 1) for line in (proc / "meminfo").read_text().splitlines() if ":" in line)
        host_total = int(info["MemTotal"].split()[0]) * 1024
        host_avail = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        pass
    best: tuple[int, int, str] | None = None
    for version, d in _cgroup_dirs(proc / "self" / "cgroup", cgroup):
        v2 = version == "cgroup v2"
        limit = _read_int(d / ("memory.max" if v2 else "memory.limit_in_bytes"))
        if limit is None or limit >= _NO_LIMIT:
            continue
        usage = _read_int(d / ("memory.current" if v2 else "memory.usage_in_bytes")) or 0
        inactive = _stat_value(d / "memory.stat", ("inactive_file",) if v2 else ("total_inactive_file", "inactive_file"))
        avail = limit - max(0, usage - inactive)
        if best is None or avail < best[1]:
            best = (limit, avail, version)
    if best is not None and (host_avail is None or best[1] <= host_avail):
        return best
    if best is not None:
        return best[0], host_avail, f"{best[2]} (host MemAvailable smaller)"
    return host_total, host_avail, "host" if host_total is not None else ""


class PeakMeter:
    """Resets and reads the process's peak each step (the module docstring says what and why).

    Args:
        device: the rank's compute device (``torch.device`` or a string); CUDA adds the
            allocator's peaks and takes the headroom against the device.
    """

    def __init__(self, device=None) -> None:
        self.cuda = device is not None and str(getattr(device, "type", device)).startswith("cuda")
        self.device = device
        self._clear_refs = _PROC / "self" / "clear_refs"
        self.resettable = self._reset_rss()  # the first reset says whether the kernel lets us

    def _reset_rss(self) -> bool:
        try:
            with open(self._clear_refs, "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def reset(self) -> None:
        """A step begins: its peaks start from what the process holds now."""
        if self.resettable:
            self.resettable = self._reset_rss()
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> ProcessPeak:
        """The peaks since the last :meth:`reset` and the headroom under the limit."""
        rss, source = read_status_bytes("VmHWM"), "VmHWM, reset per step" if self.resettable else "VmHWM since start"
        if rss is None:
            import resource

            rss, source = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss since start"
        if self.cuda:
            import torch

            alloc = torch.cuda.max_memory_allocated(self.device)
            peak = torch.cuda.max_memory_reserved(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            headroom = free + torch.cuda.memory_reserved(self.device) - peak
            return ProcessPeak(rss, source, alloc, peak, total, "cuda device", headroom)
        limit, avail, where = memory_limit()
        now = read_status_bytes("VmRSS")
        headroom = None if avail is None or now is None else avail + now - rss
        return ProcessPeak(rss, source, None, None, limit, where, headroom)

