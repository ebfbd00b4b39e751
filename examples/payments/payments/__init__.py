"""A payment-style Celery project, and the tests that crash it (see docs/testing.md)."""
