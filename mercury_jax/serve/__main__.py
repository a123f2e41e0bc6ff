"""``python -m mercury_jax.serve [--checkpoint DIR] [--port 8000] ...``: an OpenAI-compatible HTTP server.

Examples::

  python -m mercury_jax.serve                                   # the bundled model on http://127.0.0.1:8000
  python -m mercury_jax.serve --checkpoint runs/tiny_bd --slots 32 --port 8080
  curl http://127.0.0.1:8000/v1/completions -H 'content-type: application/json' \\
    -d '{"prompt": "def fibonacci(n):", "max_tokens": 64, "stream": true}'

The endpoints and the streaming format are described in :mod:`mercury_jax.serve.routes`. The server prints
``serving MODEL on http://HOST:PORT`` once it listens (``--port 0`` picks a free port). On SIGTERM or Ctrl-C it keeps
listening but ``/health`` answers 503 and new requests 503, running requests get ``--grace`` seconds to finish, those
still running then end with a 503 (a stream: an error event, then ``[DONE]``), and the process exits 0
(:mod:`mercury_jax.serve.draining`; a second signal ends the grace at once). Bad flags get one line on stderr and
exit code 2. Compiled programs are kept in ``~/.cache/mercury_jax/xla`` as for ``python -m mercury_jax.sample``.

Exposed servers: ``--host 0.0.0.0`` without ``--api-key`` (or ``MERCURY_API_KEY``) lets anyone on the network use
the model. With a key, ``/v1/...`` and ``/openapi.json`` need ``Authorization: Bearer KEY``; ``/health`` and
``/metrics`` stay open. ``--max-body-bytes``, ``--body-timeout``, ``--request-timeout``, ``--compile-workers`` and
``--compile-timeout`` bound what one request can cost (see :mod:`mercury_jax.serve.guard` and
:mod:`mercury_jax.serve.compiling`). Errors and their details go
to stderr (logger ``mercury_jax.serve``); clients see a fixed message and a request id.

Multi-host: start the same command on every host with ``--coordinator HOST:PORT --num-processes N --process-id I``
(or under SLURM, ``mpirun`` or on a Cloud TPU VM, without them). Process 0 serves HTTP and schedules; every other
process runs the same engine steps on its devices (its share of the mesh) and leaves when process 0 shuts down.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import os
import signal
import sys
from pathlib import Path

from mercury_jax import usage
from mercury_jax.limits import MAX_TILE, Capacity
from mercury_jax.serve.config import ServeConfig
from mercury_jax.serve.guard import MAX_BODY_TIMEOUT
from mercury_jax.serve.pacing import DEFAULT_SHARE, MAX_SHARE, MIN_SHARE

BUNDLED_NAME = "mercury_jax-{model}"  # The model name of a bundled checkpoint (--model).
DEFAULT_PREFILL_CHUNK = 512  # Prompt tokens an engine iteration prefills at most (--prefill-chunk).


_Parser = functools.partial(usage.Parser, command="mercury_jax.serve")  # usage errors: one line, exit code 2
_fail = functools.partial(usage.fail, "mercury_jax.serve")


def build_parser() -> argparse.ArgumentParser:
  p = _Parser(prog="python -m mercury_jax.serve", description=__doc__.splitlines()[0])
  for flags in (_model_flags, _engine_flags, _http_flags, _structured_flags):
    flags(p)
  from mercury_jax import distributed

  distributed.add_arguments(p)
  return p


def _model_flags(p: argparse.ArgumentParser) -> None:
  """Which model, and how it decodes."""
  which = p.add_mutually_exclusive_group()
  which.add_argument(
    "--checkpoint", help="train workdir, checkpoints folder, step folder or exported checkpoint (default: bundled)"
  )
  which.add_argument(
    "--model",
    default="default",
    help="a bundled model, without --checkpoint: default (verified decoding), default_bd (block diffusion) or "
    "default_ar (the autoregressive twin)",
  )
  p.add_argument(
    "--mesh", help="DATA,FSDP,TENSOR or DATA,FSDP,SEQUENCE,TENSOR sizes (default: every device on the data axis)"
  )
  usage.add_latent_flags(p)
  p.add_argument(
    "--block-length",
    type=int,
    default=0,
    help="block of a whole-sequence checkpoint (default 32); block-diffusion checkpoints use their trained block",
  )
  p.add_argument(
    "--decode",
    default="auto",
    choices=("auto", "ar", "diffusion", "verified"),
    help="how every request decodes (default auto: the model's best; a verified checkpoint: verified)",
  )
  p.add_argument(
    "--draft-length", type=int, default=0, help="verified decoding's draft length (default 0: the checkpoint's)"
  )
  usage.add_draft_flags(p)  # every request decodes with one draft tree, compiled at start
  p.set_defaults(draft_tree="auto", draft_lookup=-1, draft_blocks="auto", draft_confidence=0.0)
  p.add_argument("--model-name", help="the name clients see (default: the checkpoint folder's name)")


def _engine_flags(p: argparse.ArgumentParser) -> None:
  """The engine's slots, pages and prefills (:class:`~mercury_jax.serve.config.ServeConfig`)."""
  p.add_argument("--slots", type=int, default=16, help="requests generated at once, the engine's batch (default 16)")
  p.add_argument("--max-queue", type=int, default=256, help="requests that may wait for a slot; more get 429")
  p.add_argument(
    "--kv-pages",
    type=int,
    help="pages of the key-value cache's pool, the sink page included; a request holds the pages its prompt and "
    "max_tokens cover and waits in the queue until enough are free (default: every slot can hold a whole context)",
  )
  p.add_argument("--page-size", type=int, default=16, help="slots of a page of the key-value cache (default 16)")
  p.add_argument(
    "--max-model-len",
    type=int,
    help="the longest request served, prompt and max_tokens together (a longer one gets 400); it sizes the canvas "
    "and the default --kv-pages (default: the model's context)",
  )
  p.add_argument(
    "--prefill-chunk",
    type=int,
    default=DEFAULT_PREFILL_CHUNK,
    help="prompt tokens of a prefill chunk: a longer prompt is prefilled in chunks between the other requests' "
    f"steps, so their streams keep flowing (default {DEFAULT_PREFILL_CHUNK}; 0: every prompt in one pass)",
  )
  p.add_argument(
    "--prefill-share",
    type=float,
    default=DEFAULT_SHARE,
    help="the engine's time chunked prefills may take while other requests decode, which keep the rest: more gives "
    f"a long prompt its first token sooner, less keeps the other streams faster (default {DEFAULT_SHARE}; from "
    f"{MIN_SHARE} to {MAX_SHARE})",
  )
  p.add_argument(
    "--no-batch-invariance",
    dest="batch_invariant",
    action="store_false",
    help="batch the rows of a step through the network (faster under load) instead of running its matmuls over "
    "fixed tiles of positions; a sampled token may then depend on how many requests share the step (default: every "
    "request's tokens are the same whatever runs beside it)",
  )
  p.add_argument(
    "--no-overlap",
    dest="overlap",
    action="store_false",
    help="run the engine one step at a time: the host reads each step's view before it dispatches the next (default: "
    "it reads a step's view while the next step runs; the same tokens, see serve/scheduler.py)",
  )
  p.add_argument(
    "--invariant-tile",
    type=int,
    default=0,
    help="positions per matmul tile of a batch-invariant step: a lone request pays for one tile, a full step runs "
    f"its positions a tile at a time (default 0: four rows' positions of a step, in [8, 64]; at most {MAX_TILE})",
  )


def _http_flags(p: argparse.ArgumentParser) -> None:
  """Where and how the server answers."""
  p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: every one)")
  p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: a free one)")
  p.add_argument(
    "--grace",
    type=float,
    default=30.0,
    help="seconds running requests get to finish after SIGTERM; those still running then end with 503 (default 30)",
  )
  p.add_argument(
    "--api-key",
    default=os.environ.get("MERCURY_API_KEY") or None,
    help="require Authorization: Bearer KEY on /v1/* (default: $MERCURY_API_KEY; none: the API is open)",
  )
  p.add_argument(
    "--max-body-bytes", type=int, default=4 << 20, help="largest request body; larger ones get 413 (default 4 MiB)"
  )
  p.add_argument(
    "--body-timeout",
    type=float,
    default=10.0,
    help=f"seconds a request's body may take to arrive; slower ones get 408 (default 10, at most {MAX_BODY_TIMEOUT:g})",
  )
  p.add_argument(
    "--request-timeout",
    type=float,
    default=600.0,
    help="seconds a request may take from arrival to its last token; then 504 and its slots are freed (default 600)",
  )
  p.add_argument(
    "--no-token-healing",
    dest="token_healing",
    action="store_false",
    help="keep a completion prompt's last token as tokenised (default: re-generate it as a token whose text starts "
    "with its characters; plain-text /v1/completions only)",
  )


def _structured_flags(p: argparse.ArgumentParser) -> None:
  """Structured output's constraints and their compile pool."""
  p.add_argument(
    "--constraint-capacity",
    default="512,256,16384",
    help="STATES,CLASSES,EDGES of the largest automaton a slot holds for structured output (response_format, "
    "tools); larger schemas get 400 (default 512,256,16384); 0: structured output off",
  )
  p.add_argument(
    "--compile-workers",
    type=int,
    default=2,
    help="structured-output constraints that may compile at once past their first second (each job under a time "
    "and memory limit; newer ones get their first second at once beside them, see serve/compiling.py; default 2)",
  )
  p.add_argument(
    "--compile-timeout",
    type=float,
    default=5.0,
    help="seconds one constraint may take to compile; longer ones are stopped and get 400 (default 5)",
  )


def _check_args(args: argparse.Namespace) -> None:
  """Every flag checked before anything is loaded; ``args.config``: the engine's :class:`ServeConfig`."""
  http = (
    (not 0 <= args.port <= 65535, f"--port={args.port} must lie in [0, 65535]"),
    (not args.grace >= 0, f"--grace={args.grace} must be >= 0 seconds"),
    (args.max_body_bytes < 1024, f"--max-body-bytes={args.max_body_bytes} must be >= 1024"),
    (not 0 < args.body_timeout <= MAX_BODY_TIMEOUT, f"--body-timeout={args.body_timeout} must lie in (0, "
     f"{MAX_BODY_TIMEOUT:g}] seconds"),
    (not args.request_timeout > 0, f"--request-timeout={args.request_timeout} must be > 0 seconds"),
    (args.compile_workers < 1, f"--compile-workers={args.compile_workers} must be >= 1"),
    (not args.compile_timeout > 0, f"--compile-timeout={args.compile_timeout} must be > 0 seconds"),
  )  # fmt: skip
  for wrong, message in http:
    if wrong:
      _fail(message)
  if args.api_key is not None and not args.api_key.strip():
    _fail("--api-key is empty; give the key clients must send, or leave the flag (and MERCURY_API_KEY) out")
  if args.model_name is not None and not args.model_name.strip():
    _fail("--model-name is empty; give the name clients should send, or leave the flag out")
  if args.checkpoint is not None and not Path(args.checkpoint).exists():
    _fail(f"--checkpoint {args.checkpoint!r} does not exist")
  fields = {f.name for f in dataclasses.fields(ServeConfig)} - {"capacity"}
  try:
    given = {name: getattr(args, name) for name in fields if hasattr(args, name)}
    args.config = ServeConfig(**given, capacity=_capacity(args))
    args.config.validate()
  except ValueError as e:
    _fail(str(e))


def _capacity(args: argparse.Namespace):
  """``--constraint-capacity``: a ``Capacity``, or None for 0."""
  flag = args.constraint_capacity
  if flag.strip() == "0":
    return None
  parts = flag.split(",")
  if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
    _fail(f"--constraint-capacity={flag!r} must be three positive integers STATES,CLASSES,EDGES (or 0: off)")
  return Capacity(*(int(p) for p in parts))


def _load(args: argparse.Namespace):
  """The scheduler (not started yet), the compile pool (its processes starting; None without structured output)
  and the model's name; every failure is one line and exit code 2."""
  import jax

  from mercury_jax.sample import load_sampler
  from mercury_jax.sampling.settings import SettingError
  from mercury_jax.serve.scheduler import Scheduler

  sampler = load_sampler(args.checkpoint, args.model, args.mesh, _fail)
  if args.max_model_len is not None and args.max_model_len > sampler.max_length:
    _fail(
      f"--max-model-len={args.max_model_len} exceeds the model's context of {sampler.max_length} tokens (a longer "
      "context needs a model trained or extended to it, e.g. with RoPE scaling)"
    )
  pool = None
  capacity = args.config.capacity
  if capacity is not None and jax.process_index() == 0:  # Its processes start while the engine compiles.
    from mercury_jax.serve.compiling import CompilePool, CompilerSpec
    from mercury_jax.serve.config import CAPACITY_REMEDY

    spec = CompilerSpec(sampler.tokenizer.to_bytes(), *capacity, remedy=CAPACITY_REMEDY)
    pool = CompilePool(spec, workers=args.compile_workers, timeout=args.compile_timeout)
    pool.start()
  try:
    scheduler = Scheduler(sampler, args.config)
  except (SettingError, ValueError) as e:
    if pool is not None:  # Its processes are not left to find the server gone.
      pool.close()
    _fail(e.named("--" + e.field.replace("_", "-")) if isinstance(e, SettingError) else str(e))
  name = args.model_name or (
    BUNDLED_NAME.format(model=args.model) if args.checkpoint is None else Path(args.checkpoint).resolve().name
  )
  _print_memory(scheduler.engine)
  return scheduler, pool, name


def _print_memory(engine) -> None:
  """The start-up line on the key-value cache: the pool, what a slot can hold, and a dense cache's size."""
  memory = engine.memory()
  if not memory["pool"]:
    print("kv cache: none (a whole-sequence model runs every step over its canvas)", flush=True)
    return
  mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
  dense = engine.slots * memory["dense_row"]
  print(
    f"kv cache: {memory['pages'] - 1} pages of {memory['page_size']} slots ({mib(memory['page'])} each), "
    f"{mib(memory['pool'])} in all; a whole context takes {engine.admission.pages_per_row} pages; a dense cache of "
    f"{engine.slots} slots would take {mib(dense)}; requests of up to {engine.max_model_len} tokens"
    + (f", prompts prefilled in chunks of {engine.prefill_chunk} tokens" if engine.prefill_chunk else ""),
    flush=True,
  )


async def _serve(server, name: str, host: str, pool) -> None:
  """Runs ``server`` and prints the line that says it listens (tests wait for it), once the compile pool is ready."""
  if pool is not None:
    await pool.ready()
  server.loop = asyncio.get_running_loop()
  watch = asyncio.create_task(server.config.app.state.metrics.watch_loop())  # mercury_event_loop_lag_seconds

  async def announce():
    while not server.started:
      await asyncio.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    print(f"serving {name} on http://{host}:{port}", flush=True)

  announcer = asyncio.create_task(announce())
  try:
    await server.serve()
  finally:
    announcer.cancel()
    watch.cancel()


def main(argv: list[str] | None = None, *, compile_cache: bool = False) -> int:
  """The command line: checks the flags, loads the model, serves until SIGTERM/SIGINT, then drains.

  ``compile_cache`` (on for ``python -m`` and ``mercury-serve``) keeps compiled programs across runs; see
  :func:`mercury_jax.sample.enable_compile_cache`.
  """
  args = build_parser().parse_args(argv)
  _check_args(args)
  if compile_cache:
    from mercury_jax.sample import enable_compile_cache

    enable_compile_cache()
  from mercury_jax import distributed

  try:
    distributed.initialize(args)
  except SystemExit as e:  # Inconsistent --coordinator/--num-processes/--process-id.
    _fail(str(e.code))
  _log_to_stderr()
  scheduler, pool, name = _load(args)
  if not scheduler.leader:  # Another process of a multi-host mesh: run process 0's engine steps, serve nothing.
    scheduler.follow()
    return 0

  import uvicorn

  from mercury_jax.data.chat_template import TemplateError
  from mercury_jax.serve.routes import Options, create_app

  # Every option but the name is the flag of the same name.
  options = Options(name, **{f.name: getattr(args, f.name) for f in dataclasses.fields(Options)[1:]})
  try:
    app = create_app(scheduler, pool, options)
  except TemplateError as e:
    _fail(f"--checkpoint: {e}")

  from sse_starlette.sse import AppStatus

  from mercury_jax.serve.draining import MARGIN

  AppStatus.disable_automatic_graceful_drain()  # Streams end through the drain (an error event, [DONE]), not cut.
  drain = app.state.drain

  class Server(uvicorn.Server):
    loop: asyncio.AbstractEventLoop | None = None  # set by _serve

    def handle_exit(self, sig, frame):  # A signal handler: it only schedules the drain on the loop.
      if self.loop is None:
        self.should_exit = True
      else:
        self.loop.call_soon_threadsafe(drain.signal, lambda: setattr(self, "should_exit", True))

  # Uvicorn's own graceful shutdown starts once the drain is over: every request has answered by then.
  config = uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=MARGIN, lifespan="off")
  server = Server(config)
  for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn raises the signal that stopped it again: drain instead.
    signal.signal(sig, lambda *_: None)
  scheduler.start()
  try:
    asyncio.run(_serve(server, name, args.host, pool))
  except SystemExit:  # uvicorn could not listen (it logged why).
    scheduler.shutdown(0.0)
    _fail(f"cannot listen on {args.host}:{args.port} (see the log above)")
  except RuntimeError as e:  # The compile pool's processes could not start.
    scheduler.shutdown(0.0)
    _fail(str(e))
  finally:
    if pool is not None:
      pool.close()
  scheduler.shutdown(MARGIN)  # Every request has ended; their slots are freed at the engine's next iteration.
  return 0


def _log_to_stderr() -> None:
  """The server's own log (``mercury_jax.serve``: failures and their details) on stderr, as uvicorn's."""
  handler = logging.StreamHandler()
  handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
  logger = logging.getLogger("mercury_jax")
  logger.addHandler(handler)
  logger.setLevel(logging.INFO)


def cli() -> int:
  """The ``mercury-serve`` console script and ``python -m``: :func:`main` with the compilation cache."""
  return main(compile_cache=True)


if __name__ == "__main__":
  sys.exit(cli())
