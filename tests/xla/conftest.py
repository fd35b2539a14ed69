"""tests/xla runs in .venv-xla (torch-xla's pinned torch) on torch-xla's real PJRT CPU client."""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
