"""distill.threads: every core the process is given, unless the user said otherwise."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from distill.threads import available_cores, busy_warning, local_world_size, resolve_threads

ROOT = Path(__file__).resolve().parents[1]
LAUNCHED = {"ACCELERATE_DYNAMO_BACKEND": "NO"}  # what every accelerate launcher puts in the child


@pytest.fixture
def parent():
    """A stand-in parent process whose start-up environment and command line we choose."""
    procs = []

    def start(env: dict, args=()):
        p = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)", *args],
                             env=env, stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout.readline().strip() == "up"  # exec'd: /proc/<pid>/environ is its own now
        return p.pid

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_auto_divides_cores_by_local_processes():
    assert resolve_threads(0, env={}, cores=8).threads == 8
    assert resolve_threads(0, env={"LOCAL_WORLD_SIZE": "2"}, cores=8).threads == 4
    assert resolve_threads(0, env={"LOCAL_WORLD_SIZE": "4"}, cores=2).threads == 1
    assert local_world_size({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}) == 3
    assert 1 <= available_cores() <= (os.cpu_count() or 1)


def test_explicit_choices_win():
    assert resolve_threads(3, env={"OMP_NUM_THREADS": "1", **LAUNCHED}, cores=8).threads == 3
    # plain python / torchrun: OMP_NUM_THREADS is the user's
    assert resolve_threads(0, env={"OMP_NUM_THREADS": "1"}, cores=8).threads == 1
    assert resolve_threads(0, env={"OMP_NUM_THREADS": "16"}, cores=8).threads == 16
    # not a number: ignored
    assert resolve_threads(0, env={"OMP_NUM_THREADS": "x"}, cores=8).threads == 8


def test_accelerate_default_one_is_overridden(parent):
    pid = parent({k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})
    choice = resolve_threads(0, env={"OMP_NUM_THREADS": "1", **LAUNCHED}, cores=8, ppid=pid)
    assert choice.threads == 8 and "accelerate launch set by default" in choice.reason


def test_user_value_given_to_accelerate_is_kept(parent):
    pid = parent({**os.environ, "OMP_NUM_THREADS": "1"})
    assert resolve_threads(0, env={"OMP_NUM_THREADS": "1", **LAUNCHED}, cores=8, ppid=pid).threads == 1
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    pid = parent(env, ["--num_cpu_threads_per_process=1"])
    assert resolve_threads(0, env={"OMP_NUM_THREADS": "1", **LAUNCHED}, cores=8, ppid=pid).threads == 1


def test_unreadable_parent_keeps_inherited_value():
    choice = resolve_threads(0, env={"OMP_NUM_THREADS": "1", **LAUNCHED}, cores=8, ppid=2**22 + 7)
    assert choice.threads == 1 and "threads=N" in choice.reason


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")
def test_real_accelerate_launch_without_omp_uses_all_cores(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
                      "from distill.threads import resolve_threads\n"
                      "import os; print('RESULT', os.environ['OMP_NUM_THREADS'], resolve_threads(cores=6).threads)\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", str(script)], env=env,
                          capture_output=True, text=True, timeout=300)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert line, proc.stderr[-2000:]
    # accelerate hands the child OMP_NUM_THREADS=1; the recipe still uses what it has
    assert line[0].split()[1:] == ["1", "6"]


def test_peak_rss_books_each_phase_apart():
    import torch

    from distill.threads import PeakRSS

    rss = PeakRSS()
    big = torch.ones(64 * 2**20)  # 256 MiB, touched, then returned to the OS
    del big
    rss.mark("big")  # the phase's peak survives the free
    small = torch.ones(1024)
    rss.mark("small")
    del small
    assert rss.phases["big"] > 0.25
    if rss.separate:  # Linux: the high-water mark was reset between phases
        assert rss.phases["small"] < rss.phases["big"] - 0.2
    assert rss.whole == max(rss.phases.values())


def test_recipe_configs_refuse_negative_threads():
    from core.config import ConfigError
    from distill.config import DistillConfig
    from recipes.retrofit import RetrofitConfig

    for cls in (DistillConfig, RetrofitConfig):
        assert cls().threads == 0
        with pytest.raises(ConfigError, match="threads"):
            cls(threads=-1)


def test_busy_machine_gets_a_hint_not_a_different_choice():
    assert busy_warning(2, cores=2, load=24.0) and "threads=1" in busy_warning(2, cores=2, load=24.0)
    assert busy_warning(2, cores=2, load=0.3) is None
    assert busy_warning(1, cores=2, load=24.0) is None
