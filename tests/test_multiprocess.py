"""Multi-process runs on one machine: 2 processes x 4 simulated CPU devices (gloo) against 1 process x 8.

Every run is the user's command (``python -m mercury_jax.train ...``, ``python -m mercury_jax.sample ...``) with
``--coordinator localhost:PORT --num-processes 2 --process-id I`` on a fresh port, or with the variables of a SLURM
step instead. Every process has a timeout and is killed when its test ends. A persistent compilation cache shared
by the module's runs keeps each process's start-up to a few seconds."""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest

from mercury_jax import distributed
from mercury_jax.checkpoint import restore_params

DEVICES = 8  # In total: 1 process x 8 devices or 2 processes x 4.
SETS = [
  "model.max_length=64",
  "model.vocab_size=400",
  "train.eval_every=0",
  "train.log_every=4",
  "checkpoint.every=4",
]
STEPS = 8
TIMEOUT = 240  # Seconds for one multi-process command.
# The conftest's quick compilation (-O0) for every process: these commands spend most of their time compiling; at
# XLA's default optimisation the module's runs took 1.5x the CPU time (392 s against 261 s, one after the other).
QUICK_FLAGS = [f for f in os.environ["XLA_FLAGS"].split() if not f.startswith("--xla_force_host_platform_device_count")]


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory) -> Path:
  return tmp_path_factory.mktemp("jax_cache")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


class _Processes:
  """``num_processes`` copies of one command, joined by ``--coordinator`` (or, with ``slurm``, by the variables of a
  SLURM step, which JAX reads); stdout and stderr go to files."""

  def __init__(
    self,
    argv: list[str] | Callable[[int], list[str]],
    num_processes: int,
    log_dir: Path,
    cache: Path,
    slurm: bool = False,
  ):
    self.num_processes, self.log_dir = num_processes, log_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {
      **os.environ,
      "XLA_FLAGS": " ".join([*QUICK_FLAGS, f"--xla_force_host_platform_device_count={DEVICES // num_processes}"]),
      "JAX_PLATFORMS": "cpu",
      "JAX_COMPILATION_CACHE_DIR": str(cache),
      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
      "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    port = _free_port()
    self.procs: list[subprocess.Popen] = []
    for i in range(num_processes):
      command = argv(i) if callable(argv) else list(argv)
      step = {}
      if slurm:  # What `srun` sets for task i of a one-node step; JAX_COORDINATOR_PORT replaces the job-id port.
        step = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_NUM_NODES": "1"}
        step |= {"SLURM_NTASKS": str(num_processes), "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)}
        step |= {"JAX_COORDINATOR_PORT": str(port)}
      elif num_processes > 1:
        command += ["--coordinator", f"localhost:{port}", "--num-processes", str(num_processes), "--process-id", str(i)]
      with open(log_dir / f"{i}.out", "w") as out, open(log_dir / f"{i}.err", "w") as err:
        self.procs.append(
          subprocess.Popen(command, stdout=out, stderr=err, env=env | step, cwd=Path(__file__).parent.parent)
        )

  def stdout(self, i: int) -> str:
    return (self.log_dir / f"{i}.out").read_text()

  def stderr(self, i: int) -> str:
    return (self.log_dir / f"{i}.err").read_text()

  def wait(self, timeout: float = TIMEOUT, expect: int = 0) -> None:
    """Waits for every process and asserts that each exited with ``expect``."""
    deadline = time.time() + timeout
    for i, p in enumerate(self.procs):
      try:
        p.wait(timeout=max(deadline - time.time(), 0.1))
      except subprocess.TimeoutExpired:
        self.kill()
        raise AssertionError(f"process {i} timed out after {timeout} s: {self.stderr(i)[-3000:]}") from None
    for i, p in enumerate(self.procs):
      assert p.returncode == expect, f"process {i} exited with {p.returncode}: {self.stderr(i)[-3000:]}"

  def kill(self) -> None:
    for p in self.procs:
      if p.poll() is None:
        p.kill()
    for p in self.procs:
      with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=30)


@contextlib.contextmanager
def _launch(argv, num_processes: int, log_dir: Path, cache: Path, slurm: bool = False):
  processes = _Processes(argv, num_processes, log_dir, cache, slurm)
  try:
    yield processes
  finally:
    processes.kill()


def _run(cache: Path, *commands: tuple[list[str], int, Path]) -> list[_Processes]:
  """Runs ``(argv, num_processes, log_dir)`` commands side by side (the 2 cores are rarely both busy in one)."""
  with contextlib.ExitStack() as stack:
    runs = [stack.enter_context(_launch(argv, n, log_dir, cache)) for argv, n, log_dir in commands]
    for run in runs:
      run.wait()
  return runs


def _train_argv(workdir: Path, data_dir: Path, steps: int, *extra: str) -> list[str]:
  sets = [*SETS, f"data.path={data_dir}", f"train.steps={steps}", *extra]
  argv = [sys.executable, "-m", "mercury_jax.train", "--config", "tiny", "--workdir", str(workdir)]
  return argv + [a for s in sets for a in ("--set", s)]


def _params(workdir: Path) -> list[np.ndarray]:
  params, _ = restore_params(workdir)
  return [np.asarray(p) for p in jax.tree.leaves(params)]


def _steps(workdir: Path) -> list[int]:
  return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def _assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
  # Gloo's cross-process all-reduce may add the 8 gradient shards in another order than XLA's in-process one.
  for x, y in zip(a, b, strict=True):
    np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-7)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dir, compile_cache) -> dict[int, Path]:
  """The same 8 steps trained by 1 process x 8 devices and by 2 processes x 4 (checkpoints at steps 4 and 8)."""
  root = tmp_path_factory.mktemp("trained")
  workdirs = {n: root / f"{n}proc" for n in (1, 2)}
  _run(compile_cache, *[(_train_argv(workdirs[n], data_dir, STEPS), n, root / f"{n}proc_logs") for n in (1, 2)])
  return workdirs


def test_two_processes_train_the_same_parameters_as_one(trained):
  assert _steps(trained[1]) == _steps(trained[2]) == [4, STEPS]
  _assert_same(_params(trained[2]), _params(trained[1]))
  lines = (trained[2] / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == STEPS // 4, "metrics.jsonl must be written by process 0 only"


def test_checkpoints_move_between_one_and_two_processes(tmp_path, trained, data_dir, compile_cache):
  commands, workdirs = [], {}
  for source, target in ((2, 1), (1, 2)):
    workdirs[target] = tmp_path / f"{source}proc_to_{target}proc"
    shutil.copytree(trained[source], workdirs[target])
    shutil.rmtree(workdirs[target] / "checkpoints" / str(STEPS))  # Resume from step 4, saved by `source` processes.
    commands.append((_train_argv(workdirs[target], data_dir, STEPS), target, workdirs[target] / "logs"))
  runs = _run(compile_cache, *commands)
  for run, target in zip(runs, (1, 2), strict=True):
    assert "resuming at step 4" in run.stderr(0)
    _assert_same(_params(workdirs[target]), _params(trained[target]))


def test_slurm_step_trains_without_coordinator_flags(tmp_path, trained, data_dir, compile_cache):
  workdir = tmp_path / "slurm"
  with _launch(_train_argv(workdir, data_dir, STEPS), 2, tmp_path / "logs", compile_cache, slurm=True) as run:
    run.wait()
  assert "mesh {'data': 8," in run.stderr(0)  # One mesh over both processes' devices.
  _assert_same(_params(workdir), _params(trained[2]))


def _wait_for_step(run: _Processes, metrics: Path, above: int) -> None:
  deadline = time.time() + TIMEOUT
  while time.time() < deadline and all(p.poll() is None for p in run.procs):
    lines = metrics.read_text().split("\n")[:-1] if metrics.exists() else []  # Complete lines only.
    if any(json.loads(line)["step"] > above for line in lines):
      return
    time.sleep(0.05)
  raise AssertionError(f"no step above {above} was logged: {run.stderr(0)[-3000:]}")


def test_sigterm_to_any_process_stops_all_at_one_checkpoint_and_rerun_resumes(tmp_path, data_dir, compile_cache):
  workdir = tmp_path / "run"
  argv = _train_argv(workdir, data_dir, 100000, "checkpoint.every=1000")
  saved = [0]
  for signalled in (1, 0):  # As when one host of a slice is preempted; then the same command again.
    with _launch(argv, 2, tmp_path / f"logs_{signalled}", compile_cache) as run:
      _wait_for_step(run, workdir / "metrics.jsonl", above=saved[-1])
      run.procs[signalled].send_signal(signal.SIGTERM)
      run.wait()
    if saved[-1]:
      assert f"resuming at step {saved[-1]}" in run.stderr(0)
    steps = _steps(workdir)
    assert steps[:-1] == saved[1:] and saved[-1] < steps[-1] < 1000, steps  # Saved where they stopped.
    assert f"received SIGTERM on one of the 2 processes; all stopped at the same step: saved step {steps[-1]}" in (
      run.stderr(0)
    )
    saved.append(steps[-1])


def test_workdir_that_hosts_do_not_share_is_a_clear_error(tmp_path, data_dir, compile_cache):
  # Two hosts with host-local disks, simulated by a different --workdir per process.
  argv = lambda i: _train_argv(tmp_path / f"host{i}", data_dir, STEPS)
  with _launch(argv, 2, tmp_path / "logs", compile_cache) as run:
    run.wait(expect=1)
  for i in range(2):
    assert run.stderr(i).strip().splitlines()[-1].endswith("mounts at the same path (NFS, Filestore, Lustre)")
  assert not (tmp_path / "host0" / "checkpoints").exists()


PROMPTS = ["def add(a, b):", "import os", "class Point:", "x = [", "for i in range(", "return", "# a", "if n"]
SAMPLE_FLAGS = ["--length", "16", "--steps", "8", "--seed", "3"]


def _json_lines(text: str) -> list[dict]:
  return [json.loads(line) for line in text.splitlines() if line.startswith("{")]  # Gloo logs to stdout on CPU.


def test_sample_command_on_two_processes_matches_one(tmp_path, trained, compile_cache):
  prompts_file = tmp_path / "prompts.jsonl"
  prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
  argv = [sys.executable, "-m", "mercury_jax.sample", "--checkpoint", str(trained[1]), "--prompts-file"]
  argv += [str(prompts_file), "--json", *SAMPLE_FLAGS]
  one, two = _run(compile_cache, (argv, 1, tmp_path / "1proc"), (argv, 2, tmp_path / "2proc"))
  expected = _json_lines(one.stdout(0))
  assert [s["prompt"] for s in expected] == PROMPTS
  assert [s["tokens"] for s in _json_lines(two.stdout(0))] == [s["tokens"] for s in expected]
  assert _json_lines(two.stdout(1)) == [], "only process 0 prints samples"


@pytest.mark.parametrize("cache", ["auto", "dual"])  # The whole canvas as one block, and blocks of 4.
def test_each_process_samples_its_own_prompts(tmp_path, trained, compile_cache, cache):
  # Process 0 has 5 prompts and process 1 has 3: the shorter batch is padded, and streams continue across processes.
  mine = {0: PROMPTS[:5], 1: PROMPTS[5:]}
  for i, prompts in mine.items():
    (tmp_path / f"prompts-{i}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
  argv = [sys.executable, "-m", "mercury_jax.sample", "--checkpoint", str(trained[1]), "--prompts-file"]
  blocks = {"block_length": 4} if cache == "dual" else {}  # Several blocks of the engine per row.
  argv += [str(tmp_path / "prompts-{process}.jsonl"), "--json", "--cache", cache, *SAMPLE_FLAGS]
  argv += ["--block-length", "4"] if blocks else []
  (run,) = _run(compile_cache, (argv, 2, tmp_path / "logs"))
  got = {i: _json_lines(run.stdout(i)) for i in range(2)}

  from mercury_jax import sharding as sh
  from mercury_jax.config import MeshConfig
  from mercury_jax.sampling import Sampler

  sampler = Sampler.from_checkpoint(trained[1], mesh=sh.make_mesh(MeshConfig(data=-1)))
  expected = [s.tokens for s in sampler.generate(PROMPTS, length=16, steps=8, seed=3, cache=cache, **blocks)]
  for i, records in got.items():  # Each process prints the samples of its own prompts, and only those.
    assert [(r["process"], r["prompt"]) for r in records] == [(i, p) for p in mine[i]]
  assert [r["tokens"] for r in got[0] + got[1]] == expected


# ------------------------------------------------------------------------------- launcher detection (no processes)

_LAUNCHER_VARS = (
  "SLURM_JOB_ID",
  "SLURM_STEP_NODELIST",
  "SLURM_NTASKS",
  "SLURM_PROCID",
  "SLURM_LOCALID",
  "SLURM_STEP_NUM_NODES",
  "OMPI_MCA_orte_hnp_uri",
  "OMPI_COMM_WORLD_SIZE",
  "OMPI_COMM_WORLD_LOCAL_SIZE",
  "JAX_LOCAL_DEVICE_IDS",
  "CUDA_VISIBLE_DEVICES",
)


@pytest.fixture
def clean_env(monkeypatch):
  for name in _LAUNCHER_VARS:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  return monkeypatch


def _slurm(env, tasks: int, nodes: int, gpus: str | None = "0,1,2,3") -> None:
  values = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NODELIST": "node[01-02]",
    "SLURM_NTASKS": str(tasks),
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_STEP_NUM_NODES": str(nodes),
  }
  for name, value in values.items():
    env.setenv(name, value)
  if gpus is not None:
    env.setenv("CUDA_VISIBLE_DEVICES", gpus)


def test_no_launcher_means_one_process(clean_env):
  assert distributed.launcher() is None
  _slurm(clean_env, tasks=1, nodes=1)  # `srun -n1` or an interactive allocation: no coordinator.
  assert distributed.launcher() is None


def test_slurm_step_of_several_tasks_is_detected(clean_env):
  _slurm(clean_env, tasks=8, nodes=2)  # One task per GPU: JAX gives each its local-rank GPU.
  assert distributed.launcher() == "slurm"
  assert distributed.local_device_ids("slurm") is None


def test_slurm_one_task_per_node_drives_every_visible_gpu(clean_env):
  _slurm(clean_env, tasks=2, nodes=2)
  assert distributed.local_device_ids("slurm") == [0, 1, 2, 3]
  clean_env.setenv("JAX_LOCAL_DEVICE_IDS", "0,1")  # JAX's own override wins.
  assert distributed.local_device_ids("slurm") is None


def test_sbatch_script_outside_srun_is_one_process(clean_env):
  _slurm(clean_env, tasks=8, nodes=2)
  clean_env.delenv("SLURM_STEP_NODELIST")  # The batch script itself, before `srun`.
  assert distributed.launcher() is None


@pytest.mark.parametrize(
  "flags, message",
  [
    (["--coordinator", "localhost:1234"], "must be given together"),
    (["--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "2"], "must lie in [0,"),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"], "must be HOST:PORT"),
  ],
)
def test_bad_distributed_flags_are_one_line_errors(tmp_path, data_dir, flags, message):
  proc = subprocess.run(
    [*_train_argv(tmp_path, data_dir, STEPS), *flags],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode != 0
  assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, proc.stderr
