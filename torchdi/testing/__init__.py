"""Testing and benchmarking backends: the equivalent of DifferentiationInterfaceTest.

- ``Scenario``: an operator, a function, a point, contexts, tangents and the expected result
  (computed by the reference backend ``AutoAutograd`` when not given).
- ``default_scenarios()``: every operator on scalar, vector, matrix and pytree inputs, with and
  without ``Constant`` and ``Cache`` contexts, in float32 and float64.
- ``test_differentiation(backends, scenarios)``: raises one ``AssertionError`` listing every
  failing (backend, scenario, operator).
- ``benchmark_scenarios()`` and ``benchmark_differentiation(backends, scenarios)``: timing rows
  with the ratio to ``AutoAutograd`` measured in the same run.
"""

from torchdi.testing.benchmark import BenchmarkRow, benchmark_differentiation, format_table
from torchdi.testing.compare import (
    TestRecord,
    compare_results,
    run_differentiation_tests,
    test_differentiation,
)
from torchdi.testing.scenarios import OPERATORS, Scenario, benchmark_scenarios, default_scenarios

__all__ = [
    "OPERATORS",
    "BenchmarkRow",
    "Scenario",
    "TestRecord",
    "benchmark_differentiation",
    "benchmark_scenarios",
    "compare_results",
    "default_scenarios",
    "format_table",
    "run_differentiation_tests",
    "test_differentiation",
]
