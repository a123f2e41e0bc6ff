"""``python -m mercury_jax.train --config NAME --workdir DIR [--set key=value ...]``: the one training loop.

Rerunning the same command resumes from the latest checkpoint in ``DIR/checkpoints``. ``--init-from CHECKPOINT``
starts a fresh run (step 0, a new optimiser state) from another checkpoint's parameters; a workdir that already
holds a checkpoint resumes from it instead. SIGTERM saves a checkpoint
and exits cleanly; with several processes, SIGTERM to any one of them makes every process save the same step and
exit cleanly (``distributed.Preemption``). A non-finite loss stops the run with an error; the step that produced it
is discarded inside the compiled step, so the last good checkpoint is never overwritten by a bad state. Metrics are
appended to ``DIR/metrics.jsonl`` and written as TensorBoard summaries beside it (``tensorboard --logdir DIR``): loss,
held-out objective, learning rate, gradient norm, tokens/s and MFU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.record_writer import RecordWriter

from mercury_jax import distributed, sharding as sh
from mercury_jax.bench.throughput import peak_flops
from mercury_jax.checkpoint import Checkpointer, init_params_from
from mercury_jax.config import Config, ConfigError, load_config, parse_set_args
from mercury_jax.data import pipeline
from mercury_jax.files import CHECKPOINTS, TOKENIZER_FILE
from mercury_jax.model import count_params, flops_per_token
from mercury_jax.progress import duration
from mercury_jax.trainer import HALVES, Trainer, learning_rate_schedule, verified_losses


class NonFiniteLoss(RuntimeError):
  pass


class _Progress:
  """One status line on stderr: redrawn in place on a terminal, printed every ``log_every`` steps otherwise."""

  def __init__(self, total: int, enabled: bool):
    self.total, self.enabled, self.tty = total, enabled, sys.stderr.isatty()

  def show(self, text: str, final: bool = False) -> None:
    if not self.enabled:
      return
    if self.tty:
      sys.stderr.write(f"\r\033[K{text}" + ("\n" if final else ""))
    else:
      sys.stderr.write(text + "\n")
    sys.stderr.flush()


class _Summaries:
  """Metrics of the primary process: JSON lines in ``metrics.jsonl`` and a TensorBoard event file in the workdir.

  Events are written synchronously with TensorBoard's own record writer and protos (no TensorFlow; tensorboardX's
  ``SummaryWriter`` queues events for a background thread, so a killed run would lose those not yet written, and its
  package imports torch wherever torch is installed) and flushed with every record, like the JSON lines. On resume,
  JSON lines from steps after the restored one are dropped, and the new event file starts with
  TensorBoard's purge marker (a ``SessionLog.START`` at the next step), which hides the old events of those steps:
  a resumed run reads as one run in both.
  """

  SCALARS = {  # metrics key -> TensorBoard tag
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "learning_rate": "train/learning_rate",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "eval_nats_per_token": "eval/nats_per_token",
    "eval_perplexity_bound": "eval/perplexity",
    "ar_loss": "train/ar_loss",  # verified: the verifier's next-token loss and the drafter's loss
    "draft_loss": "train/draft_loss",
    "draft_kl": "train/draft_kl",  # verified: the drafter's KL to the clean half's next-token distributions
    "schedule_fit": "train/schedule_fit",  # continuous: the learned noise schedule's least-squares fit
    "eval_ar_nats_per_token": "eval/ar_nats_per_token",
    "eval_draft_nats_per_token": "eval/draft_nats_per_token",
    "eval_draft_kl": "eval/draft_kl",
  }

  def __init__(self, workdir: Path, resume_step: int, enabled: bool):
    self.path, self.enabled, self.events = workdir / "metrics.jsonl", enabled, None
    if not enabled:
      return
    if self.path.exists():
      lines = self.path.read_text().splitlines()
      kept = [line for line in lines if line and json.loads(line).get("step", 0) <= resume_step]
      tmp = self.path.with_suffix(".tmp")
      tmp.write_text("".join(line + "\n" for line in kept))
      os.replace(tmp, self.path)
    name = f"events.out.tfevents.{time.time():.0f}.{socket.gethostname()}.{os.getpid()}"
    self.events = RecordWriter((workdir / name).open("wb"))
    self._event(Event(wall_time=time.time(), file_version="brain.Event:2"))
    if resume_step:
      start = SessionLog(status=SessionLog.START)
      self._event(Event(wall_time=time.time(), step=resume_step + 1, session_log=start))
    self.events.flush()

  def _event(self, event: Event) -> None:
    self.events.write(event.SerializeToString())

  def write(self, record: dict[str, Any]) -> None:
    if not self.enabled:
      return
    with self.path.open("a") as f:
      f.write(json.dumps(record) + "\n")
    now = time.time()
    for key, tag in self.SCALARS.items():
      if record.get(key) is not None:
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(record[key]))])
        self._event(Event(wall_time=now, step=record["step"], summary=summary))
    self.events.flush()

  def close(self) -> None:
    if self.events is not None:
      self.events.close()


def _check_data(cfg: Config, meta: dict[str, Any]) -> None:
  if meta["seq_len"] != cfg.model.max_length:
    raise ConfigError(
      f"data at {cfg.data.path!r} has seq_len={meta['seq_len']} but model.max_length="
      f"{cfg.model.max_length}; set --set model.max_length={meta['seq_len']} or re-run prepare "
      f"with --seq-len {cfg.model.max_length}"
    )
  if meta["vocab_size"] > cfg.model.vocab_size:
    raise ConfigError(
      f"the tokenizer has {meta['vocab_size']} pieces but model.vocab_size={cfg.model.vocab_size}; "
      f"set model.vocab_size >= {meta['vocab_size']}"
    )
  if meta["mask_id"] != cfg.objective.mask_id:
    raise ConfigError(f"the tokenizer's mask id is {meta['mask_id']} but objective.mask_id={cfg.objective.mask_id}")
  if cfg.data.document_segments and meta["mode"] != "lm":
    raise ConfigError(
      f"data.document_segments needs packed LM records; {cfg.data.path!r} holds {meta['mode']!r} records (one "
      "example each): set data.document_segments=false"
    )


def _same_model(stored: Config, cfg: Config) -> None:
  if stored.model != cfg.model or stored.objective != cfg.objective:
    raise ConfigError(
      "the checkpoint in the workdir was trained with a different model or objective config; "
      "use a new --workdir or the original --config/--set"
    )


def evaluate(trainer: Trainer, params, batches: list[dict[str, jax.Array]], seed: int) -> dict[str, float]:
  """Held-out negative ELBO (or NLL) in nats per target token, with fixed keys so evaluations compare.

  A ``verified`` objective also reports its halves: the verifier's exact next-token NLL (whose perplexity is the
  one reported) and the drafter's loss; ``eval_nats_per_token`` is then their weighted mean, the training loss.
  """
  if not trainer.cfg.objective.verified:
    nats = trainer.nats_per_token(params, batches, jax.random.key(seed))
    return {"eval_nats_per_token": nats, "eval_perplexity_bound": math.exp(min(nats, 50.0))}
  losses = verified_losses(trainer.eval_sums(params, batches, jax.random.key(seed)), trainer.cfg.objective)
  return {
    "eval_nats_per_token": losses["loss"],
    "eval_ar_nats_per_token": losses["ar"],
    "eval_draft_nats_per_token": losses["draft"],
    "eval_draft_kl": losses["draft_kl"],
    "eval_perplexity_bound": math.exp(min(losses["ar"], 50.0)),
  }


def train(
  cfg: Config,
  workdir: str | Path,
  *,
  log: bool = True,
  init_from: str | Path | None = None,
  devices: Sequence[jax.Device] | None = None,
) -> dict[str, Any]:
  """Trains (or resumes) ``cfg`` in ``workdir``; returns the last metrics. See the module docstring.

  Args:
    cfg: The run's config.
    workdir: Where the checkpoints, metrics and summaries go.
    log: Print the progress line and the metrics on stderr (primary process only).
    init_from: A checkpoint whose parameters start a fresh run (``checkpoint.init_params_from``); ignored when
      ``workdir`` already holds a checkpoint, which is resumed.
    devices: The devices that ``cfg.mesh`` lays out (default: every device of every process). A subset, e.g.
      ``jax.devices()[:1]``, trains a one-process run on fewer devices than the host has.
  """
  workdir = Path(workdir)
  primary = distributed.is_primary()
  if primary:
    workdir.mkdir(parents=True, exist_ok=True)
  distributed.check_shared_directory(workdir, "--workdir")
  meta = pipeline.read_metadata(cfg.data.path)
  _check_data(cfg, meta)
  mesh = sh.make_mesh(cfg.mesh, devices)
  trainer = Trainer(cfg, mesh)
  checkpointer = Checkpointer(workdir / CHECKPOINTS, cfg.checkpoint)
  dataset = pipeline.train_dataset(
    cfg.data.path,
    seq_len=cfg.model.max_length,
    global_batch_size=cfg.data.batch_size,
    seed=cfg.data.shuffle_seed,
    num_threads=cfg.data.num_threads,
    prefetch=cfg.data.prefetch,
    document_segments=cfg.data.document_segments,
    mix=cfg.data.weighted("mix"),
    distill=cfg.data.weighted("distill"),
    distill_batch_size=cfg.data.distill_batch_size,
  )
  data_iter = iter(dataset)
  if checkpointer.latest_step() is not None:
    _same_model(checkpointer.stored_config(), cfg)
    state = checkpointer.restore(trainer.abstract_state(), data_iter)
  else:
    state = trainer.init_state(cfg.train.seed)
    if init_from is not None:  # Fresh optimiser state and step: only the parameters come from the other checkpoint.
      state["params"] = init_params_from(init_from, trainer.abstract_state()["params"], fresh=state["params"])
  start_step = int(jax.device_get(state["step"]))
  if primary:
    (workdir / "config.json").write_text(cfg.to_json())
    shutil.copyfile(Path(cfg.data.path) / TOKENIZER_FILE, workdir / TOKENIZER_FILE)
  summaries = _Summaries(workdir, start_step, primary)
  progress = _Progress(cfg.train.steps, log and primary)

  eval_batches = []
  if cfg.train.eval_every and cfg.train.eval_batches and meta["splits"].get("validation", {}).get("records", 0):
    eval_batches = [
      pipeline.to_global(b, mesh, trainer.rules)
      for b in pipeline.eval_batches(
        cfg.data.path,
        "validation",
        seq_len=cfg.model.max_length,
        global_batch_size=cfg.data.batch_size,
        num_batches=cfg.train.eval_batches,
        document_segments=cfg.data.document_segments,
      )
    ]
  num_params = count_params(state["params"])
  doubled = cfg.objective.block_size > 0 or cfg.objective.verified  # Block diffusion and verified run 2n tokens.
  head_halves = 2 if cfg.objective.verified else 1  # Verified scores both halves.
  step_flops = (
    flops_per_token(cfg.model, num_params, doubled=doubled, head_halves=head_halves)
    * cfg.data.rows
    * cfg.model.max_length
  )
  # On an accelerator MFU divides by every chip's datasheet peak; simulated CPU devices share one host's cores.
  peak, peak_source = peak_flops(mesh.devices.flat[0], cfg.model.dtype)
  if peak is not None and jax.default_backend() != "cpu":
    peak *= mesh.devices.size
  schedule = learning_rate_schedule(cfg.optim, cfg.train.steps)
  progress.show(
    f"{cfg.name}: {num_params / 1e6:.2f} M parameters, mesh {dict(mesh.shape)}, resuming at step {start_step}"
    if start_step
    else f"{cfg.name}: {num_params / 1e6:.2f} M parameters, mesh {dict(mesh.shape)}",
    final=True,
  )
  if peak is None:
    progress.show(f"MFU is not reported: {peak_source}", final=True)

  last: dict[str, Any] = {"step": start_step}
  window_start, window_tokens = time.perf_counter(), 0.0
  try:
    with distributed.Preemption() as preemption:  # The steps bring their mesh and rules (sharding.MeshJit).
      pending = None
      tokens_per_step = cfg.data.rows * cfg.model.max_length
      for step in range(start_step, cfg.train.steps):
        batch = pipeline.to_global(next(data_iter), mesh, trainer.rules)
        state, metrics = trainer.train_step(state, batch)
        if pending is not None:  # Read the previous step's metrics while this one runs.
          last = _finish_step(*pending, cfg=cfg)
        pending, done = (step + 1, metrics), step + 1
        window_tokens += tokens_per_step
        preempted = preemption.reached(done)  # The same `done` on every process.
        log_now = done % max(cfg.train.log_every, 1) == 0 or done == cfg.train.steps
        save_now = done % cfg.checkpoint.every == 0 or done == cfg.train.steps or preempted
        if log_now or save_now or step == start_step:
          last, pending = _finish_step(*pending, cfg=cfg), None
        if log_now:
          rate = window_tokens / (time.perf_counter() - window_start)
          mfu = rate * step_flops / tokens_per_step / peak if peak else None
          last.update(tokens_per_s=rate, mfu=mfu, learning_rate=float(schedule(done - 1)))
          if cfg.train.eval_every and eval_batches and (done % cfg.train.eval_every == 0 or done == cfg.train.steps):
            last.update(evaluate(trainer, state["params"], eval_batches, cfg.train.seed))
          summaries.write(last)
          bound = cfg.objective.name == "masked_diffusion"
          status = _status(last, cfg.train.steps, bound)
          if done < cfg.train.steps:  # At the window's rate: evaluations and checkpoints come on top.
            status += f" | about {duration((cfg.train.steps - done) * tokens_per_step / rate)} left"
          progress.show(status, final=done == cfg.train.steps)
        if save_now:
          checkpointer.save(state, data_iter, cfg)
        if log_now or step == start_step:  # Compilation, evaluation and saving stay out of the throughput window.
          window_start, window_tokens = time.perf_counter(), 0.0
        if preempted:
          progress.show(f"{preemption.describe()}: saved step {done} to {checkpointer.directory}", final=True)
          break
  finally:
    checkpointer.close()
    summaries.close()
  return last


def _finish_step(step: int, metrics, *, cfg: Config) -> dict[str, Any]:
  values = {k: float(v) for k, v in jax.device_get(metrics).items()}
  if not math.isfinite(values["loss"]) or not math.isfinite(values["grad_norm"]):
    raise NonFiniteLoss(
      f"non-finite loss {values['loss']} (grad norm {values['grad_norm']}) at step {step}; the "
      f"update was discarded and no checkpoint was written after it. Lower optim.learning_rate "
      f"(now {cfg.optim.learning_rate}) or check the data."
    )
  extra = {k: values[k] for k in (*(f"{h}_loss" for h in HALVES), "draft_kl", "schedule_fit") if k in values}
  return {"step": step, "loss": values["loss"], "grad_norm": values["grad_norm"], **extra}


def _status(m: dict[str, Any], total: int, bound: bool) -> str:
  mfu = "n/a" if m["mfu"] is None else f"{100 * m['mfu']:.1f}%"
  loss = f"loss {m['loss']:.4f}"
  if "ar_loss" in m:  # verified: the weighted mean, then the verifier's and the drafter's own losses
    loss += f" (ar {m['ar_loss']:.4f}, draft {m['draft_loss']:.4f}, kl {m['draft_kl']:.4f})"
  text = f"step {m['step']}/{total} | {loss} | {m['tokens_per_s']:,.0f} tok/s | MFU {mfu}"
  if "eval_ar_nats_per_token" in m:
    ppl = f"ppl {m['eval_perplexity_bound']:.2f}"  # The verifier's exact NLL.
    text += f" | eval ar {m['eval_ar_nats_per_token']:.4f} nats/tok ({ppl}), draft {m['eval_draft_nats_per_token']:.4f}"
    text += f", kl {m['eval_draft_kl']:.4f}"
  elif "eval_nats_per_token" in m:
    ppl = f"ppl {'<= ' if bound else ''}{m['eval_perplexity_bound']:.2f}"  # An ELBO bounds it; the AR NLL is exact.
    text += f" | eval {m['eval_nats_per_token']:.4f} nats/tok ({ppl})"
  return text


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m mercury_jax.train", description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="default", help="a preset name from configs/ or a TOML file")
  parser.add_argument("--workdir", required=True, help="checkpoints, metrics.jsonl and config.json go here")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
  parser.add_argument(
    "--init-from",
    metavar="CHECKPOINT",
    help="start from the parameters of a train workdir, checkpoint folder or exported model (e.g. "
    "mercury_jax/assets/default_ar), with a fresh optimiser and step 0; their shapes must match the new model's (a "
    "continuous model's latent parameters may be new: they start from their initialisation). Ignored when --workdir "
    "already holds a checkpoint: that run resumes instead",
  )
  distributed.add_arguments(parser)
  args = parser.parse_args(argv)
  try:
    cfg = load_config(args.config, parse_set_args(args.set))
    if "://" in args.workdir:
      raise ConfigError(
        f"--workdir {args.workdir!r} must be a filesystem path; mount the bucket on every host (e.g. with gcsfuse) "
        "or use a shared filesystem such as NFS"
      )
    if not cfg.data.path:
      raise ConfigError(
        "data.path is empty; prepare data with `python -m mercury_jax.prepare --corpus python-stdlib "
        "--out DATA_DIR` and pass --set data.path=DATA_DIR"
      )
    _check_data(cfg, pipeline.read_metadata(cfg.data.path))  # Bad data is a usage error: report it before starting.
  except (ConfigError, ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  try:
    distributed.initialize(args)
    train(cfg, args.workdir, init_from=args.init_from)
  except (ConfigError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  except NonFiniteLoss as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(1) from None


if __name__ == "__main__":
  main()
