"""Convert between a Hugging Face safetensors folder and our DCP checkpoint (LLaMA 3, Qwen3, DeepSeek-V3).

    python scripts/convert_hf.py to-dcp HF_DIR DCP_DIR   # config.json + *.safetensors -> DCP (+ hf_config.json)
    python scripts/convert_hf.py to-hf DCP_DIR HF_DIR    # back; the HF config travels inside the DCP folder
    ... --overwrite                                     # replace a destination that exists (or holds the source)

A DCP folder starts a job with `[checkpoint] initial_load_path = "DCP_DIR"`; an HF folder
directly with `initial_load_in_hf = true` too. Bad input (another architecture, tensors whose
names or shapes do not match the model the config describes) is one line, exit code 2; the
output is written to `OUT.tmp` and renamed once complete. A destination that exists and is not
empty, or that overlaps the source, is refused (exit 2, nothing changed) unless `--overwrite`.
"""

from __future__ import annotations

import argparse
import sys

from trainer.errors import ConfigError
from trainer.hf_checkpoint import dcp_to_hf, hf_to_dcp


def main(argv: list[str] | None = None) -> int:
    """Run one conversion; 0 on success, 2 on bad input (one line on stderr)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("to-dcp", help="HF safetensors folder -> DCP folder")
    a.add_argument("src")
    a.add_argument("dst")
    a.add_argument("--overwrite", action="store_true", help="replace DST if it exists or overlaps SRC")
    b = sub.add_parser("to-hf", help="DCP folder (with hf_config.json) -> HF safetensors folder")
    b.add_argument("src")
    b.add_argument("dst")
    b.add_argument("--overwrite", action="store_true", help="replace DST if it exists or overlaps SRC")
    b.add_argument("--trust-foreign", action="store_true",
                   help="read a DCP folder whose pickles could run code (only from someone you trust)")
    args = p.parse_args(argv)
    try:
        if args.cmd == "to-dcp":
            out = hf_to_dcp(args.src, args.dst, overwrite=args.overwrite)
        else:
            out = dcp_to_hf(args.src, args.dst, trust_foreign=args.trust_foreign, overwrite=args.overwrite)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
