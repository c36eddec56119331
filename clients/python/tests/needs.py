"""Optional test dependencies. Without torch or transformers the tests that
need them skip, naming what is missing; EXPERTD_REQUIRE_TORCH=1 (set by
e2e/python_test.go when EXPERTD_E2E_REQUIRE=1, as in CI, and by
scripts/device-python.sh) turns the skip into a failure, so a run that
was meant to compare against transformers cannot pass by skipping."""

import importlib
import os

import pytest


def module(name: str):
    if os.environ.get("EXPERTD_REQUIRE_TORCH") == "1":
        try:
            return importlib.import_module(name)
        except ImportError as e:
            pytest.fail(f"EXPERTD_REQUIRE_TORCH=1 but {name} does not import: {e}", pytrace=False)
    return pytest.importorskip(name, reason=f"{name} is not installed (scripts/e2e-setup.sh installs torch and "
                                            f"transformers unless EXPERTD_E2E_TORCH=0)")
