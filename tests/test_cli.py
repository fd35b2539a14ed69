"""The command line: ``python -m torchdi bench`` and ``python -m torchdi check``.

Runs ``main()`` in-process on small selections (eager backends, one scenario, few rounds);
one subprocess checks that ``python -m torchdi`` itself starts.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from torchdi.__main__ import BACKENDS, format_matrix, main, select_backends
from torchdi.testing import OPERATORS


def test_python_dash_m_torchdi_help() -> None:
    done = subprocess.run([sys.executable, "-m", "torchdi", "bench", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert "--quick" in done.stdout and "--backends" in done.stdout and "--plot" in done.stdout


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["bench", "--backends", "autograd,jaxx"], "unknown backend 'jaxx'; valid backends: autograd, func, compile, compile-aot, finitediff, xla"),
        (["check", "--backends", "nope"], "valid backends: autograd, func"),
        (["bench", "--operators", "grad"], "unknown operator 'grad'; valid operators: pushforward"),
        (["check", "--operators", "gradient,hesian"], "valid operators: " + ", ".join(OPERATORS)),
    ],
)
def test_unknown_names_exit_2_with_the_valid_ones(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_argparse_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "--no-such-flag"])
    assert info.value.code == 2


def test_plot_without_matplotlib_is_a_clear_usage_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert main(["bench", "--backends", "autograd", "--plot", "x.png"]) == 2
    assert "pip install 'torchdi[bench]'" in capsys.readouterr().err


def test_bench_prints_the_table_on_stdout_and_progress_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    markdown = tmp_path / "bench.md"
    argv = ["bench", "--quick", "--backends", "autograd,func", "--scenarios", "mlp-small,hvp-1000", "--rounds", "2", "--markdown", str(markdown)]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    header = out.splitlines()[0].split()
    assert header[:5] == ["backend", "scenario", "operator", "prep", "call"]
    rows = [line for line in out.splitlines() if line.startswith(("autograd ", "func "))]
    assert len(rows) == 4 and all(line.rstrip().endswith(" ok") for line in rows)
    assert "[1/2] mlp-small value_and_gradient" in err and "per call" in err
    text = markdown.read_text()
    assert "| autograd | mlp-small | value_and_gradient |" in text and "Measured with torch" in text


def test_bench_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    assert main(["bench", "--backends", "func", "--scenarios", "mlp-small", "--rounds", "1", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_check_prints_the_support_matrix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--backends", "autograd,func,finitediff", "--operators", "gradient,hvp,derivative"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["operator", "autograd", "func", "finitediff"]
    for op in ("gradient", "hvp", "derivative"):
        assert any(line.split() == [op, "ok", "ok", "ok"] for line in lines)


def test_support_matrix_cells() -> None:
    cells = {("hvp", "a"): {"ok"}, ("hvp", "b"): {"unsupported"}, ("hvp", "c"): {"ok", "fail"}}
    text = format_matrix(["hvp", "jacobian"], ["a", "b", "c"], cells)
    assert text.splitlines()[2].split() == ["hvp", "ok", "unsupported", "FAIL"]
    assert text.splitlines()[3].split() == ["jacobian", "-", "-", "-"]


def test_default_backends_are_the_available_ones() -> None:
    selected, notes = select_backends(None)
    assert {"autograd", "func", "finitediff"} <= set(selected)
    assert set(selected) | {n.split()[1] for n in notes} == set(BACKENDS)
    assert all("unavailable here" in n for n in notes)


def test_missing_compile_overhead_suite(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import torchdi.__main__ as cli

    monkeypatch.setattr(cli, "_benchmark_main", lambda name: None)
    assert main(["bench", "--suite", "compile-overhead"]) == 2
    assert "compile_overhead.py" in capsys.readouterr().err


def test_benchmark_scripts_load_as_suites() -> None:
    import torchdi.__main__ as cli

    assert callable(cli._benchmark_main("raw_overhead"))
    if (Path(cli.__file__).resolve().parent.parent / "benchmarks" / "compile_overhead.py").is_file():
        assert callable(cli._benchmark_main("compile_overhead"))
    assert callable(cli._benchmark_main("xla_overhead"))  # imports torch_xla only when run
    assert cli._benchmark_main("no_such_benchmark") is None


def test_suite_gets_the_markdown_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench --suite S --markdown FILE`` hands FILE to the suite's script (the docs include it)."""
    import torchdi.__main__ as cli

    calls: list[list[str]] = []
    monkeypatch.setattr(cli, "_benchmark_main", lambda name: lambda argv: calls.append(argv) or 0)
    assert main(["bench", "--suite", "raw-overhead", "--markdown", "out.md"]) == 0
    assert main(["bench", "--suite", "raw-overhead"]) == 0
    assert calls == [["--markdown", "out.md"], []]
