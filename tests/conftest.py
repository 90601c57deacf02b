"""Suite-wide fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _private_state_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test (and every daemon it starts) gets its own state directory: nothing the suite runs
    may read or write the machine's real /var/lib/nvmeof or ~/.local/share/nvmeof (tokens, files)."""
    monkeypatch.setenv("NVMEOF_STATE_DIR", str(tmp_path_factory.mktemp("state")))
