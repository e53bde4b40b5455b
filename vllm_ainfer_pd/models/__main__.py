"""CLI: `vllm-ainfer-pd-model [--preset tiny] [--out DIR] [--seed N] [--eagle]` prints the model
folder (with `--eagle`, that of an EAGLE drafter for the preset's model)."""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_ainfer_pd.models.generate import (
    PRESETS,
    ensure_model,
    get_preset,
    write_eagle_drafter,
    write_model,
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Generate a random-weight MoE model folder.")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write here (default: the shared cache folder)")
    parser.add_argument("--eagle", action="store_true",
                        help="an EAGLE drafter for the preset's model (random weights)")
    args = parser.parse_args(argv)
    if args.out is None:
        print(ensure_model(args.preset, args.seed, eagle=args.eagle))
    else:
        write = write_eagle_drafter if args.eagle else write_model
        print(write(get_preset(args.preset), args.out, args.seed))


if __name__ == "__main__":
    main()
