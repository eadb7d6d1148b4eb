"""Kernel tests run the Triton kernels on CPU in the Triton interpreter.

TRITON_INTERPRET is read when ``@triton.jit`` decorates a function, so it must
be set before anything imports triton or ``pd_kernels.triton``: the root
``tests/conftest.py`` sets it before collection imports any test module (the
packages under ``tests/`` are collected in name order, ``pd`` before
``pd_kernels``); this one repeats it for the device choice below.

With ``PD_TEST_DEVICE=cuda`` (``make gpu-check``) the same tests run compiled
on the GPU instead: tensors are made on that device by default.
"""

import os

DEVICE = os.environ.get("PD_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    import torch

    torch.set_default_device(DEVICE)
