"""Ahead-of-time compile check: every Triton kernel specialisation the engine can launch, for real GPUs.

``python -m pd_kernels.aot [--arch 80,90] [--quick] [--sass] [--allow-spills] [--jobs N] [--shared-limit B]``
compiles each specialisation to a cubin with Triton's bundled ``ptxas``. No
GPU is needed. It prints one JSON object per (specialisation, arch):
``name``, ``kernel``, ``arch``, ``dtype``, ``head_dim``, ``block_size`` (and
the spec's own keys: ``group``, ``batch``, ``sliding_window``, ``kv_dtype``,
``hidden``, ``block_m``, ``fp8_hw``), ``ok``, ``why``, ``registers``,
``spills`` and ``spill_bytes`` (the same bytes), ``shared_bytes`` and
``shared_limit_bytes``; ``error`` when it did not compile.

``name`` is the kernel, its path and its element format, dotted:
``attention.prefill.hd128.fp8_e4m3``, ``attention.decode.hd64.bf16``
(``attention``: the paged attention kernels, paths ``prefill``, ``decode``,
``mixed``, ``split``; the last part is the KV pages' format, the queries'
dtype for native pages), ``merge_splits.hd128.bf16``,
``store_kv.hd128.fp8_e5m2``, ``rotary.hd128.fp16``, ``rms_norm.h4096.bf16``,
``silu_and_mul.bf16``, ``moe_gate_up.decode.fp32``, ``scaled_mm.prefill.bf16``.
Names need not be unique: the other keys tell specialisations apart.

``--sass`` disassembles each cubin (``pd_kernels.sass``) and adds instruction
counts: ``hgmma`` and ``qgmma`` (sm_90's warpgroup MMAs over 16-bit and FP8
operands), ``hmma`` (``mma.sync``) and ``fp8_cvt`` (the hardware's FP8
conversions, ``F2FP`` naming E4M3 or E5M2).

It exits non-zero if a record fails a rule: its ``ok`` is false, its ``why``
lists one reason per rule broken, each starting with the rule's name, and a
line on stderr names the record (``FAILED attention.prefill.hd128.bf16
sm_80: spills: ...``). The rules:

- ``error``: it does not compile (its ``error``: the compiler's message);
- ``shared``: it needs more shared memory than the arch gives a block;
- ``spills``: it spills registers (to local memory, a round trip through the
  caches and DRAM); ``--allow-spills`` reports spills without failing, to
  explore tiles;

and with ``--sass``:

- ``hgmma``: a ``prefill`` attention specialisation over bf16 or fp16
  queries has no ``HGMMA`` on sm_90: its products run on ``mma.sync``, a
  fraction of Hopper's tensor-core rate;
- ``fp8_cvt``: an attention specialisation over FP8 pages has no hardware
  FP8 conversion on sm_89 or later: it decodes codes with integer arithmetic;
- ``tf32``: an fp32 specialisation has a tensor-core instruction (``HMMA``,
  ``HGMMA``, ``QGMMA``): its products would be TF32, and fp32 is IEEE here.

What is compiled, and how (alignment marks, device-dependent constexprs):
``pd_kernels.aot_specs``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from pathlib import Path

from pd_kernels.aot_specs import DTYPES, IEEE_DTYPES, SHARED_LIMIT_BYTES, Spec, all_specs, hardware_fp8_arch

# The arch with warpgroup MMAs (HGMMA): Hopper's, sm_90a, which Triton targets for capability 90.
HGMMA_ARCH = 90
ATTENTION_KERNELS = frozenset({"paged_attention", "prefill_attention", "latent_attention"})
SASS_BATCH = 128  # records disassembled by one nvdisasm call (pd_kernels.sass: each call costs ~0.35 s to start)


def compile_spec(spec: Spec, arch: int, shared_limit: int) -> tuple[dict, bytes | None]:
    """Compile one spec for ``arch``: its JSON record (what was measured, not yet judged), and its code
    (``pd_kernels.sass.code_of``), None where it did not compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pd_kernels.sass import code_of

    constexprs = spec.constexprs_for(arch)
    record = {"name": spec.name, "kernel": spec.kernel, "arch": arch, "dtype": spec.dtype,
              "head_dim": spec.head_dim, "block_size": spec.block_size, **spec.extra,
              **({"fp8_hw": constexprs["FP8_HW"]} if "FP8_HW" in constexprs else {}),
              "num_warps": spec.num_warps, "shared_limit_bytes": shared_limit}
    try:
        source = ASTSource(fn=spec.fn, signature=spec.signature(), constexprs=constexprs, attrs=spec.attributes())
        options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages, "maxnreg": spec.max_registers}
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                  options={k: v for k, v in options.items() if v is not None})
        registers, spills = ptxas_usage(compiled.asm["ptx"], arch)
    except Exception as exc:  # noqa: BLE001 - a compile error is this record's failure, reported
        return {**record, "error": f"{type(exc).__name__}: {str(exc)[:300]}", "registers": None, "spills": None,
                "spill_bytes": None, "shared_bytes": None}, None
    return {**record, "registers": registers, "spills": spills, "spill_bytes": spills,
            "shared_bytes": int(compiled.metadata.shared)}, code_of(compiled.asm["cubin"])


def ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """``(registers, spill bytes)`` of the kernel in ``ptx``, from Triton's bundled ``ptxas -v``."""
    from triton.backends.nvidia.compiler import get_ptxas

    target = re.search(r"^\.target\s+(\S+)", ptx, re.MULTILINE).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        done = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={target}", str(path), "-o",
                               str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True, check=True)
    report = done.stdout + done.stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))
    return registers, spills


def compile_failures(record: dict, allow_spills: bool) -> list[str]:
    """Why ``record`` fails the compile check (module doc), one reason each, named by its rule; empty when it
    passes."""
    if "error" in record:
        return [f"error: {record['error']}"]
    why = []
    if record["shared_bytes"] > record["shared_limit_bytes"]:
        why.append(f"shared: needs {record['shared_bytes']} bytes of shared memory, over the "
                   f"{record['shared_limit_bytes']} sm_{record['arch']} gives a block")
    if record["spills"] and not allow_spills:
        why.append(f"spills: {record['spills']} bytes of registers spilled to local memory")
    return why


def sass_failures(record: dict) -> list[str]:
    """Why ``record``'s SASS fails the check (module doc), one reason each, named by its rule (``hgmma``,
    ``fp8_cvt``, ``tf32``); empty when it passes or did not compile."""
    if record.get("hgmma") is None:
        return []
    why = []
    arch = record["arch"]
    attention = record["kernel"] in ATTENTION_KERNELS
    if attention and arch == HGMMA_ARCH and record["batch"] == "prefill" and record["dtype"] in DTYPES \
            and record["hgmma"] == 0:
        why.append(f"hgmma: prefill attention over {record['dtype']} queries runs no HGMMA on sm_{arch} "
                   f"({record['hmma']} HMMA): its products miss the warpgroup MMA")
    if attention and record["kv_dtype"] is not None and hardware_fp8_arch(arch) and record["fp8_cvt"] == 0:
        why.append(f"fp8_cvt: {record['kv_dtype']} pages read without the hardware's FP8 conversions on "
                   f"sm_{arch} (no F2FP naming E4M3/E5M2; FP8_HW {record.get('fp8_hw', 'not a parameter')})")
    if record["dtype"] in IEEE_DTYPES and record["hmma"] + record["hgmma"] + record["qgmma"]:
        why.append(f"tf32: {record['dtype']} products on tensor cores ({record['hmma']} HMMA, {record['hgmma']} "
                   f"HGMMA, {record['qgmma']} QGMMA): TF32, not IEEE fp32")
    return why


def with_sass(batch: list[tuple[dict, bytes | None]]) -> list[dict]:
    """The records of ``batch`` with their SASS counts (``pd_kernels.sass``): one nvdisasm call per arch."""
    from pd_kernels.sass import opcode_counts, sass_fields

    for arch in sorted({record["arch"] for record, code in batch if code is not None}):
        compiled = [(record, code) for record, code in batch if code is not None and record["arch"] == arch]
        for (record, _), counts in zip(compiled, opcode_counts(arch, [code for _, code in compiled])):
            record.update(sass_fields(counts))
    return [record for record, _ in batch]


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's current default, stated: no warning
    parser = argparse.ArgumentParser(prog="python -m pd_kernels.aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="80,90", help="comma-separated compute capabilities (80, 90)")
    parser.add_argument("--quick", action="store_true", help="one specialisation per kernel and batch kind")
    parser.add_argument("--shared-limit", type=int, default=None,
                        help="check against this many bytes of shared memory per block instead (another GPU)")
    parser.add_argument("--allow-spills", action="store_true", help="report register spills without failing")
    parser.add_argument("--sass", action="store_true",
                        help="count tensor-core and FP8-conversion instructions in the SASS, and check them")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 is set: kernels would be interpreted, not compiled; unset it")
    arches = [int(a) for a in args.arch.split(",")]
    unknown = [a for a in arches if a not in SHARED_LIMIT_BYTES]
    if unknown:
        parser.error(f"--arch {unknown}: this check knows {sorted(SHARED_LIMIT_BYTES)}")
    specs = all_specs(args.quick)
    jobs = [(args.quick, index, arch, args.shared_limit or SHARED_LIMIT_BYTES[arch])
            for index, spec in enumerate(specs) for arch in arches
            if arch >= spec.min_arch and spec.arch in (None, arch)]
    failed = []

    def report(records: list[dict]) -> None:
        for record in records:
            why = compile_failures(record, args.allow_spills) + (sass_failures(record) if args.sass else [])
            record.update(ok=not why, why=why)
            if why:
                failed.append(record)
            print(json.dumps(record), flush=True)

    with ProcessPoolExecutor(args.jobs) if args.jobs > 1 else nullcontext() as pool:
        results = pool.map(_compile_job, jobs) if pool is not None else map(_compile_job, jobs)
        batch = []
        for record, code in results:
            batch.append((record, code if args.sass else None))
            if not args.sass or len(batch) == SASS_BATCH:
                report(with_sass(batch))
                batch = []
        report(with_sass(batch))
    for record in failed:
        print(f"FAILED {record['name']} sm_{record['arch']}: {'; '.join(record['why'])}", file=sys.stderr)
    return 1 if failed else 0


def _compile_job(job: tuple) -> tuple[dict, bytes | None]:
    """One (spec, arch) compile, named by the spec's index: a worker process builds the same list."""
    quick, index, *rest = job
    return compile_spec(all_specs(quick)[index], *rest)


if __name__ == "__main__":
    sys.exit(main())
