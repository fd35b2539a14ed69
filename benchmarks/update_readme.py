"""Regenerate the benchmark table and plot quoted in README.md, on this machine.

    .venv/bin/python benchmarks/update_readme.py [--full] [--threads N]

Runs ``python -m torchdi bench --quick --threads 1 --markdown benchmarks/results.md --plot
benchmarks/bench.png`` (without ``--quick`` when ``--full``) and replaces the text between the
``<!-- torchdi-bench:start -->`` and ``<!-- torchdi-bench:end -->`` markers of README.md with
the markdown table. One torch thread by default: on a shared 2-core machine, two threads stall
whenever the other core is busy and the medians swing by 10x; one thread gives stable numbers.
Nothing is written into README.md when a row is incorrect.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results.md"
PLOT = ROOT / "benchmarks" / "bench.png"
START, END = "<!-- torchdi-bench:start -->", "<!-- torchdi-bench:end -->"


def splice(readme: str, block: str) -> str:
    """``readme`` with the text between the markers replaced by ``block``."""
    if START not in readme or END not in readme:
        raise SystemExit(f"README.md has no {START} ... {END} markers")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{block.strip()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the full bench instead of --quick")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, see above)")
    args = parser.parse_args(argv)
    command = [sys.executable, "-m", "torchdi", "bench", "--threads", str(args.threads),
               "--markdown", str(RESULTS), "--plot", str(PLOT)]
    if not args.full:
        command.insert(4, "--quick")
    print("running:", " ".join(command[1:]), file=sys.stderr)
    done = subprocess.run(command, cwd=ROOT)
    if done.returncode != 0:
        print(f"the bench exited with status {done.returncode}; README.md left unchanged", file=sys.stderr)
        return done.returncode
    shown = "python -m torchdi bench" + ("" if args.full else " --quick") + f" --threads {args.threads}"
    block = "\n".join([
        f"`{shown}` on this project's development machine:",
        "",
        "\n".join(line for line in RESULTS.read_text().strip().splitlines() if not line.startswith("### ")).strip(),
        "",
        f"![call time per backend]({PLOT.relative_to(ROOT).as_posix()})",
    ])
    README.write_text(splice(README.read_text(), block))
    print(f"README.md updated from {RESULTS.relative_to(ROOT)} and {PLOT.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
