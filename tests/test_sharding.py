"""One trainer for every mesh: a sharded step equals the single-device step, and parameters really are sharded."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mercury_jax import sharding as sh
from mercury_jax.config import MeshConfig, load_config
from mercury_jax.trainer import Trainer, loss_terms

CFG = load_config(
  "tiny",
  {
    "model.vocab_size": "256",
    "model.max_length": "32",
    "model.num_kv_heads": "2",
    "model.time_conditioning": "true",
    "optim.warmup_steps": "0",
  },
)


def _batch(seed: int) -> dict[str, jax.Array]:
  rng = np.random.default_rng(seed)
  kinds = np.full((8, 32), 2, np.int32)
  kinds[:2, :6] = 1  # Two conditional examples with prompts...
  kinds[:2, -5:] = 0  # ...and padding.
  return {"tokens": jnp.asarray(rng.integers(5, 256, (8, 32)), jnp.int32), "kinds": jnp.asarray(kinds)}


def _run(cfg, devices, steps=2):
  trainer = Trainer(cfg, sh.make_mesh(cfg.mesh, devices))
  state = trainer.init_state(seed=0)
  losses = []
  for i in range(steps):
    batch = jax.device_put(_batch(i), trainer.batch_sharding)
    state, metrics = trainer.train_step(state, batch)
    losses.append(float(metrics["loss"]))
  return trainer, state, losses


# float32's unit roundoff. Summing n terms in another order (another mesh splits and reduces them differently) moves
# the result by up to about n * u * sum|x_i| (Higham, "Accuracy and Stability of Numerical Algorithms", 2002, §4.2).
U_F32 = 2.0**-24
TERMS = 8 * 32  # Tokens per batch: the longest reduction feeding a gradient entry.
GRAD_ATOL = 10 * TERMS * U_F32  # Relative to each leaf's largest entry; 10x for composing it through the layers.


def _with_objective(cfg, objective):
  if objective == "autoregressive":
    cfg = dataclasses.replace(
      cfg,
      model=dataclasses.replace(cfg.model, causal=True, time_conditioning=False),
      objective=dataclasses.replace(cfg.objective, name="autoregressive"),
    )
  return cfg


def _gradients(cfg, devices, batch):
  trainer = Trainer(cfg, sh.make_mesh(cfg.mesh, devices))
  state = trainer.init_state(seed=0)
  key = jax.random.fold_in(state["key"], 0)

  def objective(params, batch):
    terms = loss_terms(params, batch, key, trainer.model, cfg)
    return terms["loss_sum"] / terms["tokens"]

  grad_fn = sh.MeshJit(
    jax.value_and_grad(objective),
    trainer.mesh,
    trainer.rules,
    in_shardings=(trainer.state_shardings["params"], trainer.batch_sharding),
  )
  loss, grads = grad_fn(state["params"], jax.device_put(batch, trainer.batch_sharding))
  return float(loss), jax.tree.map(np.asarray, grads)


@pytest.mark.parametrize("objective", ["masked_diffusion", "autoregressive"])
def test_sharded_loss_and_gradients_equal_single_device(objective, capfd):
  cfg = _with_objective(CFG, objective)
  batch = _batch(0)
  single_loss, single = _gradients(dataclasses.replace(cfg, mesh=MeshConfig(data=1)), jax.devices()[:1], batch)
  capfd.readouterr()
  sharded_loss, sharded = _gradients(dataclasses.replace(cfg, mesh=MeshConfig(2, 2, 2)), jax.devices(), batch)
  # GSPMD replicating a tensor because two sharding annotations disagree is a sharding bug, even when the numbers
  # come out right.
  assert "Involuntary full rematerialization" not in capfd.readouterr().err
  np.testing.assert_allclose(sharded_loss, single_loss, rtol=TERMS * U_F32)
  for path, a in jax.tree_util.tree_leaves_with_path(single):
    b = sharded
    for entry in path:
      b = b[entry.key]
    scale = float(np.abs(a).max())  # 0 for time_in: time_out starts at zero, so nothing flows into time_in yet.
    np.testing.assert_allclose(b, a, atol=GRAD_ATOL * scale, rtol=0, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("objective", ["masked_diffusion", "autoregressive"])
def test_sharded_train_steps_equal_single_device(objective, capfd):
  # Adam's first update is g / (sqrt(g^2) + eps): with a tiny eps, reduction-order rounding in a near-zero gradient
  # flips a whole learning-rate step. A large eps makes the update continuous in g (about lr * g / eps), so equal
  # gradients must give equal parameters; the gradients themselves are compared in the test above.
  cfg = _with_objective(CFG, objective)
  cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, eps=1.0))
  _, single, single_losses = _run(dataclasses.replace(cfg, mesh=MeshConfig(data=1)), jax.devices()[:1])
  capfd.readouterr()
  _, sharded, sharded_losses = _run(dataclasses.replace(cfg, mesh=MeshConfig(data=2, fsdp=2, tensor=2)), jax.devices())
  assert "Involuntary full rematerialization" not in capfd.readouterr().err
  np.testing.assert_allclose(sharded_losses, single_losses, rtol=TERMS * U_F32)
  # One step moves a parameter by about lr * |g| <= 1e-3 * 1 here; a gradient error within GRAD_ATOL moves it by a
  # thousandth of that. A sharding bug (a missing reduction, a wrong scale) moves it by a whole update.
  atol = 2 * cfg.optim.learning_rate * GRAD_ATOL
  for a, b in zip(jax.tree.leaves(single["params"]), jax.tree.leaves(sharded["params"]), strict=True):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=atol, rtol=0)
  assert int(sharded["step"]) == 2


def test_parameters_are_sharded_per_the_rules():
  cfg = dataclasses.replace(CFG, mesh=MeshConfig(data=2, fsdp=2, tensor=2))
  trainer = Trainer(cfg, sh.make_mesh(cfg.mesh))
  state = trainer.init_state(seed=0)
  params = state["params"]
  assert params["blocks"]["attention"]["query"].sharding.spec == jax.P(None, "fsdp", "tensor", None)
  assert params["blocks"]["mlp"]["down"].sharding.spec == jax.P(None, "tensor", "fsdp")
  assert params["embedding"].sharding.spec == jax.P("tensor", "fsdp")
  # Every large parameter holds at most a quarter of its elements on each device (MaxText-style check).
  total = sum(p.size for p in jax.tree.leaves(params))
  per_device = sum(math.prod(p.sharding.shard_shape(p.shape)) for p in jax.tree.leaves(params))
  assert per_device / total < 0.3, per_device / total
  # Optimiser moments follow their parameters.
  mu = state["opt_state"][1][0].mu
  assert mu["blocks"]["attention"]["query"].sharding.spec == params["blocks"]["attention"]["query"].sharding.spec


def test_nonfinite_loss_keeps_the_previous_state():
  cfg = dataclasses.replace(CFG, mesh=MeshConfig(data=1))
  trainer = Trainer(cfg, sh.make_mesh(cfg.mesh, jax.devices()[:1]))
  state = trainer.init_state(seed=0)
  before = jax.tree.map(np.asarray, state["params"])
  poisoned = dict(state, params=jax.tree.map(lambda p: p, state["params"]))
  poisoned["params"]["final_norm"]["scale"] = state["params"]["final_norm"]["scale"] * jnp.nan
  new, metrics = trainer.train_step(poisoned, jax.device_put(_batch(0), trainer.batch_sharding))
  assert not np.isfinite(float(metrics["loss"]))
  assert int(new["step"]) == 0
  np.testing.assert_array_equal(np.asarray(new["params"]["blocks"]["mlp"]["up"]), before["blocks"]["mlp"]["up"])
