"""Regenerate the benchmark tables and plot quoted in README.md, on this machine.

    .venv/bin/python benchmarks/update_readme.py [--full] [--threads N]
    .venv/bin/python benchmarks/update_readme.py --suite compile-overhead [--repeats N]
    .venv/bin/python benchmarks/update_readme.py --suite training [--repeats N]
    .venv/bin/python benchmarks/update_readme.py --suite training-torch29 [--repeats N] [--no-run]

Runs ``python -m torchdi bench --quick --threads 1 --markdown benchmarks/results.md --plot
benchmarks/bench.png`` (without ``--quick`` when ``--full``) and replaces the text between the
``<!-- torchdi-bench:start -->`` and ``<!-- torchdi-bench:end -->`` markers of README.md with
the markdown table. One torch thread by default: on a shared 2-core machine, two threads stall
whenever the other core is busy and the medians swing by 10x; one thread gives stable numbers.
Nothing is written into README.md when a row is incorrect.

With ``--suite compile-overhead`` (or ``training``, ``training-torch29``) it runs the suite's
script from ``SUITES`` (``benchmarks/compile_overhead.py --markdown ...``, ...) instead and
replaces the text between the ``<!-- torchdi-<suite>:start -->`` and ``...:end -->`` markers;
``--no-run`` splices the suite's last results (``benchmarks/results-<suite>.md``) without
running it again.
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
# suite -> (its script in benchmarks/, with a --markdown option; the Python that runs it, relative
# to the checkout, None for this one; extra arguments). Each has README markers.
SUITES: dict[str, tuple[str, str | None, tuple[str, ...]]] = {
    "compile-overhead": ("compile_overhead.py", None, ()),
    "training": ("training.py", None, ()),
    "composition": ("composition.py", None, ()),
    # resnet18 needs torchvision, which loads only next to torch 2.9 (the torch-xla environment).
    "training-torch29": ("training.py", ".venv-xla/bin/python", ("--workloads", "resnet18-32px,cnn-batchnorm")),
}


def splice(readme: str, block: str, start: str = START, end: str = END) -> str:
    """``readme`` with the text between the markers ``start`` and ``end`` replaced by ``block``."""
    if start not in readme or end not in readme:
        raise SystemExit(f"README.md has no {start} ... {end} markers")
    head, rest = readme.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{block.strip()}\n{end}{tail}"


def update_suite(suite: str, repeats: int, run: bool = True) -> int:
    """Run ``suite``'s script (unless ``run`` is false) and splice its markdown table between the
    suite's markers."""
    script, python, extra = SUITES[suite]
    interpreter = sys.executable if python is None else str(ROOT / python)
    markdown = ROOT / "benchmarks" / f"results-{suite}.md"
    command = [interpreter, str(ROOT / "benchmarks" / script), *extra, "--repeats", str(repeats), "--markdown", str(markdown)]
    if run:
        print("running:", " ".join(command), file=sys.stderr)
        done = subprocess.run(command, cwd=ROOT)
        if done.returncode != 0:
            print(f"{script} exited with status {done.returncode}; README.md left unchanged", file=sys.stderr)
            return done.returncode
    body = "\n".join(line for line in markdown.read_text().strip().splitlines() if not line.startswith("### "))
    shown = " ".join([python or "python", f"benchmarks/{script}", *extra, "--repeats", str(repeats)])
    block = f"`{shown}` on this project's development machine:\n\n{body.strip()}"
    start, end = f"<!-- torchdi-{suite}:start -->", f"<!-- torchdi-{suite}:end -->"
    README.write_text(splice(README.read_text(), block, start, end))
    print(f"README.md updated from {markdown.relative_to(ROOT)}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the full bench instead of --quick")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, see above)")
    parser.add_argument("--suite", choices=SUITES, help="regenerate this suite's table instead of the bench's")
    parser.add_argument("--repeats", type=int, default=25, help="interleaved repeats of --suite (default 25)")
    parser.add_argument("--no-run", action="store_true", help="with --suite: splice its last results without running it")
    args = parser.parse_args(argv)
    if args.suite:
        return update_suite(args.suite, args.repeats, run=not args.no_run)
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
