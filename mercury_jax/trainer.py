"""Sharded train state, optimiser, and the jitted train and eval steps (one trainer for every mesh).

The state is a plain dict ``{"step", "params", "opt_state", "key"}`` so Orbax saves and restores it without
custom handlers. It is built ``eval_shape -> logical partition specs -> shardings -> jit(init, out_shardings)``
(MaxText's recipe), so no unsharded copy of the parameters ever exists.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn, traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mercury_jax import kinds as K, objectives, sharding as sh
from mercury_jax.config import Config, ObjectiveConfig, OptimConfig
from mercury_jax.model import (  # noqa: F401  (re-exported)
  Transformer,
  abstract_params,
  init_params,
  is_draft_param,
  param_shardings,
)

State = dict[str, Any]
Batch = dict[str, jax.Array]
HALVES = ("ar", "draft")  # A verified objective's two losses: the verifier's (next token) and the drafter's.


def verified_losses(totals: dict[str, float], cfg: ObjectiveConfig) -> dict[str, float]:
  """A ``verified`` objective's per-token losses from sums over batches: ``{"ar", "draft", "draft_kl", "loss"}``
  (``loss`` the weighted mean ``(α · ar + draft + λ · draft_kl) / (1 + α)``, ``objectives.verified``)."""
  out = {half: totals[f"{half}_loss_sum"] / max(totals[f"{half}_tokens"], 1.0) for half in HALVES}
  out["draft_kl"] = totals.get("draft_kl_sum", 0.0) / max(totals["draft_tokens"], 1.0)
  alpha = cfg.ar_weight
  out["loss"] = (alpha * out["ar"] + out["draft"] + cfg.draft_kl_weight * out["draft_kl"]) / (1.0 + alpha)
  return out


def learning_rate_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to ``learning_rate``, then cosine decay to ``learning_rate * final_lr_fraction``."""
  warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=cfg.learning_rate,
    warmup_steps=warmup,
    decay_steps=max(total_steps, warmup + 1),
    end_value=cfg.learning_rate * cfg.final_lr_fraction,
  )


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
  """AdamW on :func:`learning_rate_schedule`, after global-norm clipping; no weight decay on norm scales."""
  schedule = learning_rate_schedule(cfg, total_steps)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
  return optax.chain(
    optax.clip_by_global_norm(cfg.clip_norm),
    optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask),
  )


def loss_terms(
  params,
  batch: Batch,
  key: jax.Array,
  model: Transformer,
  cfg: Config,
  *,
  training: bool = False,
  draft: str | None = None,
) -> dict[str, jax.Array]:
  """The configured objective's sums for one batch (``mercury_jax.objectives``).

  ``training`` is True only in the train step: it applies the clipped schedule (``objective.mask_rate_min/max``);
  evaluation integrates the whole schedule so its diffusion estimate is a bound. ``draft`` picks how a ``verified``
  objective noises its draft half (``objectives.verified.DRAFTS``; default: what ``training`` implies).
  """
  segment_ids = batch["segments"] if "segments" in batch else K.segment_ids(batch["kinds"])
  use_t = cfg.model.time_conditioning

  def logits_fn(tokens, t, **overrides):  # objectives.LogitsFn: overrides replace the batch's defaults.
    kwargs = {"segment_ids": segment_ids, **overrides}
    return model.apply({"params": params}, tokens, t if use_t else None, **kwargs)

  return objectives.loss_terms(
    logits_fn,
    batch["tokens"],
    batch["kinds"],
    key,
    cfg.objective,
    segment_ids=segment_ids,
    training=training,
    draft=draft,
  )


class Trainer:
  """Builds the model, the optimiser, the sharded state and the compiled steps for one config on one mesh."""

  def __init__(self, cfg: Config, mesh: Mesh):
    self.cfg, self.mesh = cfg, mesh
    self.rules = sh.axis_rules(cfg.mesh)
    self.model = Transformer(cfg.model)
    self.optimizer = make_optimizer(cfg.optim, cfg.train.steps)
    for name in ("batch_size", "distill_batch_size"):
      if getattr(cfg.data, name) % sh.data_parallel_size(mesh, self.rules):
        raise ValueError(
          f"data.{name}={getattr(cfg.data, name)} must be a multiple of the mesh's data-parallel size "
          f"{sh.data_parallel_size(mesh, self.rules)}"
        )
    self.batch_sharding = sh.batch_sharding(mesh, self.rules, 2)
    self.state_shardings = self._state_shardings()
    self._eval_steps = {}  # draft mode -> compiled eval step

  # -------------------------------------------------------------------------------------------- state
  def _init_state(self, key: jax.Array) -> State:
    init_key, train_key = jax.random.split(key)
    params = nn.meta.unbox(init_params(self.model, init_key))
    return {
      "step": jnp.zeros((), jnp.int32),
      "params": params,
      "opt_state": self.optimizer.init(params),
      "key": train_key,
    }

  def _state_shardings(self):
    param_sh = param_shardings(self.model, self.mesh, self.rules)
    replicated = NamedSharding(self.mesh, P())
    abstract = jax.eval_shape(self._init_state, jax.random.key(0))
    opt_sh = optax.tree_map_params(
      self.optimizer, lambda _, s: s, abstract["opt_state"], param_sh, transform_non_params=lambda _: replicated
    )
    return {"step": replicated, "params": param_sh, "opt_state": opt_sh, "key": replicated}

  def abstract_state(self) -> State:
    """Shape, dtype and sharding of the state, as a restore target."""
    abstract = jax.eval_shape(self._init_state, jax.random.key(0))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, self.state_shardings)

  def init_state(self, seed: int) -> State:
    return sh.MeshJit(self._init_state, self.mesh, self.rules, out_shardings=self.state_shardings)(jax.random.key(seed))

  # -------------------------------------------------------------------------------------------- steps
  def _train_step(self, state: State, batch: Batch) -> tuple[State, dict[str, jax.Array]]:
    key = jax.random.fold_in(state["key"], state["step"])

    trainable = self._trainable(state["params"])

    def objective(params):
      # A frozen parameter's gradient is a symbolic zero: its backward matmuls are never built.
      params = jax.tree.map(lambda p, t: p if t else jax.lax.stop_gradient(p), params, trainable)
      terms = loss_terms(params, batch, key, self.model, self.cfg, training=True)
      # An objective's auxiliary fit (the continuous family's learned noise schedule) trains its own parameters.
      return terms["loss_sum"] / jnp.maximum(terms["tokens"], 1.0) + terms.get("aux_loss", 0.0), terms

    (loss, terms), grads = jax.value_and_grad(objective, has_aux=True)(state["params"])
    updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
    updates = jax.tree.map(lambda u, t: u if t else jnp.zeros_like(u), updates, trainable)  # Weight decay too.
    params = optax.apply_updates(state["params"], updates)
    grad_norm = optax.tree.norm(grads)
    new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state, "key": state["key"]}
    # A non-finite loss or gradient discards the update: the returned state is the incoming one, so the host can
    # stop with an error and no bad parameters can ever reach a checkpoint.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state)
    loss = terms["loss_sum"] / jnp.maximum(terms["tokens"], 1.0)  # The objective's own loss, without a fit's.
    metrics = {"loss": loss, "grad_norm": grad_norm, "tokens": terms["tokens"]}
    for half in HALVES if self.cfg.objective.verified else ():  # The verifier's and the drafter's own losses.
      metrics[f"{half}_loss"] = terms[f"{half}_loss_sum"] / jnp.maximum(terms[f"{half}_tokens"], 1.0)
    if self.cfg.objective.verified:
      metrics["draft_kl"] = terms["draft_kl_sum"] / jnp.maximum(terms["draft_tokens"], 1.0)
    if "schedule_fit" in terms:
      metrics["schedule_fit"] = terms["schedule_fit"]
    return new_state, metrics

  def _trainable(self, params) -> Any:
    """The tree of ``params``' bools: which the optimiser moves (``train.trainable``)."""
    if self.cfg.train.trainable == "all":
      return jax.tree.map(lambda _: True, params)
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({key: is_draft_param(key) for key in flat})

  def _eval_step(self, params, batch: Batch, key: jax.Array, draft: str | None = None) -> dict[str, jax.Array]:
    terms = loss_terms(params, batch, key, self.model, self.cfg, training=False, draft=draft)
    return {k: v for k, v in terms.items() if k not in ("masked", "aux_loss", "schedule_fit")}

  @property
  def batch_keys(self) -> tuple[str, ...]:
    """The arrays of a batch (``[batch, length]`` int32 each): tokens, kinds and, with ``data.document_segments``,
    the segments that keep packed documents apart."""
    return ("tokens", "kinds", "segments") if self.cfg.data.document_segments else ("tokens", "kinds")

  @functools.cached_property
  def train_step(self):
    """``(state, batch) -> (state, metrics)``; the incoming state is donated."""
    batch_sh = dict.fromkeys(self.batch_keys, self.batch_sharding)
    return sh.MeshJit(
      self._train_step,
      self.mesh,
      self.rules,
      in_shardings=(self.state_shardings, batch_sh),
      out_shardings=(self.state_shardings, None),
      donate_argnums=(0,),
    )

  @functools.cached_property
  def eval_step(self):
    """``(params, batch, key) -> sums`` (``{"loss_sum", "tokens"}``, and a ``verified`` objective's halves)."""
    return self.eval_step_for(None)

  def eval_step_for(self, draft: str | None):
    """:attr:`eval_step` with a ``verified`` objective's draft half noised as ``draft`` (``verified.DRAFTS``)."""
    if draft not in self._eval_steps:
      batch_sh = dict.fromkeys(self.batch_keys, self.batch_sharding)
      self._eval_steps[draft] = sh.MeshJit(
        functools.partial(self._eval_step, draft=draft),
        self.mesh,
        self.rules,
        in_shardings=(self.state_shardings["params"], batch_sh, None),
      )
    return self._eval_steps[draft]

  def eval_sums(
    self, params, batches: list[Batch], key: jax.Array, draft: str | None = None, on_batch: Callable | None = None
  ) -> dict[str, float]:
    """The objective's sums over ``batches``, batch i drawn with ``fold_in(key, i)``; ``on_batch()`` after each."""
    totals: dict[str, float] = {}
    for i, batch in enumerate(batches):
      out = jax.device_get(self.eval_step_for(draft)(params, batch, jax.random.fold_in(key, i)))
      for name, value in out.items():
        totals[name] = totals.get(name, 0.0) + float(value)
      if on_batch is not None:
        on_batch()
    return totals

  def nats_per_token(self, params, batches: list[Batch], key: jax.Array, on_batch: Callable | None = None) -> float:
    """The objective over ``batches`` (batch i drawn with ``fold_in(key, i)``), in nats per target token.

    For diffusion this is one Monte Carlo draw of the negative ELBO per sequence; for the AR twin the exact NLL;
    for ``verified`` the weighted mean of its halves' losses (:func:`verified_losses`).
    """
    totals = self.eval_sums(params, batches, key, on_batch=on_batch)
    if self.cfg.objective.verified:
      return verified_losses(totals, self.cfg.objective)["loss"]
    return totals["loss_sum"] / max(totals["tokens"], 1.0)

  def lower_train_step(self):
    """Lowers the train step from abstract values only (ahead-of-time compile checks of big presets)."""
    b, length = self.cfg.data.rows, self.cfg.model.max_length
    batch = {k: jax.ShapeDtypeStruct((b, length), jnp.int32, sharding=self.batch_sharding) for k in self.batch_keys}
    return self.train_step.lower(self.abstract_state(), batch)
