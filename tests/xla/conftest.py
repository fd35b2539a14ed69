"""tests/xla runs in .venv-xla (torch-xla's pinned torch) on torch-xla's real PJRT CPU client."""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

try:
    import torchdi

    # The XLA device must exist before the process's first backward pass (PyTorch's autograd
    # engine sizes its device queues then): probe it before any test differentiates anything.
    torchdi.check_available(torchdi.AutoXLA())
except ImportError:  # torch-xla missing: the test modules skip themselves
    pass
