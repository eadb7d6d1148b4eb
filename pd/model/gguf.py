"""GGUF checkpoints (llama.cpp's format), read with the ``gguf`` package and converted once into an HF directory.

A GGUF file holds the weights (often quantized), the model's shape and its
tokenizer as metadata under llama.cpp's key names. ``gguf_checkpoint(path)``
turns it into the ordinary checkpoint directory the engine, the ingress and
tensor-parallel ranks already read, under the cache (``pd.model.builtin.cache_dir``):

    config.json               from ``{arch}.*`` metadata
    model.safetensors         every tensor under its HF name, dequantized to fp32
                              (F32, F16 and BF16 tensors kept as stored)
    tokenizer.json            byte-level BPE from ``tokenizer.ggml.*`` (``pd.model.gguf_tokenizer``)
    tokenizer_config.json     special tokens and ``tokenizer.chat_template``
    generation_config.json

The engine then casts to its own dtype at load, as for any checkpoint. The
conversion (``pd.model.gguf_convert``) runs once per file content
(``content_digest``, and ``CONVERTER_VERSION``) under a file lock, written
under a temporary name and renamed into place, so concurrent replicas find it
absent or complete; later starts read the cached directory. This module, the
path and cache half, imports no torch: the ingress resolves its model through
it and loads only the tokenizer.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

from pd.model.builtin import write_once

logger = logging.getLogger(__name__)

# Bump when the converted directory's contents change for the same file.
CONVERTER_VERSION = 1


def find_gguf(path: Path) -> Path | None:
    """The GGUF file ``path`` names: itself, or the one ``.gguf`` in a directory that has no ``config.json``."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {str(path)!r} is not a .gguf file; give a .gguf file or a checkpoint "
                             f"directory")
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"model directory {str(path)!r} holds {len(files)} GGUF files "
                         f"({', '.join(f.name for f in files)}); name the one to serve")
    return files[0] if files else None


def gguf_checkpoint(gguf_path: Path, cache_root: Path) -> Path:
    """The HF checkpoint directory converted from ``gguf_path``, converting it on first use (see the module doc)."""
    gguf_path = gguf_path.resolve()
    key = hashlib.sha256(f"{CONVERTER_VERSION}:{content_digest(gguf_path, cache_root)}".encode()).hexdigest()[:16]
    final_dir = cache_root / "models" / f"gguf-{gguf_path.stem}-{key}"

    def write(out_dir: Path) -> None:
        started = time.monotonic()
        from pd.model import gguf_convert

        gguf_convert.convert(gguf_path, out_dir)
        logger.info("converted %s into %s in %.1f s", gguf_path, final_dir, time.monotonic() - started)

    return write_once(final_dir, f"gguf-{key}.lock", write)


def content_digest(path: Path, cache_root: Path) -> str:
    """The SHA-256 of the file's bytes, remembered under its path, size and modification time.

    A conversion is keyed by what the file holds, not where it lies: every venv installs the default
    model's wheel anew (new path, new mtime), and all of them share one conversion. The file is read
    once per path and mtime (about 0.2 s for SmolLM2's 93 MB); later starts read the remembered digest.
    """
    stat = path.stat()
    stamp = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:32]
    remembered = cache_root / "models" / "gguf-digests" / stamp
    if remembered.is_file():
        return remembered.read_text().strip()
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(16 * 1024**2):
            digest.update(chunk)
    value = digest.hexdigest()
    remembered.parent.mkdir(parents=True, exist_ok=True)
    partial = remembered.with_name(f".{stamp}.{os.getpid()}")
    partial.write_text(value + "\n")
    os.replace(partial, remembered)  # whole or absent, for a reader in another process
    return value
