"""A Django app whose migrations install and upgrade the outbox schema (docs/how-to/django.md):
add ``"outboxpg.contrib.django"`` to INSTALLED_APPS and run ``manage.py migrate``."""
