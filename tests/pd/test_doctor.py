"""``pd doctor`` (``pd/doctor.py``): its real checks on this machine.

In process through ``doctor.main`` (one full run shared by the module: NIXL's loopback and a model load
take seconds), and in a child Python for what only a fresh process shows: the exit status of ``python -m
pd.doctor``, a stdout that is nothing but the JSON report, an import that loads no torch or Ray, a UCX
restricted to transports NIXL cannot connect over, and Ray and NIXL whose imports fail.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import pd_kernels
import pd_kernels.cpu
from pd import doctor
from pd.model.config import load_model_config
from pd.model.paths import resolve_model_path
from pd.workload.host import cpu_flags

REPO = Path(__file__).resolve().parents[2]
MODEL = "builtin:tiny-llama"


def run(*argv: str) -> tuple[int, str]:
    """``doctor.main(argv)``: its exit status and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = doctor.main(list(argv))
    return status, out.getvalue()


def run_json(*argv: str) -> tuple[int, dict]:
    status, out = run("--json", *argv)
    report = json.loads(out)
    assert report["exit_status"] == status
    return status, report["checks"]


def only(*names: str) -> list[str]:
    """``--skip`` options for every check but ``names``."""
    return [option for name in doctor.CHECKS if name not in names for option in ("--skip", name)]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def busy_port():
    """A port this process listens on, on 127.0.0.1 only."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


@pytest.fixture(scope="module")
def full_report(busy_port):
    """Every check, once, with ``busy_port`` as Serve's HTTP port. The other ports are free ones of this run: a test
    probes none that a concurrent run may be binding."""
    return run_json("--model", MODEL, "--http-port", str(busy_port), "--gcs-port", str(free_port()),
                    "--dashboard-port", str(free_port()))


def test_every_check_reports_and_nothing_fails_here(full_report):
    status, checks = full_report
    assert list(checks) == list(doctor.NAMES)
    assert status == 0, {name: row["detail"] for name, row in checks.items() if row["status"] == "fail"}
    assert checks["config"] == {"status": "skip", "detail": "no --config given", "values": {}}
    for row in checks.values():
        assert row["status"] in {"ok", "warn", "fail", "skip"} and "\n" not in row["detail"]


def test_versions_are_the_imported_ones(full_report):
    import ray
    import torch

    versions = full_report[1]["versions"]
    assert versions["status"] == "ok"
    values = versions["values"]
    assert (values["ray"], values["serve"], values["torch"]) == (ray.__version__, True, torch.__version__)
    assert values["python"] == ".".join(map(str, sys.version_info[:3]))
    assert values["nixl"] and f"nixl {values['nixl']}" in versions["detail"]


def test_nixl_loopback_moves_the_bytes_and_measures_them(full_report):
    nixl = full_report[1]["nixl"]
    assert nixl["status"] == "ok", nixl["detail"]
    values = nixl["values"]
    assert "UCX" in values["plugins"] and values["build"] in ("nixl_cu12", "nixl_cu13")
    assert values["ucx_resources"] and all("/" in resource for resource in values["ucx_resources"])
    loopback = values["loopback"]
    assert (loopback["bytes"], loopback["descriptors"], loopback["verified"]) == (64 << 20, 4, True)
    assert loopback["gb_per_s"] > 0 and loopback["memcpy_gb_per_s"] > 0
    assert f"{loopback['gb_per_s']:.2f} GB/s" in nixl["detail"]


def test_cpu_names_the_isa_the_kernels_select(full_report):
    import torch

    cpu = full_report[1]["cpu"]
    values = cpu["values"]
    level = pd_kernels.cpu.isa()
    assert values["isa"] == level and level in pd_kernels.cpu.ISA_FLAGS
    assert values["flags"] == cpu_flags()
    # The doctor finds the library where pd_kernels.cpu builds it, without building anything itself.
    assert Path(values["kernels_library"]).parent == pd_kernels.cpu._build_directory(level)
    if cpu["status"] == "ok":
        assert values["kernels"] == "loaded"
        assert values["attention_backend"] == pd_kernels.resolve_backend("auto", torch.device("cpu"))
    else:  # kernels not built (or older than their sources) on this checkout
        assert cpu["status"] == "warn" and values["kernels"] in ("missing", "stale") and "--build" in cpu["detail"]


def test_gpu_is_skipped_without_cuda(full_report):
    import torch

    gpu = full_report[1]["gpu"]
    if torch.cuda.is_available():
        assert gpu["status"] == "ok" and len(gpu["values"]["devices"]) == torch.cuda.device_count()
    else:
        assert (gpu["status"], gpu["detail"], gpu["values"]["devices"]) == ("skip", "no CUDA device", [])


def test_a_port_in_use_is_listening_on_its_address(full_report, busy_port):
    ports = full_report[1]["ports"]
    assert ports["status"] == "warn"  # a port the deployment needs is taken
    [entry] = [entry for entry in ports["values"]["ports"] if entry["port"] == busy_port]
    assert [(s["address"], s["pid"]) for s in entry["listeners"]] == [("127.0.0.1", os.getpid())]
    assert f"http {busy_port} listening on 127.0.0.1" in ports["detail"]
    assert [(entry["name"], entry["state"]) for entry in ports["values"]["ports"]] == [
        ("http", "listening"), ("gcs", "free"), ("dashboard", "free")]
    assert ports["values"]["interfaces"]["lo"] == ["127.0.0.1"]


def test_the_model_loads_and_generates_two_tokens(full_report):
    model = full_report[1]["model"]
    assert model["status"] == "ok", model["detail"]
    values = model["values"]
    config = load_model_config(resolve_model_path(MODEL))
    assert (values["architecture"], values["num_layers"]) == (config.architecture, config.num_layers)
    assert len(values["token_ids"]) == 2 and all(0 <= t < config.vocab_size for t in values["token_ids"])
    assert values["tokenizer"] is True and values["load_s"] > 0


def test_a_model_that_does_not_resolve_fails_and_the_rest_still_report():
    status, checks = run_json("--model", "/nonexistent", "--skip", "nixl", "--skip", "ports")
    assert status == 1
    assert checks["model"]["status"] == "fail"
    assert "'/nonexistent'" in checks["model"]["detail"] and "does not exist" in checks["model"]["detail"]
    assert list(checks) == list(doctor.NAMES)
    assert checks["versions"]["status"] == "ok" and checks["cpu"]["status"] in ("ok", "warn")
    assert (checks["nixl"]["status"], checks["ports"]["status"]) == ("skip", "skip")


def test_the_table_prints_one_line_per_check():
    status, out = run("--skip", "nixl", "--skip", "model", "--skip", "ports")
    header, *lines = out.splitlines()
    assert header.split() == ["CHECK", "STATUS", "DETAIL"]
    assert [line.split()[0] for line in lines] == list(doctor.NAMES)
    statuses = dict(line.split()[:2] for line in lines)
    assert statuses["nixl"] == statuses["model"] == statuses["config"] == "skip"
    assert statuses["versions"] == "ok" and status == 0


def test_skip_skips_and_refuses_unknown_names(capsys):
    status, checks = run_json(*only())
    assert status == 0
    assert {name: (row["status"], row["values"]) for name, row in checks.items()} == {
        name: ("skip", {}) for name in doctor.NAMES}
    assert checks["ports"]["detail"] == "skipped (--skip)"
    with pytest.raises(SystemExit) as exited:
        doctor.main(["--skip", "nixel"])
    assert exited.value.code == 2 and "invalid choice: 'nixel'" in capsys.readouterr().err


def test_a_serve_config_sets_the_model_the_http_port_and_ucx_devices():
    path = REPO / "serve_configs" / "default.yaml"
    document = yaml.safe_load(path.read_text())
    args = document["applications"][0]["args"]
    plan, config = doctor.make_plan(doctor.parse_args(["--config", str(path)]))
    assert config.status is doctor.Status.OK and config.values["model"] == args["engine"]["model"]
    assert (plan.model, plan.dtype, plan.ucx_net_devices) == (args["engine"]["model"], args["engine"]["dtype"],
                                                              args["ucx_net_devices"])
    assert dict(plan.ports) == {"http": document["http_options"]["port"], "gcs": 6379, "dashboard": 8265}
    plan, _ = doctor.make_plan(doctor.parse_args(["--config", str(path), "--model", MODEL, "--http-port", "18123",
                                                  "--metrics-port", "18124"]))
    assert plan.model == MODEL and dict(plan.ports) == {"http": 18123, "gcs": 6379, "dashboard": 8265,
                                                        "metrics": 18124}


def test_a_bad_config_fails_its_row_naming_the_field(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump({"applications": [
        {"name": "pd", "import_path": doctor.APP_IMPORT_PATH, "args": {"engine": {"modle": MODEL}}}]}))
    status, checks = run_json("--config", str(path), *only("versions"))
    assert status == 1
    assert checks["config"]["status"] == "fail" and "engine.modle" in checks["config"]["detail"]
    assert checks["versions"]["status"] == "ok"  # the other checks still run
    plan, _ = doctor.make_plan(doctor.parse_args(["--config", str(path)]))
    assert plan == doctor.Plan()  # the defaults stand in for the config's


def test_unbuilt_kernels_warn_and_nothing_is_compiled(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # torch's extension root: empty here
    _, checks = run_json(*only("cpu"))
    cpu = checks["cpu"]
    assert cpu["status"] == "warn" and cpu["values"]["kernels"] == "missing"
    assert cpu["values"]["kernels_library"].startswith(str(tmp_path)) and "--build" in cpu["detail"]
    assert cpu["values"]["attention_backend"] is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.integration  # a child Python: the exit status and stdout of `python -m`, a fresh import state
def test_the_command_line_prints_only_json_and_exits_1_on_a_failure():
    argv = ["--json", "--model", "/nonexistent", "--skip", "cpu", "--skip", "ports"]
    done = subprocess.run([sys.executable, "-m", "pd.doctor", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    checks = json.loads(done.stdout)["checks"]  # NIXL's INFO lines would break this
    assert checks["model"]["status"] == "fail" and checks["nixl"]["status"] == "ok"
    code = ("import sys, pd.doctor; pd.doctor.parse_args(['--json']); "
            "print(sorted(name for name in ('torch', 'ray', 'nixl_cu12') if name in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stderr[-2000:]


@pytest.mark.integration  # a child Python: UCX reads its environment once, when the first agent starts
def test_a_ucx_that_cannot_connect_fails_the_nixl_row_and_keeps_stdout_clean():
    """Shared memory without active messages: NIXL's agents cannot connect, and UCX logs its error to stdout."""
    env = {**os.environ, "UCX_TLS": "cma,self"}
    done = subprocess.run([sys.executable, "-m", "pd.doctor", "--json", *only("nixl", "versions")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    checks = json.loads(done.stdout)["checks"]  # UCX's error line went to stderr
    nixl = checks["nixl"]
    assert nixl["status"] == "fail" and "loopback failed" in nixl["detail"] and "UCX_TLS=cma,self" in nixl["detail"]
    assert sorted(nixl["values"]["ucx_resources"]) == ["cma/memory", "self/memory"]
    assert checks["versions"]["status"] == "ok"


MISSING_RAY_AND_NIXL = """
import sys
for missing in ("ray", "nixl", "nixl_cu12", "nixl_cu13"):
    sys.modules[missing] = None  # import of it now raises ImportError
from pd import doctor
sys.exit(doctor.main(sys.argv[1:]))
"""


@pytest.mark.integration  # a child Python, whose imports of Ray and NIXL fail
def test_missing_ray_and_nixl_are_fail_rows_naming_them():
    done = subprocess.run([sys.executable, "-c", MISSING_RAY_AND_NIXL, "--json", *only("versions", "nixl", "cpu")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    checks = json.loads(done.stdout)["checks"]
    assert checks["versions"]["status"] == "fail" and "missing ray[serve]" in checks["versions"]["detail"]
    assert checks["versions"]["values"]["serve"] is False
    assert checks["nixl"]["status"] == "fail" and "NIXL is not installed" in checks["nixl"]["detail"]
    assert checks["cpu"]["status"] in ("ok", "warn")  # the engine's side needs neither
