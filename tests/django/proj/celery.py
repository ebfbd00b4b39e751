"""The project's Celery app, configured from the Django settings (namespace "CELERY")."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django.proj.settings")

# not the process's current app: the tests share their process with other suites' apps
app = Celery("proj", set_as_current=False)
app.config_from_object("django.conf:settings", namespace="CELERY")
