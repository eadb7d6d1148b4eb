"""The ``pd`` command (``pd/cli.py``): its help, its tool lists, its errors, a real dispatch, its entry point.

In-process through ``pd.cli.main``: the console script is ``pd.cli:main`` itself
(checked against pyproject), and a child process would put this in the
integration tier.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

from pd import cli

REPO = Path(__file__).resolve().parents[2]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        cli.main(list(argv))
    out, err = capsys.readouterr()
    return exited.value.code or 0, out, err


def test_help_lists_every_group_and_command(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for name in [*cli.TOP, *cli.GROUPS, "serve"]:
        assert f"pd {name}" in out
    for group in cli.GROUPS.values():
        for name in group.commands():
            assert f"    {name} " in out
    assert "serve run" in out


def test_bench_list_names_modules_that_import_and_have_a_main(capsys):
    code, out, _ = run(capsys, "bench", "--list")
    assert code == 0
    listed = [line.split()[:2] for line in out.splitlines()[1:]]
    assert {"engine", "serve", "router"} <= {name for name, _ in listed}
    for name, module in listed:
        assert module == f"bench.{name}"
        assert hasattr(importlib.import_module(module), "main"), module


def test_every_group_command_is_a_runnable_module():
    for group in cli.GROUPS.values():
        for name, command in group.commands().items():
            spec = importlib.util.find_spec(command.module)
            assert spec is not None, (name, command.module)
    assert set(cli.GROUPS["sim"].commands()) >= {"run", "plan", "scale", "validate", "profile"}
    assert set(cli.GROUPS["loadtest"].commands()) >= {"run", "report", "sweep"}


@pytest.mark.parametrize("argv, named", [(["frobnicate"], "'frobnicate'"), (["bench", "nosuch"], "'nosuch'"),
                                         (["sim", "replay-all"], "'replay-all'")])
def test_an_unknown_command_fails_and_names_it(capsys, argv, named):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert named in err and "choose from" in err


def test_serve_points_at_serve_run(capsys):
    code, _, err = run(capsys, "serve")
    assert code == 2 and "serve run serve_configs/default.yaml" in err


# runpy warns when an earlier test imported the module already (here, bench.autoscale imports sim.plan); a
# `pd` process imports nothing before it.
@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import of package")
def test_a_command_runs_its_module_as_main_with_its_arguments(capsys):
    argv_before = list(sys.argv)
    code, out, _ = run(capsys, "sim", "plan", "--help")
    assert code == 0
    assert "--hardware" in out and "--gpus" in out  # sim.plan's own parser answered
    assert sys.argv == argv_before


def test_the_console_script_is_cli_main():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["pd"] == "pd.cli:main"
    module, function = scripts["pd"].split(":")
    assert getattr(importlib.import_module(module), function) is cli.main


def test_the_cli_imports_no_tool():
    """Tools run by name: ``pd/cli.py`` imports only the standard library."""
    tree = ast.parse(Path(cli.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
