"""The CPU side of a training process: how many intra-op threads it uses (every core it is given),
and how much memory each phase of the run peaks at (:class:`PeakRSS`).

``accelerate launch`` without a config sets ``OMP_NUM_THREADS`` in the child to the user's value,
or to 1 when the user set none — unless ``--cpu`` is given and psutil counts more than one
*physical* core per process (``accelerate/commands/launch.py``, ``_validate_launch_command``). On a
machine whose cores report as one physical core with two hyperthreads, or on a GPU box running a
CPU smoke test, that leaves training on one thread while the process may use more (about half the
demo's speed on the idle 2-core dev machine, issue 17).

So a ``1`` that accelerate wrote is not a choice the user made. The child cannot see the
environment from before the launch in its own ``os.environ``, but its parent — the
``accelerate launch`` process — still has it: ``/proc/<ppid>/environ`` is the environment the
parent was started with (later ``os.environ`` edits do not show there). :func:`resolve_threads`
reads it on Linux; where it cannot (another OS, no permission), it keeps the inherited value and
says so, and ``threads=N`` in the recipe config always wins.
"""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

#: Environment variables launchers use for the number of processes on this machine.
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")
#: Set in the child by every ``accelerate launch`` launcher (and not by ``Accelerator()`` itself).
ACCELERATE_LAUNCH_MARKER = "ACCELERATE_DYNAMO_BACKEND"


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str

    def describe(self) -> str:
        return f"threads: {self.threads} intra-op ({self.reason})"


def available_cores() -> int:
    """CPUs this process may run on (its affinity mask, which cgroups/taskset narrow), at least 1."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # macOS, Windows: no affinity API
        return max(os.cpu_count() or 1, 1)


def local_world_size(env: dict[str, str] | None = None) -> int:
    """Training processes sharing this machine (1 when not launched distributed)."""
    env = os.environ if env is None else env
    for name in LOCAL_SIZE_VARS:
        value = env.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def _parent_launch_env(ppid: int) -> tuple[dict[str, str] | None, list[str]]:
    """The parent's start-up environment and command line, or ``(None, [])`` when unreadable."""
    try:
        raw_env = Path(f"/proc/{ppid}/environ").read_bytes()
        raw_cmd = Path(f"/proc/{ppid}/cmdline").read_bytes()
    except OSError:
        return None, []
    env = dict(item.split("=", 1) for item in raw_env.decode(errors="replace").split("\0") if "=" in item)
    return env, raw_cmd.decode(errors="replace").split("\0")


def resolve_threads(requested: int = 0, env: dict[str, str] | None = None,
                    cores: int | None = None, ppid: int | None = None) -> ThreadChoice:
    """The intra-op thread count for this process, and why.

    Args:
        requested: 0 for automatic, or a positive count (the recipe's ``threads`` key; a count wins).
        env: the process environment (default ``os.environ``).
        cores: CPUs available to the process (default: its affinity mask).
        ppid: parent process id, read for the pre-launch environment (default ``os.getppid()``).
    """
    if requested < 0:
        raise ValueError(f"threads must be >= 0 (0 = automatic), got {requested}")
    if requested:
        return ThreadChoice(int(requested), "threads= in the config")
    env = os.environ if env is None else env
    cores = available_cores() if cores is None else cores
    per_process = max(cores // local_world_size(env), 1)
    auto = ThreadChoice(per_process, f"{cores} cores / {local_world_size(env)} process(es) on this machine")
    value = env.get("OMP_NUM_THREADS", "").strip()
    if not value.isdigit() or int(value) < 1:
        return auto
    inherited = ThreadChoice(int(value), "OMP_NUM_THREADS")
    if ACCELERATE_LAUNCH_MARKER not in env or int(value) >= per_process:
        return inherited  # plain python/torchrun, or a value no smaller than ours: the user's (or as good)
    parent_env, parent_cmd = _parent_launch_env(os.getppid() if ppid is None else ppid)
    if parent_env is None:
        return ThreadChoice(int(value), "OMP_NUM_THREADS from accelerate launch; set threads=N to use more")
    if "OMP_NUM_THREADS" in parent_env or any(a.startswith("--num_cpu_threads_per_process") for a in parent_cmd):
        return inherited  # the user asked accelerate for this number
    return ThreadChoice(per_process, f"{cores} cores / {local_world_size(env)} process(es); ignoring the "
                                     f"OMP_NUM_THREADS={value} accelerate launch set by default")


def busy_warning(threads: int, cores: int | None = None, load: float | None = None) -> str | None:
    """A hint when other work already keeps this machine's cores busy, else None.

    OpenMP threads wait for each other at every parallel region; when another process holds the
    core one of them needs, the others spin (on the 2-core dev machine under heavy load, one thread
    ran the demo step ~2.5× faster than two; see the issue 17 report). The load average is machine-wide (in a container it may count work outside its CPUs), so this only
    warns; it does not choose.
    """
    if threads < 2:
        return None
    cores = available_cores() if cores is None else cores
    try:
        load = os.getloadavg()[0] if load is None else load
    except OSError:
        return None
    if load < cores:
        return None
    return (f"the machine is busy (load {load:.1f} on {cores} CPUs): {threads} threads may be slower than 1 "
            "here; try threads=1")


def setup_threads(requested: int = 0, main_process: bool = True) -> ThreadChoice:
    """Apply :func:`resolve_threads` to torch (and ``OMP_NUM_THREADS`` for libraries started later)."""
    choice = resolve_threads(requested)
    torch.set_num_threads(choice.threads)
    os.environ["OMP_NUM_THREADS"] = str(choice.threads)
    if main_process:
        print(choice.describe(), flush=True)
        warning = busy_warning(choice.threads)
        if warning and not requested:
            print(f"warning: {warning}", flush=True)
    return choice


# ---- memory ---------------------------------------------------------------------------------

def _hiwater_kib() -> int:
    """The process's peak resident set so far (KiB): ``VmHWM``, or ``ru_maxrss`` where /proc is absent."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak  # bytes on macOS, KiB on Linux


@dataclass
class PeakRSS:
    """Peak resident memory of each phase of a run (GB), e.g. setup → train ⇄ eval → after.

    ``mark(name)`` closes the current stretch of time and books its peak under ``name`` (the max
    over every stretch booked there, so a loop can alternate ``train`` and ``eval``). On Linux the kernel's high-water mark is reset between
    phases (``/proc/self/clear_refs``, value 5; the mark restarts from the current RSS), so a phase's
    number is its own peak or what it started with, whichever is higher; elsewhere the marks are
    cumulative (each includes the phases before). ``whole`` is the process peak. The reset is
    process-wide: a tool that reads the kernel's peak from outside afterwards (``/usr/bin/time``'s
    "Maximum resident set size") sees only the last phase, so read ``whole`` instead.
    """

    phases: dict[str, float] = field(default_factory=dict)
    separate: bool = False

    def __post_init__(self) -> None:
        self.separate = self._reset()

    @staticmethod
    def _reset() -> bool:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            return True
        except OSError:
            return False

    def mark(self, name: str) -> float:
        self.phases[name] = max(self.phases.get(name, 0.0), _hiwater_kib() * 1024 / 1e9)
        if self.separate:
            self._reset()
        return self.phases[name]

    @property
    def whole(self) -> float:
        return max(self.phases.values(), default=_hiwater_kib() * 1024 / 1e9)
