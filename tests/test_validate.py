"""Bad arguments are refused at once, naming the argument, before anything touches the network."""

from __future__ import annotations

import contextlib
import datetime
import io
import math
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arendez import launch, validate

BAD_PORTS = st.one_of(st.integers(max_value=-1), st.integers(min_value=65536))
NOT_NUMBERS = st.text(min_size=1, max_size=8).filter(lambda t: not _parses_as_number(t))


def _parses_as_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@given(BAD_PORTS)
def test_port_out_of_range_is_refused(value: int) -> None:
    with pytest.raises(ValueError, match=rf"port must be in 0-65535, got {value}"):
        validate.port(value)


@given(st.integers(0, 65535))
def test_every_real_port_is_accepted(value: int) -> None:
    assert validate.port(value) == value
    assert validate.port(str(value)) == value


@given(st.integers(min_value=1, max_value=10_000), st.data())
def test_rank_outside_the_world_is_refused(size: int, data: st.DataObject) -> None:
    bad = data.draw(st.one_of(st.integers(min_value=size), st.integers(max_value=-2)))
    with pytest.raises(ValueError, match=r"rank must be"):
        validate.rank(bad, size)
    good = data.draw(st.integers(0, size - 1))
    assert validate.rank(good, size) == good


@pytest.mark.parametrize("value", [0, -2, -100])
def test_world_size_below_one_is_refused(value: int) -> None:
    with pytest.raises(ValueError, match=rf"world_size must be at least 1 .* got {value}"):
        validate.world_size(value)


@pytest.mark.parametrize("value", [True, 1.5, None, [1]])
def test_non_integers_are_a_type_error(value: Any) -> None:
    with pytest.raises(TypeError, match="rank must be an int"):
        validate.rank(value, 4)


@pytest.mark.parametrize("value", [0, -1, math.inf, math.nan, "soon", datetime.timedelta(0)])
def test_timeouts_must_be_finite_and_positive(value: Any) -> None:
    with pytest.raises(ValueError, match="timeout must be"):
        validate.seconds(value)


def test_timeout_accepts_timedelta() -> None:
    assert validate.seconds(datetime.timedelta(milliseconds=1500)) == 1.5


def test_files_must_exist_and_tokens_must_not_be_empty(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--token-file '/nonexistent' does not exist"):
        validate.token_file("/nonexistent")
    empty = tmp_path / "token"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        validate.token_file(str(empty))
    with pytest.raises(ValueError, match="is not a regular file"):
        validate.token_file(str(tmp_path))
    empty.write_text("s3cret\n")
    assert validate.token_file(str(empty)) == "s3cret"


def test_a_certificate_that_does_not_load_is_named(tmp_path: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("not a certificate")
    key.write_text("not a key")
    with pytest.raises(ValueError, match=r"--tls-cert .* does not load"):
        validate.certificate_pair(str(cert), str(key))


# -- arendez-run: usage errors (exit 2) naming the option; the launcher never starts -------------
def _refused(argv: list[str]) -> str:
    """Run ``arendez-run argv`` in-process; it must stop with a usage error before starting."""
    err = io.StringIO()
    with (
        mock.patch.object(launch.asyncio, "run", side_effect=AssertionError("launcher started")) as run,
        contextlib.redirect_stderr(err),
        pytest.raises(SystemExit) as stop,
    ):
        launch.main(argv)
    assert stop.value.code == 2 and not run.called
    assert "Traceback" not in err.getvalue()
    return err.getvalue()


@settings(max_examples=40, deadline=None)
@given(st.one_of(st.integers(max_value=0).map(str), NOT_NUMBERS))
def test_run_refuses_bad_nproc(value: str) -> None:
    assert "argument --nproc" in _refused([f"--nproc={value}", __file__])


@settings(max_examples=40, deadline=None)
@given(st.one_of(st.sampled_from(["-1", "nan", "inf", "-0.5"]), NOT_NUMBERS))
def test_run_refuses_bad_grace(value: str) -> None:
    assert "argument --grace" in _refused([f"--grace={value}", __file__])


def test_run_refuses_a_missing_script() -> None:
    err = _refused(["--nproc", "2", "/nonexistent/train.py"])
    assert "script '/nonexistent/train.py' does not exist" in err
