"""Kernel tests run the Triton kernels on CPU in the Triton interpreter.

TRITON_INTERPRET is read when ``@triton.jit`` decorates a function, so it must
be set before anything imports triton or ``kernels.triton``: here, first.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
