"""The product's imports point one way: the tools (``bench``, ``loadtest``) import the product, never back.

Every module under the product's folders is parsed (not imported, so nothing
runs) and each import it makes, at module level or inside a function, is
checked against the rules below. A failure names the module, the line and the
import, so the fix is where the message points.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("pd", "router", "pd_kernels", "transfer", "autoscale", "sim")
TOOLS = ("bench", "loadtest")
# The one module allowed to reach Ray's private API, and the only Ray that sim may import (lazily).
RAY_ADAPTER = "autoscale.ray_internals"
# The router's Ray glue; every other router module is policy, deciding from plain inputs.
ROUTER_GLUE = "router.serve"


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    line: int
    target: str  # the imported module, dotted (``from a import b`` gives ``a.b`` and ``a``)
    in_function: bool

    def __str__(self) -> str:
        where = "inside a function" if self.in_function else "at module level"
        return f"{self.module}:{self.line} imports {self.target} ({where})"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module of a relative ``from`` import."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([name] if name else []))


def imports_of(path: Path, root: Path = REPO) -> list[Import]:
    """Every import in ``path`` (a module under ``root``), with whether it sits inside a function (a lazy import)."""
    module = _module_name(path, root)
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            lazy = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend(Import(module, child.lineno, alias.name, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = _resolve(module, path.name == "__init__.py", child.level, child.module)
                found.append(Import(module, child.lineno, base, in_function))
                found.extend(Import(module, child.lineno, f"{base}.{alias.name}", in_function)
                             for alias in child.names)
            visit(child, lazy)

    visit(tree, False)
    return found


def _product_imports() -> list[Import]:
    found = []
    for top in PRODUCT:
        for path in sorted((REPO / top).rglob("*.py")):
            found.extend(imports_of(path))
    return found


ALL = _product_imports()


def _under(name: str, *packages: str) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def _violations(rule) -> list[str]:
    return [str(imp) for imp in ALL if rule(imp)]


def _check(rule, what: str) -> None:
    bad = _violations(rule)
    assert not bad, f"{what}:\n  " + "\n  ".join(bad)


def test_the_scan_sees_the_product():
    """A scan that found nothing would pass every rule: make sure it reads the modules it should."""
    modules = {imp.module for imp in ALL}
    for expected in ("pd.workload.summary", "sim.plan", "autoscale.serve", "pd_kernels", "router.serve"):
        assert expected in modules, f"{expected} was not scanned"
    assert any(imp.in_function for imp in ALL), "no import inside a function was seen"


def test_the_product_never_imports_the_tools():
    _check(lambda imp: _under(imp.target, *TOOLS), "the product imports a tool (bench/loadtest are tools)")


def test_kernels_stand_alone():
    _check(lambda imp: _under(imp.module, "pd_kernels") and _under(imp.target, "pd", "router", "transfer", "sim"),
           "pd_kernels imports a layer above it")


def test_workload_is_a_leaf():
    _check(lambda imp: _under(imp.module, "pd.workload") and _under(imp.target, "pd", "ray")
           and not _under(imp.target, "pd.workload"),
           "pd.workload imports something above it (stdlib, numpy and msgspec only)")


def test_sim_stays_off_serve_and_ray():
    _check(lambda imp: _under(imp.module, "sim") and _under(imp.target, "pd.serve"),
           "sim imports pd.serve (it reads the config layer, pd.config)")
    _check(lambda imp: _under(imp.module, "sim") and _under(imp.target, "ray")
           and not (_under(imp.target, RAY_ADAPTER) and imp.in_function),
           f"sim imports Ray (only {RAY_ADAPTER}, and lazily)")
    _check(lambda imp: _under(imp.module, "sim") and _under(imp.target, RAY_ADAPTER) and not imp.in_function,
           f"sim imports {RAY_ADAPTER} at module level (it must stay importable without Ray)")


def test_ray_private_api_in_one_module():
    _check(lambda imp: imp.module != RAY_ADAPTER and _under(imp.target, "ray")
           and any(part.startswith("_") for part in imp.target.split(".")),
           f"Ray's private API is used outside {RAY_ADAPTER}")


def test_the_engine_stays_off_serve_and_ray():
    _check(lambda imp: _under(imp.module, "pd.engine", "pd.model") and _under(imp.target, "pd.serve", "ray"),
           "the engine or the model imports pd.serve or Ray (pd.serve runs the engine in Ray, never the reverse)")


def test_router_policies_do_not_import_the_engine():
    _check(lambda imp: _under(imp.module, "router") and not _under(imp.module, ROUTER_GLUE)
           and _under(imp.target, "pd.engine", "ray"),
           f"a routing policy imports the engine or Ray (only {ROUTER_GLUE} talks to Ray)")


@pytest.mark.parametrize("source, target, lazy", [
    ("import bench.trace\n", "bench.trace", False),
    ("def f():\n    from loadtest import client\n", "loadtest.client", True),
    ("from .. import engine\n", "pd.engine", False),
])
def test_imports_of_sees_every_form(tmp_path, source, target, lazy):
    """The scanner finds plain, lazy and relative imports (what the rules above rely on)."""
    package = tmp_path / "pd" / "workload"
    package.mkdir(parents=True)
    path = package / "probe.py"
    path.write_text(source)
    found = imports_of(path, tmp_path)
    assert any(imp.target == target and imp.in_function == lazy for imp in found), [str(imp) for imp in found]


@pytest.mark.integration  # a child Python, so that the import state is a fresh process's
def test_the_leaf_and_the_autoscaling_policy_import_without_torch_or_ray():
    """Serve's controller imports ``autoscale.serve``; it and ``pd.workload`` must not drag in torch or Ray."""
    leaf = [f"pd.workload.{path.stem}" for path in sorted((REPO / "pd" / "workload").glob("*.py"))
            if path.stem != "__init__"]
    code = (f"import sys, {', '.join(leaf)}, autoscale.serve; "
            "print(sorted(name for name in ('torch', 'ray') if name in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", f"importing {leaf} and autoscale.serve loaded {done.stdout.strip()}"


def test_the_config_names_the_kernels_backends():
    """``pd.config`` spells out ``pd_kernels.BACKENDS`` rather than import torch with it; the two agree."""
    import pd_kernels
    from pd.config import ATTENTION_BACKENDS

    assert ATTENTION_BACKENDS == pd_kernels.BACKENDS


@pytest.mark.integration  # a child Python, so that the import state is a fresh process's
def test_the_ingress_starts_without_torch(tmp_path, monkeypatch):
    """Every app deploys an ingress replica, which holds text and routing only: importing it and its request
    routers, and constructing it on a built-in model already in the cache, loads no torch (2 s and 180 MB a
    replica)."""
    from pd.model.paths import resolve_model_path

    monkeypatch.setenv("PD_CACHE_DIR", str(tmp_path))
    resolve_model_path("builtin:tiny-llama")  # written here, with torch, as a replica's engine would
    code = (
        "import sys, yaml, router.serve\n"
        "from pd.serve.ingress import Ingress\n"
        "args = yaml.safe_load(open('serve_configs/default.yaml'))['applications'][0]['args']\n"
        "args['engine'] = {**args.get('engine', {}), 'model': 'builtin:tiny-llama'}\n"
        "# The class Serve's ingress wrapper builds on: constructed as the replica would, with no pools to call.\n"
        "cls = [c for c in Ingress.func_or_class.__mro__ if c.__name__ == 'Ingress' and '__init__' in vars(c)][-1]\n"
        "ingress = cls(args, None, None)\n"
        "print(ingress.vocab_size, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "False", f"the ingress loaded torch: {done.stdout}"
