"""What a compiled kernel runs: the opcodes of its SASS, counted, for the AOT check (``pd_kernels.aot``).

A cubin's code is disassembled with the ``nvdisasm`` Triton bundles. Each
call of it costs about 0.35 s before it reads a byte (its instruction tables),
and the rest is a few ms per kernel, so the code of many kernels goes through
one call: their ``.text.*`` sections laid end to end as one raw instruction
stream (``nvdisasm -b SM90a``), which it prints with each instruction's byte
offset. Kernel i owns ``[start_i, start_i + len_i)`` of that stream:

    stream:  | kernel 0 code | kernel 1 code | ... |
    offset:  0               start_1         start_2

Every instruction is 16 bytes on the arches checked (sm_80, sm_90), so the
pieces never split one. Decoded without the ELF, an instruction reads the
same (the same opcodes as ``nvdisasm -c kernel.cubin``).
"""

from __future__ import annotations

import re
import struct
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

# Opcodes counted, by their first dotted part: the tensor-core products and the FP8 conversions.
#   HMMA   mma.sync (sm_80 and later; on sm_90, a product Triton did not give to the warpgroup MMA):
#          HMMA.16816.F32.BF16 (bf16), HMMA.16816.F32 (fp16), HMMA.1688.F32.TF32 (tf32)
#   HGMMA  wgmma over 16-bit or tf32 operands, sm_90 only: HGMMA.64x64x16.F32.BF16, HGMMA.64x64x8.F32.TF32
#   QGMMA  wgmma over FP8 operands, sm_90 only: QGMMA.64x64x32.F32.E4M3.E4M3
# By the first part only: HFMA2.MMA is an fp16 FMA issued on the MMA pipe (ptxas's moves), no product.
TENSOR_CORE_OPCODES = ("HMMA", "HGMMA", "QGMMA")
# FP8 conversions by the hardware: F2FP (or F2F) whose type parts name an FP8 format. Seen on sm_90 from
# Triton 3.9 (ptxas 12.x):
#   codes.to(tl.float8e4nv, bitcast=True).to(tl.float16)  ->  F2FP.F16.E4M3.UNPACK_B        (cvt.rn.f16x2.e4m3x2)
#   codes.to(tl.float8e5, bitcast=True).to(tl.float16)    ->  F2FP.F16.E5M2.UNPACK_B        (cvt.rn.f16x2.e5m2x2)
#   x.to(tl.float8e4nv), x fp32 or bf16                   ->  F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C
#   x.to(tl.float8e4nv), x fp16                           ->  F2FP.SATFINITE.E4M3.F16.UNPACK_B_MERGE_C
# and not, for instance, F2FP.BF16.F32.PACK_AB (fp32 -> bf16) or F2F.BF16.F16 (fp16 -> bf16).
FP8_CONVERT_OPCODES = frozenset({"F2F", "F2FP"})
FP8_FORMATS = frozenset({"E4M3", "E5M2"})
# "        /*22d0*/                   @!P0 HGMMA.64x64x16.F32.BF16 R88, gdesc[UR8], RZ, !UPT ;": the offset, then
# the opcode after any predicate.
INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)", re.MULTILINE)


def code_of(cubin: bytes) -> bytes:
    """The instructions of a cubin (an ELF64 file): its ``.text.*`` sections (a Triton kernel has one)."""
    section_offset, = struct.unpack_from("<Q", cubin, 0x28)
    entry_size, num_sections, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    # Elf64_Shdr: name, type, flags, addr, offset, size, link, info, addralign, entsize
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, section_offset + i * entry_size)
                for i in range(num_sections)]
    names_start = sections[names_index][4]

    def name(offset: int) -> bytes:
        start = names_start + offset
        return cubin[start:cubin.index(b"\0", start)]

    return b"".join(cubin[s[4]:s[4] + s[5]] for s in sections if name(s[0]).startswith(b".text."))


def opcode_counts(arch: int, codes: list[bytes]) -> list[Counter]:
    """Each kernel's opcodes (first dotted part, and whole) on ``arch``, from one ``nvdisasm`` call."""
    import triton
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    starts, stream = [], bytearray()
    for code in codes:
        starts.append(len(stream))
        stream += code
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "code.bin"
        path.write_bytes(stream)
        binary_arch = "SM" + sm_arch_from_capability(arch).removeprefix("sm_")  # "SM90a": Triton's target
        listing = subprocess.run([triton.knobs.nvidia.nvdisasm.path, "-b", binary_arch, str(path)],
                                 capture_output=True, text=True, check=True).stdout
    counts = [Counter() for _ in codes]
    kernel = 0
    for match in INSTRUCTION.finditer(listing):
        offset = int(match.group(1), 16)
        while kernel + 1 < len(starts) and offset >= starts[kernel + 1]:
            kernel += 1
        counts[kernel][match.group(2)] += 1
    return counts


def sass_fields(counts: Counter) -> dict:
    """The AOT record's SASS fields: ``hgmma``, ``hmma``, ``qgmma`` and ``fp8_cvt`` instruction counts."""
    fields = dict.fromkeys(("hgmma", "hmma", "qgmma", "fp8_cvt"), 0)
    for opcode, n in counts.items():
        root, *parts = opcode.split(".")
        if root in TENSOR_CORE_OPCODES:
            fields[root.lower()] += n
        elif root in FP8_CONVERT_OPCODES and FP8_FORMATS.intersection(parts):
            fields["fp8_cvt"] += n
    return fields
