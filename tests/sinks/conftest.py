"""Every sink's case, for the conformance tests: each module tests/sinks/cases/<name>.py defines a
fixture ``<name>_case`` (see conformance.py); ``sink_case`` is each of them in turn, the tests'
ids naming the sink (test_...[nats]). The other fixtures a case module names ``<name>_...`` (a
server for the whole session, say) are registered here too, for the case and for the sink's own
tests in this folder."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

CASES = Path(__file__).parent / "cases"
CASE_NAMES = sorted(p.stem for p in CASES.glob("*.py") if not p.stem.startswith("_"))

for _name in CASE_NAMES:
    _spec = importlib.util.spec_from_file_location(f"sink_cases_{_name}", CASES / f"{_name}.py")
    assert _spec is not None and _spec.loader is not None
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    assert hasattr(_module, f"{_name}_case"), f"tests/sinks/cases/{_name}.py defines no fixture {_name}_case"
    for _attr in dir(_module):
        if _attr.startswith(f"{_name}_"):
            globals()[_attr] = getattr(_module, _attr)


@pytest.fixture(params=CASE_NAMES)
def sink_case(request: pytest.FixtureRequest) -> Any:
    """The case of one sink (a SinkCase on a server of its own), or a skip saying why it cannot run."""
    return request.getfixturevalue(f"{request.param}_case")
