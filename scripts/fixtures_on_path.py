"""Puts Tests/integration on sys.path, so that the scripts (demo.py, benchlib) can import the test fixtures
(`fixtures.*`, `idp_glewlwyd`) instead of copies of them. Import it before those modules."""

import sys
from pathlib import Path

INTEGRATION = Path(__file__).resolve().parents[1] / "Tests" / "integration"
if str(INTEGRATION) not in sys.path:
    sys.path.insert(0, str(INTEGRATION))
