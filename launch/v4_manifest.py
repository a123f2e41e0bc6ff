"""The v4 bundles' manifest: the code corpus's, plus the chat examples and self-distillation sets they trained on.

    python launch/v4_manifest.py --asset mercury_jax/assets/default --code DATA/code --chat-examples FILE.jsonl \
      --chat DATA/chat-sft [--distill DATA/distill-greedy --distill DATA/distill-t1] [--recipe TEXT]

``python -m mercury_jax.export --data DATA/code`` bundles the code corpus's manifest (every file with its
distribution, version, licence and sha256). This adds what else went in, under ``v4``: the mined chat examples
(``mercury_jax.data.instructions``'s manifest: command, seed, counts by kind and source, the source distributions and
licences, and the JSONL's sha256), the prepared chat data's split counts, and each self-distillation set's manifest
(``mercury_jax.distill``: command, checkpoint sha256, seed, temperature, throughput, and every prompt as
``[source, record, prompt tokens]``). Absolute paths are cut to folder names, as ``export`` does.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _name(path: str) -> str:
  return Path(path).name


def distill_entry(folder: Path) -> dict:
  manifest = json.loads((folder / "manifest.json").read_text())
  metadata = json.loads((folder / "metadata.json").read_text())
  sources = [_name(s["dir"]) for s in manifest["sources"]]
  prompts = {
    split: [[sources.index(_name(p["source"])), p["record"], p["prompt_tokens"]] for p in chosen]
    for split, chosen in manifest["prompts"].items()
  }
  entry = {k: v for k, v in manifest.items() if k not in ("prompts", "checkpoint", "sources", "command")}
  entry["command"] = " ".join(_name(w) if w.startswith("/") else w for w in manifest["command"].split())
  entry["checkpoint"] = _name(manifest["checkpoint"])
  entry["sources"] = [{**s, "dir": _name(s["dir"])} for s in manifest["sources"]]
  entry["splits"] = {s: {k: v for k, v in m.items() if k != "shards"} for s, m in metadata["splits"].items()}
  entry["prompts"] = {"columns": ["source index", "record index", "prompt tokens"], **prompts}
  return {"folder": folder.name, **entry}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--asset", required=True, help="an exported model folder (its manifest.json is extended)")
  parser.add_argument("--code", required=True, help="the code corpus's prepared folder")
  parser.add_argument("--chat-examples", required=True, help="the mined JSONL (its .manifest.json beside it)")
  parser.add_argument("--chat", required=True, help="the chat examples' prepared folder")
  parser.add_argument("--distill", action="append", default=[], help="a self-distillation set (repeatable)")
  parser.add_argument("--recipe", default="", help="a one-paragraph description of the training recipe")
  args = parser.parse_args()
  asset = Path(args.asset)
  manifest = json.loads((asset / "manifest.json").read_text())
  mined = json.loads(Path(args.chat_examples).with_suffix(".manifest.json").read_text())
  mined["command"] = " ".join(_name(w) if w.startswith("/") else w for w in mined["command"].split())
  chat_meta = json.loads((Path(args.chat) / "metadata.json").read_text())
  manifest["v4"] = {
    "recipe": args.recipe,
    "code": {"folder": _name(args.code), "manifest": "the top-level entries of this file"},
    "chat_examples": {"file": _name(args.chat_examples), **mined},
    "chat_data": {
      "folder": _name(args.chat),
      "sft_packing": chat_meta.get("sft_packing"),
      "splits": {s: {k: v for k, v in m.items() if k != "shards"} for s, m in chat_meta["splits"].items()},
    },
    "self_distillation": [distill_entry(Path(d)) for d in args.distill],
  }
  (asset / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
  print(f"{asset / 'manifest.json'}: {(asset / 'manifest.json').stat().st_size:,} bytes")


if __name__ == "__main__":
  main()
