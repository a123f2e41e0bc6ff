"""The continuous family's step rule: the probability-flow ODE over a block's token latents, in the one engine.

For the variance-exploding process of ``objectives.continuous`` (``z = e + sigma * eps``) the probability-flow ODE
(Song et al. 2021; Karras et al. 2022, EDM, eq. 1 with ``s = 1``) is

    dz / dsigma = -sigma * grad_z log p(z; sigma) = (z - D(z, sigma)) / sigma,

where ``D(z, sigma) = E_p[e]`` is the denoiser: the network's predicted distribution over clean tokens times the
latent table (score interpolation, ``continuous.score``). A block's latents start at ``z ~ N(0, (sigma_max^2 + 1)
I)`` (the marginal of normalised latents at sigma_max, to within a Gaussian approximation) and are carried down a
decreasing ladder of noise levels by Euler steps or Heun's second-order correction (EDM's Algorithm 1); at
``sigma_min`` the latents are projected to tokens by the last predicted distribution.

Every function here is one step, with no loop: the engine's loop over steps is the only loop, as for every other
step rule. :func:`step` takes ``denoise: (z, sigma) -> D``, so the same code serves the network and the exact
denoiser of the tests.

**In the engine** (:class:`LatentRule`, ``settings.rule = "ode"``) a row's step block is a latent ``[B, d]``
(``State.latent``). With ``n`` steps per block, step ``j`` runs the network at noise level ``sigma_j`` of
:func:`block_ladder` (``sigma_max`` first, ``sigma_min`` last): the block's open positions read their latents, its
fixed positions (template text, forced tokens) and the cache before it stay clean tokens. The predicted
distribution is cleaned as every proposal's is (``proposal.clean_logits``; token healing's and structured output's
restrictions, see below) and its expectation over the latent table is the denoiser ``D``; the latents then take one
solver step to ``sigma_{j+1}``. The last step moves nothing: the loop commits every open position to its proposal
(argmax at temperature 0, otherwise a draw from the tempered, top-k/top-p filtered distribution at ``sigma_min``),
and the next block's first step writes the clean keys and values into the exact cache, as for block diffusion.
A block's initial latents are drawn from its first step's key (``LATENT_NOISE``), so a row's tokens depend on its
own key only. Classifier-free guidance (``settings.guidance = w``) replaces the block's logits by
``l_u + w (l_c - l_u)`` before both the proposals and the denoiser, ``l_u`` from a pass with the context hidden.
Everything else is the engine's: EOS, templates, streaming (the proposals of each step are the draft), batch
buckets, meshes.

**Structured output.** A constrained row's proposals are the most probable valid string of its block (the
automaton's dynamic program, ``sampling.automata.propose``), at every step. The denoiser's distribution at each
position is restricted to the tokens the automaton allows after the proposal's earlier tokens
(:meth:`~mercury_jax.sampling.hooks.Structured.allowed_along`), so the latents move towards valid text; and what the
last step commits is the dynamic program's string, valid by construction, exactly as in discrete decoding.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from mercury_jax.config import ObjectiveConfig
from mercury_jax.limits import SOLVERS
from mercury_jax.sampling.caches import Forward, Needs, Strategy
from mercury_jax.sampling.hooks import Hooks, View
from mercury_jax.sampling.network import LatentInputs, Network
from mercury_jax.sampling.plan import BlockPlan
from mercury_jax.sampling.proposal import clean_logits
from mercury_jax.sampling.refine import Refine
from mercury_jax.sampling.settings import SamplerSettings
from mercury_jax.sampling.state import Latents, State, rows, select_rows
from mercury_jax.sampling.step import Decision

Denoiser = Callable[[jax.Array, jax.Array], jax.Array]  # (z [..., d], sigma []) -> D(z, sigma) [..., d]


def sigma_ladder(cfg: ObjectiveConfig, steps: int, rho: float = 7.0) -> jax.Array:
  """``steps + 1`` noise levels from ``sigma_max`` down to ``sigma_min`` (EDM's spacing: uniform in
  ``sigma^(1/rho)``, so steps are dense at low noise, where tokens are decided)."""
  if steps < 1:
    raise ValueError(f"steps={steps} must be >= 1")
  i = jnp.arange(steps + 1, dtype=jnp.float32) / steps
  hi, lo = cfg.sigma_max ** (1.0 / rho), cfg.sigma_min ** (1.0 / rho)
  return (hi + i * (lo - hi)) ** rho


def initial_latents(key: jax.Array, shape: tuple[int, ...], cfg: ObjectiveConfig) -> jax.Array:
  """Latents at ``sigma_max``: ``N(0, (sigma_max^2 + 1) I)``, ``shape = [..., d]``."""
  return jnp.sqrt(cfg.sigma_max**2 + 1.0) * jax.random.normal(key, shape)


def step(denoise: Denoiser, z: jax.Array, sigma: jax.Array, sigma_next: jax.Array, solver: str = "euler"):
  """One solver step of the probability-flow ODE from ``sigma`` to ``sigma_next`` (< ``sigma``).

  Args:
    denoise: ``(z, sigma) -> D(z, sigma)``, the denoiser's estimate of the clean latents.
    z: latents at ``sigma``, [..., d].
    sigma, sigma_next: scalars (traced or not).
    solver: ``euler`` (one denoiser call) or ``heun`` (two: Euler, then the trapezoid of the two slopes).

  Returns:
    The latents at ``sigma_next``.
  """
  if solver not in SOLVERS:
    raise ValueError(f"solver={solver!r} must be one of {SOLVERS}")
  slope = (z - denoise(z, sigma)) / sigma
  euler = z + (sigma_next - sigma) * slope
  if solver == "euler":
    return euler
  slope_next = (euler - denoise(euler, sigma_next)) / sigma_next
  return z + (sigma_next - sigma) * 0.5 * (slope + slope_next)


RHO = 7.0  # EDM's ladder exponent.
LATENT_NOISE = 0x6C74  # Folded into a block's first step key for its initial latents.


def block_ladder(step: jax.Array, steps: jax.Array, cfg: ObjectiveConfig) -> jax.Array:
  """The noise level of engine step ``step`` of a block of ``steps`` steps ([b] each): :func:`sigma_ladder`'s spacing
  over ``steps`` levels, ``sigma_max`` at step 0 and ``sigma_min`` at the last (one step: ``sigma_max``, where the
  network's prediction is each token's marginal)."""
  frac = step.astype(jnp.float32) / jnp.maximum(steps - 1, 1).astype(jnp.float32)
  hi, lo = cfg.sigma_max ** (1.0 / RHO), cfg.sigma_min ** (1.0 / RHO)
  return (hi + jnp.minimum(frac, 1.0) * (lo - hi)) ** RHO


class LatentRule:
  """The ``ode`` rule's part of every step (module docstring): :meth:`start` before the forward pass, :meth:`move`
  after the proposals.

  Args:
    settings: The sampler settings (``solver``, ``self_conditioning``, the objective's noise range).
    block: The plan's block size.
    latent_dim: The checkpoint's latent width.
  """

  def __init__(self, settings: SamplerSettings, block: int, latent_dim: int):
    self.cfg, self.solver, self.block, self.dim = settings.objective, settings.solver, block, latent_dim
    self.self_cond = settings.self_conditioning and settings.objective.self_conditioning > 0

  def empty(self, batch: int) -> Latents:
    zeros = jnp.zeros((batch, self.block, self.dim), jnp.float32)
    return Latents(zeros, zeros)

  def start(self, st: State, keys: jax.Array, open_: jax.Array, steps: jax.Array) -> tuple[LatentInputs, State]:
    """The step's network inputs for the block's open positions, and the state with a block's initial latents drawn
    at its first step (``keys``: [b] the step's keys; ``steps``: [b] the block's steps)."""
    first = (st.step == 0)[:, None, None]
    drawn = jax.vmap(lambda k: initial_latents(jax.random.fold_in(k, LATENT_NOISE), (self.block, self.dim), self.cfg))
    z = jnp.where(first, drawn(keys), st.latent.z)
    estimate = jnp.where(first, 0.0, st.latent.estimate)
    sigma = block_ladder(st.step, steps, self.cfg)
    level = jnp.where(open_, sigma[:, None], 0.0)
    return LatentInputs(z, level, estimate if self.self_cond else None), st._replace(latent=Latents(z, estimate))

  def move(
    self,
    st: State,
    inputs: LatentInputs,
    denoised: jax.Array,
    steps: jax.Array,
    again: Callable[[LatentInputs], jax.Array],
  ) -> tuple[State, jax.Array]:
    """The state with the block's latents one solver step lower, and [b] bool: rows that ran a second pass (Heun).

    Args:
      st: The state (``st.latent`` as :meth:`start` left it).
      inputs: This step's network inputs (:meth:`start`).
      denoised: [b, B, d] the denoiser's estimate of the clean latents at this step (the expected latent under the
        step's cleaned, restricted and guided distribution).
      steps: [b] the block's steps.
      again: ``inputs -> denoised`` of another pass over the block (Heun's correction), computed the same way.
    """
    sigma = block_ladder(st.step, steps, self.cfg)
    moves = st.step < steps - 1  # the last step commits instead
    sigma_next = block_ladder(jnp.minimum(st.step + 1, steps - 1), steps, self.cfg)
    open_ = inputs.noise_level > 0
    sig, nxt = sigma[:, None, None], sigma_next[:, None, None]
    z = inputs.latents
    slope = (z - denoised) / sig
    euler = z + (nxt - sig) * slope
    estimate, second = denoised, jnp.zeros_like(moves)
    if self.solver == "heun":
      second = moves & jnp.any(open_, axis=-1)

      def corrected():
        level = jnp.where(open_, sigma_next[:, None], 0.0)
        d2 = again(LatentInputs(euler, level, denoised if self.self_cond else None))
        return z + (nxt - sig) * 0.5 * (slope + (euler - d2) / nxt), d2

      euler, estimate = jax.lax.cond(jnp.any(second), corrected, lambda: (euler, denoised))
    z = jnp.where((moves[:, None] & open_)[..., None], euler, z)
    return st._replace(latent=Latents(z, estimate)), second


class Flow(Refine):
  """The ``ode`` rule in the engine's step (module docstring): a :class:`~mercury_jax.sampling.refine.Refine` whose
  proposals commit only at the block's last step, while the block's latents take one solver step towards the
  (guided, restricted) denoiser's expectation at every step.

  Args:
    plan, settings, network: As for :class:`~mercury_jax.sampling.refine.Refine`.
    cache: The cache strategy (classifier-free guidance's unconditional pass and Heun's second pass run through it).
  """

  def __init__(self, plan: BlockPlan, settings: SamplerSettings, network: Network, cache: Strategy):
    if plan.cache not in ("exact", "none") or plan.draft or not network.latent_dim:
      raise ValueError(f"rule 'ode' decodes a continuous checkpoint with cache 'exact' or 'none' (plan: {plan})")
    super().__init__(plan, settings, network)
    self.cache, self.moving = cache, True
    self.latents = LatentRule(settings, plan.block, network.latent_dim)

  def empty(self, batch: int) -> dict:
    return {**super().empty(batch), "latent": self.latents.empty(batch)}

  def needs(self, st: State, view: View) -> tuple[Needs, State]:
    needs, st = super().needs(st, view)
    latent, st = self.latents.start(st, view.keys, view.open, self.block_steps(st))
    return needs._replace(latent=latent), st

  def decide(self, params, st: State, view: View, needs: Needs, forward: Forward, hooks: Hooks) -> Decision:
    unfinished = jnp.any(st.generate & (st.z == self.settings.mask_id), axis=-1)
    st = st._replace(cache=forward.cache)
    st = st._replace(logits=self._guided(params, st, needs, forward.logits))
    view, _, x0, confidence, st = self.propose(st, view, st.logits, hooks)
    st, heun = self._move(params, st, view, needs, hooks, x0)
    decision = self.settle(st, view, hooks, x0, confidence)
    guided = int(self.settings.guidance != 1.0)  # guidance's unconditional pass; Heun's second (guided: two)
    extra = guided * (forward.ran & needs.logits & unfinished).astype(jnp.int32) + (1 + guided) * heun.astype(jnp.int32)
    return decision._replace(preview=x0, extra=extra)

  def _move(self, params, st: State, view: View, needs: Needs, hooks: Hooks, x0):
    """The solver step (:meth:`LatentRule.move`): the denoiser's distribution is the step's (guided) logits after
    the hooks, cleaned as the proposals' are, and restricted along a constrained row's valid proposal ``x0``."""
    block, settings = self.plan.block, self.settings
    eos_banned = rows(st.eos_banned, view.starts, block)
    allowed = hooks.allowed(st, view.slots, jnp.where(view.open, x0, view.z), False)
    table = self.network.latent_table(params)

    def expected(logits, eos_banned, allowed):  # of one group of rows (Network.map_rows)
      clean = clean_logits(logits, eos_banned, settings)
      if allowed is not None:
        restricted = jnp.where(allowed, clean, -jnp.inf)
        clean = jnp.where(jnp.any(restricted > -jnp.inf, axis=-1, keepdims=True), restricted, clean)
      return jax.nn.softmax(clean, axis=-1) @ table

    def distribution(logits):  # the expected latent [b, B, d] under the step's distribution
      return self.network.map_rows(expected, hooks.logits(st, view, logits), eos_banned, allowed)

    def again(inputs):  # Heun's second pass: the block alone, nothing committed (the cache is not changed).
      second = Needs(view.starts, needs.t, needs.logits, jnp.zeros_like(needs.logits), inputs)
      return distribution(self._guided(params, st, second, self.cache.forward(params, st, second).logits))

    return self.latents.move(st, needs.latent, distribution(st.logits), self.block_steps(st), again)

  def _guided(self, params, st: State, needs: Needs, logits: jax.Array) -> jax.Array:
    """Classifier-free guidance of a continuous checkpoint's block logits (``settings.guidance = w``, 1: off):
    ``l_u + w (l_c - l_u)``, with ``l_u`` the block's logits with the context hidden
    (:meth:`~mercury_jax.sampling.caches.Strategy.unconditional`), run only when some row wants logits."""
    w = self.settings.guidance
    if w == 1.0:
      return logits

    def run():
      unconditional = self.cache.unconditional(params, st, needs)
      return unconditional + w * (logits - unconditional)

    return select_rows(needs.logits, jax.lax.cond(jnp.any(needs.logits), run, lambda: logits), logits)
