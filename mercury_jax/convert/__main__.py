"""``python -m mercury_jax.convert --from DIR --out models/NAME [--family auto|...] [--dtype bfloat16|float32]``.

Converts a Hugging Face diffusion-LM checkpoint folder (LLaDA, Dream / DiffuCoder, SDAR, Fast-dLLM v2), or a plain
causal Qwen2 / Qwen3 / Llama model as the autoregressive model it is, into a mercury_jax inference checkpoint (see
:mod:`mercury_jax.convert`)::

  python -m mercury_jax.convert --from hf/LLaDA-8B-Instruct --out models/llada-8b-instruct
  python -m mercury_jax.convert --from hf/Qwen2.5-1.5B-Instruct --family autoregressive --out models/qwen2.5-1.5b
  python -m mercury_jax.convert --from hf/Qwen2.5-0.5B --family dream --dtype float32 --out models/qwen-as-dream

A plain ``model_type`` (``qwen2``, ``qwen3``, ``llama``) needs ``--family``: the layout alone does not say whether the
weights are an autoregressive model or to be adapted into a diffusion family.

Bad input (a missing folder, file or tensor, a truncated file, a shape that does not match the config, an unknown
``model_type``, an MoE model, an unsupported RoPE scaling) gets one line on stderr and exit code 2; no output folder
is left behind.
"""

from __future__ import annotations

import functools
import sys

from mercury_jax import usage
from mercury_jax.config import PARAM_DTYPES
from mercury_jax.convert.build import convert
from mercury_jax.convert.families import FAMILIES, ConvertError

_fail = functools.partial(usage.fail, "mercury_jax.convert")


def build_parser() -> usage.Parser:
  p = usage.Parser(prog="python -m mercury_jax.convert", description=__doc__.splitlines()[0], command=_fail.args[0])
  p.add_argument("--from", dest="src", required=True, help="Hugging Face checkpoint folder")
  p.add_argument("--out", required=True, help="folder to write (a mercury_jax inference checkpoint)")
  p.add_argument(
    "--family",
    choices=("auto", *FAMILIES),
    default="auto",
    help="default: from config.json's model_type (a plain qwen2/qwen3/llama needs it named)",
  )
  p.add_argument("--dtype", choices=PARAM_DTYPES, default="bfloat16", help="parameters' dtype")
  p.add_argument("--max-length", type=int, default=None, help="context (default: the source's, at most 4096)")
  p.add_argument("--force", action="store_true", help="replace a non-empty --out folder")
  return p


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    out = convert(
      args.src, args.out, args.family, args.dtype, max_length=args.max_length, force=args.force, progress=True
    )
  except (ConvertError, OSError) as e:
    _fail(e)
  size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
  print(f"converted {args.src} -> {args.out} ({size / 1e9:.2f} GB, parameters in {args.dtype})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
