"""The command line's shape (issue 34 item 7): --version, one subcommand per savepoint action with
its own flags, conflicting flags refused, help on every flag."""

from __future__ import annotations

import argparse

import pytest

import oncekit
from oncekit import cli


def exit_code(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as ended:
        cli.main(argv)
    out = capsys.readouterr()
    return int(ended.value.code or 0), out.out + out.err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_code(["--version"], capsys) == (0, f"oncekit {oncekit.__version__}\n")


@pytest.mark.parametrize("argv, refused", [
    (["verify", "--lifecycle", "--soak", "30m"], "not allowed with argument --lifecycle"),
    (["verify", "--faults", "3", "--soak", "30m"], "not allowed with argument --faults"),
    (["savepoint", "create", "--checkpoint-root", "cp", "--state-partitions", "4"],
     "unrecognized arguments: --state-partitions"),
    (["savepoint", "create"], "the following arguments are required: --checkpoint-root"),
    (["savepoint", "restore"], "the following arguments are required: name, --into"),
    (["run"], "the following arguments are required: job"),
])
def test_conflicting_or_missing_flags_are_refused(argv: list[str], refused: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, text = exit_code(argv, capsys)
    assert code == 2 and refused in text


def test_doctor_refuses_a_pipeline_config_with_a_jobs_topics(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor", "--config", "pipeline.toml", "--topic", "payments"]) == 1
    assert "doctor: --config takes the topic and checkpoint from the pipeline's config" in capsys.readouterr().err


def test_every_flag_has_help(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    silent: list[str] = []
    original = argparse._ActionsContainer.add_argument

    def add_argument(self: argparse._ActionsContainer, *names: str, **settings: object) -> argparse.Action:
        if any(name.startswith("--") for name in names) and not settings.get("help"):
            silent.append("/".join(names))
        return original(self, *names, **settings)  # type: ignore[arg-type]

    monkeypatch.setattr(argparse._ActionsContainer, "add_argument", add_argument)
    exit_code(["--help"], capsys)
    assert silent == []

