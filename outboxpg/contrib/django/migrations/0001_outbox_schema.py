"""The outbox schema through 0017_schema_3 (schema-2 and the step after it)."""

from django.db import migrations

from outboxpg.contrib.django.operations import OutboxSteps


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [OutboxSteps(through="0017_schema_3", back_to=None)]
