"""The ``serve_configs`` app a benchmark deploys, serving the model the benchmark measures.

``serve_configs/default.yaml`` serves the trained SmolLM2 (what ``make serve``
shows a newcomer); the serving benchmarks measure the built-in tiny model, as
their figures in ``docs/performance.md`` and vLLM's peer server do, so they
take a config's layout and put their model in it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

CONFIG_DIR = Path(__file__).resolve().parents[1] / "serve_configs"
BENCH_MODEL = "builtin:tiny-llama"


def load_config(name: str) -> dict[str, Any]:
    """``serve_configs/<name>``, parsed."""
    return yaml.safe_load((CONFIG_DIR / name).read_text())


def bench_app_args(config: dict[str, Any], model: str = BENCH_MODEL) -> dict[str, Any]:
    """The args of ``config``'s one app, its engine serving ``model``."""
    args = config["applications"][0]["args"]
    return {**args, "engine": {**args["engine"], "model": model}}
