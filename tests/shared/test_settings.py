"""Settings: flag beats environment beats default, for every field."""

from __future__ import annotations

import argparse
import re

import pytest

from shared import flags, settings


def parse(cls: type[settings.Settings], argv: list[str]) -> object:
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser, cls)
    return settings.from_namespace(cls, parser.parse_args(argv))


def test_defaults_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, *_ in settings.fields(settings.GatewaySettings):
        monkeypatch.delenv(settings.env_name(name), raising=False)
    gateway = parse(settings.GatewaySettings, [])
    assert isinstance(gateway, settings.GatewaySettings)
    assert gateway.http.port == 8000 and gateway.http.host == "127.0.0.1"


def test_environment_overrides_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGATE_PORT", "9001")
    monkeypatch.setenv("LLMGATE_HEARTBEAT_TIMEOUT", "7.5")
    gateway = parse(settings.GatewaySettings, [])
    assert gateway.http.port == 9001 and gateway.link.heartbeat_timeout == 7.5  # type: ignore[attr-defined]


def test_flag_overrides_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGATE_PORT", "9001")
    gateway = parse(settings.GatewaySettings, ["--port", "9002"])
    assert gateway.http.port == 9002  # type: ignore[attr-defined]


def test_bad_environment_value_exits_with_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGATE_PORT", "eighty")
    with pytest.raises(SystemExit, match="LLMGATE_PORT"):
        parse(settings.GatewaySettings, [])


def test_every_setting_has_help_text() -> None:
    for cls in (settings.GatewaySettings, settings.WorkerSettings, settings.ServeSettings):
        for name, _kind, _default, help_text in settings.fields(cls):
            assert help_text, f"{cls.__name__}.{name} has no help text"


def test_every_setting_that_takes_a_store_url_is_a_secret() -> None:
    """A store's URL may carry a password: ``llmgate serve`` hands such settings
    over in the environment, never on a command line (serve.plan)."""
    takes_url = {
        name
        for cls in (settings.GatewaySettings, settings.ServeSettings, settings.WorkerSettings)
        for name, _kind, _default, help_text in settings.fields(cls)
        if re.search(r"\b(rediss?|postgresql)://|\bURL\b", help_text)
    }
    assert takes_url == {"cache", "limits", "state_db"}
    assert takes_url | {"api_keys", "otlp_endpoint"} == settings.SECRET_SETTINGS


@pytest.mark.parametrize(
    "cls", [settings.GatewaySettings, settings.WorkerSettings, settings.ServeSettings]
)
def test_a_settings_name_is_one_flag_whatever_its_group(cls: type[settings.Settings]) -> None:
    """Groups change where a setting sits in the struct, never its flag or variable."""
    names = [name for name, *_ in settings.fields(cls)]
    assert len(names) == len(set(names))
    given = {name: default for name, _kind, default, _help in settings.fields(cls)}
    built = cls.of(**given)
    assert flags.flatten(built) == given
    assert built == cls()


def test_each_gateway_setting_lands_in_its_components_group() -> None:
    gateway = settings.GatewaySettings.of(max_queue=3, policy="prefix", cache="memory", port=1)
    assert gateway.admission.max_queue == 3 and gateway.routing.policy == "prefix"
    assert gateway.caching.cache == "memory" and gateway.http.port == 1
    assert settings.to_environment(gateway)["LLMGATE_MAX_QUEUE"] == "3"
    with pytest.raises(TypeError, match="no setting max_queues"):
        settings.GatewaySettings.of(max_queues=3)


def test_help_lists_each_group_under_its_name() -> None:
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser, settings.GatewaySettings)
    titles = [group.title for group in parser._action_groups]
    assert "GatewaySettings (flags or LLMGATE_* variables): admission" in titles
    admission = next(g for g in parser._action_groups if (g.title or "").endswith(": admission"))
    assert {action.dest for action in admission._group_actions} == {
        name for name, *_ in flags.own_fields(settings.AdmissionSettings)
    }
