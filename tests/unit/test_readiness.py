"""Which stream subject filters capture something under an allowed subject prefix."""

from __future__ import annotations

import pytest

from outboxpg.relay.nats.readiness import covers_under


@pytest.mark.parametrize(("subject_filter", "prefix", "covers"), [
    ("billing.>", "billing", True),
    ("billing", "billing", True),
    ("billing.invoice.issued", "billing", True),
    ("billing.*", "billing", True),
    (">", "billing", True),
    ("*.>", "billing", True),
    ("*", "billing", True),
    ("billing.>", "billing.eu", True),
    ("billing.*.x", "billing.eu", True),
    ("billing.us.>", "billing.eu", False),
    ("billing", "billing.eu", False),
    ("billings.>", "billing", False),
    ("audit.>", "billing", False),
    ("*", "billing.eu", False),
])
def test_covers_under(subject_filter: str, prefix: str, covers: bool) -> None:
    assert covers_under(subject_filter, prefix) is covers
