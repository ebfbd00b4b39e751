"""Integrations with frameworks and tools around Celery."""
