"""The ``pd`` command: one entry point for the project's ``python -m`` tools, as ``vllm bench`` is for vLLM's.

    pd generate [--model M] [--max-tokens N] [--temperature T]   offline generation (pd.demo)
    pd prepare MODEL... [--revision REV]                          resolve a model ahead of serving (pd.model.prepare)
    pd doctor [--json] [--config FILE] [--model M]                check this node before serving (pd.doctor)
    pd bench NAME [ARGS...]          a benchmark: bench.NAME          (pd bench --list)
    pd sim NAME [ARGS...]            the simulator and planner: sim.NAME (run, plan, scale, validate, profile)
    pd loadtest NAME [ARGS...]       load tests: run (locust on loadtest/locustfile.py), report, sweep
    pd kernels {build,aot} [ARGS...] the C++ CPU kernels' build (pd_kernels.cpu), Triton's AOT check (pd_kernels.aot)

Serving stays Ray Serve's own CLI, ``serve run serve_configs/default.yaml``;
``pd serve`` says so.

Each command runs its module as ``python -m`` would
(``runpy.run_module(name, run_name="__main__")``, with ``sys.argv`` set to
the command's arguments), so this module imports no tool statically: the
product never imports ``bench`` or ``loadtest``, and ``pd --help`` costs no
torch import. A group's commands are the modules of its package that have a
``if __name__ == "__main__":`` block (or a ``__main__.py``), found by reading
their source, never by importing them; a new tool is a new command.

Entry points that are not commands: ``bench.vllm_peer`` runs in vLLM's peer
venv, driven over stdin by ``bench.engine``; ``pd.engine.tp.worker`` is a
tensor-parallel rank's process, started by the engine.
"""

from __future__ import annotations

import ast
import importlib.util
import runpy
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, Sequence

MAIN_GUARD = 'if __name__ == "__main__":'
# Modules with a main block that a user does not run (see the module docstring).
INTERNAL = frozenset({"bench.vllm_peer", "pd.engine.tp.worker"})
SERVE_HINT = ("pd serves with Ray Serve's own CLI: `serve run serve_configs/default.yaml` (or `make serve`); "
              "see serve_configs/ for the other layouts")


@dataclass(frozen=True)
class Command:
    """One runnable tool: ``module`` run as ``__main__`` with ``argv_prefix`` before the user's arguments."""

    module: str
    summary: str
    argv_prefix: tuple[str, ...] = ()


@dataclass(frozen=True)
class Group:
    """A family of tools: fixed commands, plus every runnable module of ``package`` under its own name."""

    summary: str
    package: str | None = None
    fixed: dict[str, Command] = field(default_factory=dict)

    def commands(self) -> dict[str, Command]:
        found = discover(self.package) if self.package else {}
        return dict(sorted({**found, **self.fixed}.items()))


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)  # a top-level package: found, not imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"pd: package {package!r} is not installed here")
    return Path(next(iter(spec.submodule_search_locations)))


def _summary(source: str) -> str:
    doc = ast.get_docstring(ast.parse(source)) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def discover(package: str) -> dict[str, Command]:
    """The runnable modules of a top-level ``package`` by short name, read from their source."""
    commands = {}
    for path in sorted(_package_dir(package).iterdir()):
        if path.suffix == ".py" and path.stem != "__init__":
            source, module = path.read_text(), f"{package}.{path.stem}"
        elif (path / "__main__.py").is_file():
            source, module = (path / "__main__.py").read_text(), f"{package}.{path.name}"
        else:
            continue
        if module not in INTERNAL and (MAIN_GUARD in source or path.is_dir()):
            commands[module.rsplit(".", 1)[1]] = Command(module, _summary(source))
    return commands


def _locustfile() -> str:
    return str(_package_dir("loadtest") / "locustfile.py")


TOP = {
    "generate": Command("pd.demo", "offline generation with the built-in model, no Ray"),
    "prepare": Command("pd.model.prepare", "resolve a model (built-in, GGUF, hub id) into the cache ahead of serving"),
    "doctor": Command("pd.doctor", "check this node before serving: versions, NIXL/UCX loopback, CPU ISA and "
                      "kernels, GPU, ports, the model"),
}
GROUPS = {
    "bench": Group("benchmarks, each a ratio against a peer measured in the same run", package="bench"),
    "sim": Group("the discrete-event simulator and the pool planner", package="sim"),
    "loadtest": Group("open-loop load tests against a served app, and their reports", package="loadtest", fixed={
        "run": Command("locust", "one locust run on loadtest/locustfile.py (locust's own options)",
                       ("-f", "<locustfile>"))}),
    "kernels": Group("the kernels' build and checks", fixed={
        "build": Command("pd_kernels.cpu", "build the C++ CPU kernels for this host's ISA (make venv runs it)"),
        "aot": Command("pd_kernels.aot", "compile every Triton kernel specialisation for real GPUs (no GPU needed)")}),
}


def run(command: Command, args: Sequence[str]) -> None:
    """Run ``command``'s module as ``python -m`` would; restores ``sys.argv`` and ``__main__`` after.

    As under ``python -m``, the module is ``__main__`` (a spawned process re-imports it by its name) and
    ``sys.argv[0]`` is its file, so its usage line reads as it does under ``python -m``.
    """
    prefix = [_locustfile() if part == "<locustfile>" else part for part in command.argv_prefix]
    saved = sys.argv
    sys.argv = [command.module, *prefix, *args]
    try:
        runpy.run_module(command.module, run_name="__main__", alter_sys=True)
    finally:
        sys.argv = saved


def _fail(message: str) -> NoReturn:
    print(f"pd: {message} (pd --help lists the commands)", file=sys.stderr)
    raise SystemExit(2)


def usage() -> str:
    lines = ["usage: pd COMMAND [ARGS...]", "", __doc__.split("\n\n")[0], "", "commands:"]
    lines += [f"  pd {name:<22} {command.summary}" for name, command in TOP.items()]
    for group_name, group in GROUPS.items():
        lines += ["", f"  pd {group_name} NAME: {group.summary}"]
        lines += [f"    {name:<22} {command.summary}" for name, command in group.commands().items()]
    lines += ["", f"  pd serve: {SERVE_HINT}"]
    return "\n".join(lines)


def _group_main(group_name: str, args: list[str]) -> None:
    commands = GROUPS[group_name].commands()
    if not args or args[0] in ("-h", "--help", "--list"):
        print(f"pd {group_name} NAME [ARGS...]: {GROUPS[group_name].summary}")
        for name, command in commands.items():
            print(f"  {name:<18} {command.module:<22} {command.summary}")
        raise SystemExit(0 if args else 2)
    name, rest = args[0], args[1:]
    if name not in commands:
        _fail(f"unknown {group_name} command {name!r}; choose from {', '.join(commands)}")
    run(commands[name], rest)


def main(argv: Sequence[str] | None = None) -> None:
    """``pd COMMAND [ARGS...]``; a tool's own exit status is its ``SystemExit``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        raise SystemExit(0 if args else 2)
    name, rest = args[0], args[1:]
    if name == "serve":
        print(SERVE_HINT, file=sys.stderr)
        raise SystemExit(2)
    if name in TOP:
        run(TOP[name], rest)
    elif name in GROUPS:
        _group_main(name, rest)
    else:
        _fail(f"unknown command {name!r}; choose from {', '.join([*TOP, *GROUPS, 'serve'])}")


if __name__ == "__main__":
    main()
