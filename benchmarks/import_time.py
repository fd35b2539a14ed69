"""What ``import torchdi`` costs on top of ``import torch``, in fresh processes.

    .venv/bin/python benchmarks/import_time.py [--rounds 5] [--against /path/to/other/checkout]

Each round starts one process per variant (``import torch``; ``import torchdi`` from this
checkout; with ``--against``, ``import torchdi`` from another checkout), interleaved, with
``OMP_NUM_THREADS=1``; the medians are reported, and the heavy modules each ``import torchdi``
leaves in ``sys.modules`` (dynamo, inductor, sympy, scipy, FSDP2/DTensor load on first use).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HEAVY = (
    "torch._dynamo",
    "torch._inductor",
    "sympy",
    "scipy",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed._functional_collectives",
)
ROOT = Path(__file__).resolve().parent.parent


def _run(code: str, checkout: Path | None) -> tuple[float, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if checkout is not None:
        env["PYTHONPATH"] = str(checkout)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd="/")
    return time.perf_counter() - start, done.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", type=Path, default=None, help="another checkout whose `import torchdi` to time too")
    args = parser.parse_args()
    probe = f"import sys, torchdi; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    variants: dict[str, tuple[str, Path | None]] = {"import torch": ("import torch", None), "import torchdi": (probe, ROOT)}
    if args.against is not None:
        variants[f"import torchdi ({args.against})"] = (probe, args.against.resolve())
    times: dict[str, list[float]] = {name: [] for name in variants}
    loaded: dict[str, str] = {}
    for _ in range(args.rounds):
        for name, (code, checkout) in variants.items():
            seconds, out = _run(code, checkout)
            times[name].append(seconds)
            loaded[name] = out
    base = statistics.median(times["import torch"])
    print(f"| variant | median of {args.rounds} | over import torch | heavy modules loaded |")
    print("|---|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        extra = "" if name == "import torch" else f"{median - base:+.2f} s"
        print(f"| {name} | {median:.2f} s | {extra} | {loaded.get(name) or '-' if name != 'import torch' else ''} |")


if __name__ == "__main__":
    main()
