"""``python -m pd.model.prepare MODEL [--revision REV]``: resolve a model argument ahead of serving.

Generates a built-in model, converts a GGUF file (``pd.model.gguf``) or fetches a hub snapshot into the
cache, and prints the checkpoint directory, so that no replica's first start pays for it. ``make venv``
runs it for the default model.
"""

from __future__ import annotations

import argparse
import logging
import time

from pd.model.paths import resolve_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="+", help="built-in name, checkpoint directory, .gguf file or hub id")
    parser.add_argument("--revision", default=None, help="a hub id's branch, tag or commit")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for model in args.model:
        started = time.monotonic()
        path = resolve_model_path(model, args.revision)
        print(f"{model}: {path} ({time.monotonic() - started:.1f} s)")


if __name__ == "__main__":
    main()
