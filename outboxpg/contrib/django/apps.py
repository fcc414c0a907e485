from __future__ import annotations

from django.apps import AppConfig


class OutboxConfig(AppConfig):
    name = "outboxpg.contrib.django"
    label = "outboxpg"
    verbose_name = "outboxpg"
