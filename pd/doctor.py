"""Pre-flight check of a node before serving: ``python -m pd.doctor [--json] [--config FILE] [--model M]``.

One row per check (ok/warn/fail/skip, a one-line detail, measured values): config, versions, nixl, cpu, gpu,
ports and model, each described by its function. A check catches its own errors, so one broken check never
hides the others; the exit status is 1 when any row failed. Torch, Ray and NIXL load inside the checks.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import enum
import json
import logging
import os
import platform
import re
import socket
import subprocess
import sys
import time
import timeit
from dataclasses import asdict, dataclass, field
from importlib import import_module, metadata
from pathlib import Path
from typing import Any, Callable, Sequence

DEFAULT_MODEL = "builtin:tiny-llama"
APP_IMPORT_PATH = "pd.serve.app:build_app"
# Serve's HTTP port, Ray's GCS and its dashboard, as ``serve run`` and ``ray start`` bind them by default.
DEFAULT_PORTS = {"http": 8000, "gcs": 6379, "dashboard": 8265}
# The loopback read: 64 one-MiB blocks as 4 runs of 16, so 4 descriptors of 16 MiB (``transfer.block_runs``),
# timed after 1 warm-up read over 5 more.
LOOPBACK_BLOCKS, LOOPBACK_BLOCK_BYTES, LOOPBACK_RUNS, LOOPBACK_WARMUP, LOOPBACK_ROUNDS = 64, 1 << 20, 4, 1, 5
# The model check's KV pool, and the tokens it generates.
MODEL_NUM_BLOCKS, MODEL_MAX_TOKENS = 64, 2
UCP_FEATURES = (1 << 1) | (1 << 6)  # UCP_FEATURE_RMA | UCP_FEATURE_AM (ucp.h): one-sided reads, notifications


class Status(str, enum.Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


@dataclass(frozen=True)
class Finding:
    """What one check found: its status, one line for people, and the measured values for machines."""

    status: Status
    detail: str
    values: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """What the checks examine: the command line's choices, completed from a serve config where one is given."""

    model: str = DEFAULT_MODEL
    revision: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    ports: tuple[tuple[str, int], ...] = tuple(DEFAULT_PORTS.items())
    ucx_net_devices: str | None = None
    build: bool = False  # whether the C++ kernels may be compiled here (minutes on a small machine)


def make_plan(args: argparse.Namespace) -> tuple[Plan, Finding]:
    """The plan and the ``config`` row: the ``pd`` application of a ``serve run`` YAML, checked by the app's own
    ``AppArgs``, and its HTTP port. A config that does not parse fails that row, and defaults stand in."""
    ports, app, config = dict(DEFAULT_PORTS), None, Finding(Status.SKIP, "no --config given")
    if args.config:
        try:
            import yaml

            from pd.config.app import AppArgs

            document = yaml.safe_load(Path(args.config).read_text()) or {}
            apps = [a for a in document.get("applications") or [] if a.get("import_path") == APP_IMPORT_PATH]
            if not apps:
                raise ValueError(f"no application with import_path {APP_IMPORT_PATH}")
            ports["http"] = int((document.get("http_options") or {}).get("port", DEFAULT_PORTS["http"]))
            app = AppArgs.parse(apps[0].get("args"))
            config = Finding(Status.OK, f"{args.config}: {app.mode}, {app.transfer_backend} transfer, model "
                             f"{app.engine.model}, http port {ports['http']}",
                             {"mode": app.mode, "transfer_backend": app.transfer_backend, "model": app.engine.model,
                              "http_port": ports["http"], "ucx_net_devices": app.ucx_net_devices})
        except Exception as exc:  # noqa: BLE001 - a bad config is this row's failure; the other checks still run
            config = Finding(Status.FAIL, f"{args.config}: {type(exc).__name__}: {exc}")
    ports.update({name: port for name in (*DEFAULT_PORTS, "metrics") if (port := getattr(args, f"{name}_port"))})
    chosen = {"model": app.engine.model, "revision": app.engine.revision, "dtype": app.engine.dtype,
              "device": app.engine.device, "ucx_net_devices": app.ucx_net_devices} if app else {}
    chosen.update({"model": args.model, "revision": None} if args.model else {})
    chosen.update({"revision": args.revision} if args.revision else {})
    return Plan(ports=tuple(ports.items()), build=args.build, **chosen), config


def check_versions(plan: Plan) -> Finding:
    """Python and the installed packages; a missing Ray (or Serve), torch or NIXL fails, naming it."""
    values: dict[str, Any] = {"python": platform.python_version()}
    for name in ("pd-serve", "ray", "torch", "transformers", "nixl", "nixl-cu12", "nixl-cu13"):
        values[name] = None
        with contextlib.suppress(metadata.PackageNotFoundError):
            values[name] = metadata.version(name)
    missing = [f"{name} (pip install {name})" for name in ("torch", "nixl") if values[name] is None]
    try:
        import ray
        import ray.serve  # noqa: F401 - importable is what is checked
        values["ray"], values["serve"] = ray.__version__, True
    except ImportError as exc:
        values["serve"] = False
        missing.insert(0, f"ray[serve] ({exc})")
    names = ", ".join(f"{n} {values[n] or 'missing'}" for n in ("python", "ray", "torch", "transformers", "nixl"))
    if missing:
        return Finding(Status.FAIL, f"missing {'; '.join(missing)}; {names}", values)
    return Finding(Status.OK, f"{names}; serve importable", values)


def ucx_resources(build: str) -> list[str]:
    """The UCX resources (``transport/device``) a UCP context opens here (``ucp_context_print_info``), from the
    UCX that the NIXL build ``build`` ships; ``UCX_TLS`` and ``UCX_NET_DEVICES`` filter them as for NIXL."""
    libs = Path(import_module(build).__file__).parent.parent / f"{build}.libs"
    ucp = ctypes.CDLL(str(min(libs.glob("libucp*.so*"), default=libs / "libucp.so")))  # a missing one raises
    libc, context = ctypes.CDLL(None), ctypes.c_void_p()
    libc.tmpfile.restype = ctypes.c_void_p
    # ucp_params_t: field_mask FIELD_FEATURES, then features. API 1.0 (any UCX 1.x); a NULL config reads UCX_*.
    params = (ctypes.c_uint64 * 32)(1, UCP_FEATURES)
    if ucp.ucp_init_version(1, 0, params, None, ctypes.byref(context)) != 0:
        raise RuntimeError("ucp_init failed")
    stream, text = ctypes.c_void_p(libc.tmpfile()), ctypes.create_string_buffer(1 << 16)
    try:
        if not stream.value:
            raise OSError("tmpfile() failed")
        ucp.ucp_context_print_info(context, stream)
        libc.rewind(stream)  # flushes, then reads from the start
        size = libc.fread(text, 1, len(text) - 1, stream)
        libc.fclose(stream)
    finally:
        ucp.ucp_cleanup(context)
    return re.findall(r"resource\s+\d+\s*:.*--\s*(\S+)", text.raw[:size].decode(errors="replace"))


def loopback(rounds: int = LOOPBACK_ROUNDS) -> dict[str, Any]:
    """Median GB/s of READs between two of the project's NIXL transports in this process, and of one memcpy; remote
    blocks land in local ones in reversed runs, and the words (their own indices) are compared after the reads."""
    import torch

    from pd.workload.stats import percentile
    from transfer import TransferState, block_runs, create_transport

    words, run, tag = LOOPBACK_BLOCK_BYTES // 4, LOOPBACK_BLOCKS // LOOPBACK_RUNS, f"pd-doctor-{os.getpid()}"
    owner_pool = torch.arange(LOOPBACK_BLOCKS * words, dtype=torch.int32).view(LOOPBACK_BLOCKS, words)
    reader_pool, remote_ids = torch.zeros_like(owner_pool), list(range(LOOPBACK_BLOCKS))
    local_ids = [(LOOPBACK_RUNS - 1 - i // run) * run + i % run for i in remote_ids]
    owner, reader, seconds = create_transport("nixl", f"{tag}-owner"), create_transport("nixl", f"{tag}-reader"), []
    try:
        owner.register(owner_pool)
        reader.register(reader_pool)
        peer = reader.add_peer(owner.local_metadata())
        for i in range(LOOPBACK_WARMUP + rounds):
            start = time.perf_counter()
            handle = reader.read_blocks(peer, remote_ids, local_ids, notify=f"{tag}-{i}")
            while (state := handle.poll()) is TransferState.PENDING:  # spins: a sleep would be timed too
                pass
            if state is not TransferState.DONE:
                raise RuntimeError(f"loopback read {i} ended {state.value}: {handle.error}")
            seconds.append(time.perf_counter() - start)
        verified = torch.equal(reader_pool[torch.tensor(local_ids)], owner_pool)
    finally:
        reader.close()
        owner.close()
    total = LOOPBACK_BLOCKS * LOOPBACK_BLOCK_BYTES
    copies = timeit.repeat(lambda: ctypes.memmove(reader_pool.data_ptr(), owner_pool.data_ptr(), total), number=1)
    gb_per_s, memcpy_gb_per_s = (total / percentile(times, 50) / 1e9 for times in (seconds[LOOPBACK_WARMUP:], copies))
    return {"bytes": total, "descriptors": len(block_runs(remote_ids, local_ids)), "rounds": rounds,
            "gb_per_s": round(gb_per_s, 3), "memcpy_gb_per_s": round(memcpy_gb_per_s, 3),
            "ratio_vs_memcpy": round(gb_per_s / memcpy_gb_per_s, 3), "verified": verified}


def check_nixl(plan: Plan) -> Finding:
    """NIXL's build and plugins, UCX's transports, and a verified loopback read with its bandwidth."""
    if plan.ucx_net_devices is not None:
        os.environ["UCX_NET_DEVICES"] = plan.ucx_net_devices  # as the config's replicas set it (engine_server)
    from transfer.nixl_api import BUILD, make_agent

    logging.getLogger("nixl").setLevel(logging.WARNING)  # NIXL logs INFO lines to stdout
    plugins = sorted(make_agent(f"pd-doctor-{os.getpid()}-probe", []).plugin_list)
    values: dict[str, Any] = {"build": BUILD, "plugins": plugins, "ucx_tls": os.environ.get("UCX_TLS"),
                              "ucx_net_devices": os.environ.get("UCX_NET_DEVICES")}
    try:
        values["ucx_resources"] = ucx_resources(BUILD)
        transports = " ".join(values["ucx_resources"])
    except Exception as exc:  # noqa: BLE001 - UCX's own list is extra: the loopback still shows whether UCX works
        values["ucx_resources"], transports = None, f"unlisted ({exc})"
    head = (f"{BUILD}, plugins {','.join(plugins)}; UCX {transports} (UCX_TLS={values['ucx_tls'] or 'unset'}, "
            f"UCX_NET_DEVICES={values['ucx_net_devices'] or 'unset'})")
    if "UCX" not in plugins:
        return Finding(Status.FAIL, f"{head}; no UCX plugin: KV cannot move between replicas", values)
    try:
        values["loopback"] = got = loopback()
    except Exception as exc:  # noqa: BLE001 - the row keeps what NIXL and UCX offer, with why the read failed
        return Finding(Status.FAIL, f"{head}; loopback failed: {type(exc).__name__}: {exc}", values)
    line = (f"{head}; loopback {got['bytes'] >> 20} MiB in {got['descriptors']} descriptors {got['gb_per_s']:.2f} "
            f"GB/s (memcpy {got['memcpy_gb_per_s']:.2f}, {got['ratio_vs_memcpy']:.2f}x)")
    if not got["verified"]:
        return Finding(Status.FAIL, f"{line}; the bytes read differ from the source", values)
    return Finding(Status.OK, line, values)


def check_cpu(plan: Plan) -> Finding:
    """The CPU, its ISA flags, the kernels' ISA level and build, and what ``auto`` attention runs on CPU."""
    import torch

    import pd_kernels.cpu
    from pd.workload.host import cpu_flags, cpu_name

    level = pd_kernels.cpu.isa()
    library, state = pd_kernels.cpu.build_state(level)
    values: dict[str, Any] = {"name": cpu_name(), "flags": cpu_flags(), "isa": level, "cores": os.cpu_count(),
                              "usable_cores": len(os.sched_getaffinity(0)), "kernels_library": str(library),
                              "kernels": state, "attention_backend": None}
    head = f"{values['name']}, {values['usable_cores']} cores, {' '.join(values['flags']) or 'no ISA flags'}; {level}"
    if state != "built" and not plan.build:
        return Finding(Status.WARN, f"{head}; C++ kernels {state} ({library}): run `pd kernels build` or pass "
                       "--build, else the engine's start compiles them", values)
    started = time.perf_counter()
    pd_kernels.cpu.build()  # loads the library, or compiles it (--build)
    values["kernels_load_s"], values["kernels"] = round(time.perf_counter() - started, 3), "loaded"
    values["attention_backend"] = backend = pd_kernels.resolve_backend("auto", torch.device("cpu"))
    return Finding(Status.OK if backend == "cpu" else Status.WARN, f"{head}; C++ kernels loaded in "
                   f"{values['kernels_load_s']:.2f} s; auto attention on CPU: {backend}", values)


def check_gpu(plan: Plan) -> Finding:
    """CUDA devices with capability and memory, and the driver ``nvidia-smi`` reports; ``skip`` with no CUDA device."""
    import torch

    driver = None
    with contextlib.suppress(OSError, subprocess.SubprocessError, IndexError):  # no nvidia-smi, or it failed
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20, check=True)
        driver = done.stdout.split()[0]
    values: dict[str, Any] = {"cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
                              "driver": driver, "devices": []}
    if not values["cuda_available"]:
        if driver is not None:
            return Finding(Status.WARN, f"driver {driver}, but torch {torch.__version__} sees no CUDA device", values)
        return Finding(Status.SKIP, "no CUDA device", values)
    values["devices"] = [{"name": p.name, "capability": f"{p.major}.{p.minor}",
                          "memory_gib": round(p.total_memory / 2**30, 1)}
                         for p in map(torch.cuda.get_device_properties, range(torch.cuda.device_count()))]
    names = ", ".join(f"{d['name']} (sm {d['capability']}, {d['memory_gib']} GiB)" for d in values["devices"])
    return Finding(Status.OK, f"{names}; driver {driver or 'unknown'}, CUDA {torch.version.cuda}", values)


def check_ports(plan: Plan) -> Finding:
    """Each port a deployment binds: listening (where, by whom), in use, or free; and the IPv4 interfaces.
    Listeners come from ``psutil.net_connections``; where the OS does not list them to us, a bind decides."""
    import psutil

    listening: dict[int, list[dict[str, Any]]] = {}
    try:
        connections = psutil.net_connections(kind="inet")
    except (psutil.AccessDenied, PermissionError):
        connections, listening = [], None
    for conn in (c for c in connections if c.status == psutil.CONN_LISTEN and c.laddr):
        owner = None
        with contextlib.suppress(psutil.Error):
            owner = psutil.Process(conn.pid).name() if conn.pid else None
        listening.setdefault(conn.laddr.port, []).append({"address": conn.laddr.ip, "pid": conn.pid, "process": owner})
    ports, parts = [], []
    for name, port in plan.ports:
        found, state = (listening or {}).get(port, []), "listening"
        if not found:  # free if a socket binds it on every interface (SO_REUSEADDR: TIME_WAIT does not count)
            with socket.socket() as probe, contextlib.suppress(OSError):
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                state = "in use"
                probe.bind(("0.0.0.0", port))
                state = "free"
        ports.append({"name": name, "port": port, "state": state, "listeners": found})
        where = ", ".join(sorted({f"{s['address']} ({s['process'] or s['pid']})" for s in found}))
        parts.append(f"{name} {port} {state}{' on ' + where if found else ''}")
    interfaces = {name: ipv4 for name, addresses in psutil.net_if_addrs().items()
                  if (ipv4 := [a.address for a in addresses if a.family == socket.AF_INET])}
    shown = ", ".join(f"{name} {' '.join(addresses)}" for name, addresses in interfaces.items())
    busy = any(entry["state"] != "free" for entry in ports)  # a running Ray, or something in the deployment's way
    return Finding(Status.WARN if busy else Status.OK, f"{'; '.join(parts)}; interfaces {shown}",
                   {"ports": ports, "interfaces": interfaces, "listeners_listed": listening is not None})


def check_model(plan: Plan) -> Finding:
    """The model resolved, its config and tokenizer read, loaded with ``pd.LLM`` and run for 2 greedy tokens;
    one that does not is a ``fail`` naming it (``run_checks``)."""
    import pd_kernels.cpu
    from pd import LLM, SamplingParams
    from pd.model.config import load_model_config
    from pd.model.paths import resolve_model_path
    from pd.model.tokenizer import Tokenizer

    path = resolve_model_path(plan.model, plan.revision)
    config, tokenizer = load_model_config(path), Tokenizer.from_dir(path)
    # Without --build, kernels not built are the cpu row's to report: the reference runs here, nothing compiles.
    unbuilt = plan.device == "cpu" and not plan.build and pd_kernels.cpu.build_state()[1] != "built"
    backend = "torch" if unbuilt else "auto"
    prompt = tokenizer.encode("The capital of France is") if tokenizer else [1, 2, 3, 4]
    started = time.perf_counter()
    llm = LLM(plan.model, revision=plan.revision, dtype=plan.dtype, device=plan.device,
              num_blocks=MODEL_NUM_BLOCKS, attention_backend=backend)
    load_s = time.perf_counter() - started
    try:
        [out] = llm.generate([prompt], SamplingParams(max_tokens=MODEL_MAX_TOKENS, temperature=0))
    finally:
        llm.close()
    values = {"model": plan.model, "path": str(path), "architecture": config.architecture, "dtype": plan.dtype,
              "num_layers": config.num_layers, "tokenizer": tokenizer is not None, "device": plan.device,
              "attention_backend": backend, "load_s": round(load_s, 3), "token_ids": out.token_ids}
    return Finding(Status.OK, f"{plan.model}: {config.architecture}, {config.num_layers} layers, "
                   f"{'a' if tokenizer else 'no'} tokenizer; loaded in {load_s:.2f} s ({plan.device}, {plan.dtype}, "
                   f"attention {backend}), generated {out.token_ids}", values)


CHECKS: dict[str, Callable[[Plan], Finding]] = {"versions": check_versions, "nixl": check_nixl, "cpu": check_cpu,
                                                "gpu": check_gpu, "ports": check_ports, "model": check_model}
NAMES = ("config", *CHECKS)
SKIPPED = Finding(Status.SKIP, "skipped (--skip)")


def run_checks(plan: Plan, config: Finding, skip: Sequence[str] = ()) -> dict[str, Finding]:
    """Every row in ``NAMES`` order, each detail on one line; a check that raises is a ``fail`` naming the error."""
    rows = {"config": SKIPPED if "config" in skip else config}
    for name, check in CHECKS.items():
        try:
            rows[name] = SKIPPED if name in skip else check(plan)
        except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
            subject = f"model {plan.model!r}: " if name == "model" else ""
            rows[name] = Finding(Status.FAIL, f"{subject}{type(exc).__name__}: {exc}")
    return {name: Finding(row.status, " ".join(row.detail.split()), row.values) for name, row in rows.items()}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pd.doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--config", help="a serve_configs/ YAML: its model, HTTP port and UCX devices")
    parser.add_argument("--model", help=f"the model to load (default: the config's, else {DEFAULT_MODEL})")
    parser.add_argument("--revision", help="a hub model's branch, tag or commit")
    parser.add_argument("--skip", action="append", default=[], choices=NAMES, help="skip a check (repeatable)")
    parser.add_argument("--build", action="store_true", help="compile the C++ CPU kernels if they are not built")
    for name, default in {**DEFAULT_PORTS, "metrics": "none"}.items():  # Serve's HTTP, Ray's GCS, dashboard, metrics
        parser.add_argument(f"--{name}-port", type=int, help=f"the {name} port to check (default {default})")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the checks and print the table (or ``--json``); returns the exit status, 1 if any row failed."""
    args = parse_args(argv)
    # What the checks print goes to stderr, C libraries' lines too (UCX logs to stdout): stdout is the report.
    sys.stdout.flush()
    saved_fd = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            plan, config = make_plan(args)
            rows = run_checks(plan, config, args.skip)
    finally:
        ctypes.CDLL(None).fflush(None)  # C streams' buffers land on stderr too
        os.dup2(saved_fd, 1)
        os.close(saved_fd)
    status = int(any(row.status is Status.FAIL for row in rows.values()))
    if args.json:
        print(json.dumps({"exit_status": status, "checks": {name: asdict(row) for name, row in rows.items()}},
                         default=str))
    else:  # a header, then one line per row
        width = max(len(name) for name in rows)
        print("\n".join([f"{'CHECK':<{width}}  STATUS  DETAIL"]
                        + [f"{name:<{width}}  {row.status.value:<6}  {row.detail}" for name, row in rows.items()]))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
