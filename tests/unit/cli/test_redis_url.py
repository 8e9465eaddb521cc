"""Where a process finds the run's Redis URL, in order: --redis, --redis-url-file, $ASYNCRL_REDIS_URL,
$ASYNCRL_REDIS_URL_FILE, the run's embedded Redis; a password never has to pass through argv or the config."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.cli.util import REDIS_URL_ENV, REDIS_URL_FILE_ENV, given_redis_url, redis_url
from asyncrl.common.config import ConfigError, load_config

URL = "redis://:s3cret-pass@10.0.0.5:6379/0"


@pytest.fixture
def url_file(tmp_path: Path) -> Path:
    path = tmp_path / "url"
    path.write_text(URL + "\n")
    return path


def test_the_first_given_source_wins(monkeypatch, url_file: Path, capsys) -> None:
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    monkeypatch.delenv(REDIS_URL_FILE_ENV, raising=False)
    assert given_redis_url(None, None) is None
    monkeypatch.setenv(REDIS_URL_FILE_ENV, str(url_file))
    assert given_redis_url(None, None) == URL
    monkeypatch.setenv(REDIS_URL_ENV, "redis://:from-env@h:1/0")
    assert given_redis_url(None, None) == "redis://:from-env@h:1/0"
    assert given_redis_url(None, url_file) == URL
    assert capsys.readouterr().err == ""
    assert given_redis_url("redis://:on-argv@h:2/0", url_file) == "redis://:on-argv@h:2/0"
    assert "puts the Redis password in this process's command line" in capsys.readouterr().err
    given_redis_url("redis://h:2/0", None)  # no password: nothing to warn about
    assert capsys.readouterr().err == ""


def test_the_embedded_redis_file_is_the_last_resort(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    monkeypatch.delenv(REDIS_URL_FILE_ENV, raising=False)
    (tmp_path / "demo" / "redis").mkdir(parents=True)
    (tmp_path / "demo" / "redis" / "url").write_text(URL)
    assert redis_url(None, "demo", str(tmp_path)) == URL
    with pytest.raises(SystemExit) as exit_:
        redis_url(None, "other", str(tmp_path))
    assert exit_.value.code == 2


def test_an_unreadable_or_empty_url_file_exits_2_naming_it(tmp_path: Path, capsys) -> None:
    for path in (tmp_path / "missing", tmp_path / "empty"):
        if path.name == "empty":
            path.write_text("\n")
        with pytest.raises(SystemExit) as exit_:
            given_redis_url(None, path)
        assert exit_.value.code == 2 and str(path) in capsys.readouterr().err


def test_a_config_refuses_a_redis_url_with_a_password_without_echoing_it() -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(None, [f"transport.redis_url={URL}"])
    assert "transport.redis_url" in str(refused.value) and "--redis-url-file" in str(refused.value)
    assert "s3cret-pass" not in str(refused.value)
    assert load_config(None, ["transport.redis_url=redis://10.0.0.5:6379/0"]).transport.redis_url
