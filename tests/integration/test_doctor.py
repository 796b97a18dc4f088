"""``oncekit doctor`` against the real services: nothing fails where the kit's services run, and a
missing or unreachable service fails with a fix."""

from __future__ import annotations

import pytest

from oncekit import doctor
from oncekit.reference.config import load
from oncekit.connectors import Services

pytestmark = pytest.mark.services


def test_doctor_passes_against_the_kits_services(services: Services) -> None:
    config = load().with_services(services.kafka.bootstrap_servers, services.postgres.dsn)
    checks = doctor.run(doctor.target_from_config(config))
    text = doctor.table(checks)
    assert [c for c in checks if c.status == doctor.FAIL] == [], text
    names = {c.name for c in checks}
    assert {"kafka transaction.max.timeout.ms", "postgres max_prepared_transactions"} <= names, text
    assert "password" not in text and services.postgres.dsn not in text


def test_doctor_fails_unreachable_and_unconfigured_services_with_a_fix(services: Services,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ONCEKIT_POSTGRES_DSN", raising=False)
    config = load().with_services("127.0.0.1:1", "")
    by_name = {c.name: c for c in doctor.run(doctor.target_from_config(config))}
    assert by_name["kafka"].status == doctor.FAIL and by_name["kafka"].fix
    assert by_name["postgres"].status == doctor.FAIL and by_name["postgres"].detail == "not configured"
