"""The README documents every setting, with its environment variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared import settings

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


@pytest.mark.parametrize(
    "cls", [settings.ServeSettings, settings.GatewaySettings, settings.WorkerSettings]
)
def test_every_setting_is_in_the_readme(cls: type) -> None:
    for name, _kind, default, _help in settings.fields(cls):
        flag = "--" + name.replace("_", "-")
        env = settings.env_name(name)
        row = next(
            (line for line in README.splitlines() if line.startswith(f"| `{flag}` | `{env}` |")),
            None,
        )
        assert row is not None, f"{cls.__name__}.{name} is not in the README's settings table"
        if default != "":
            assert f"`{default}`" in row, f"{flag}: README does not give the default {default!r}"
