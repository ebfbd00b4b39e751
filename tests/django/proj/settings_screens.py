"""The test project as served for the docs' screenshots (``tests/django/screenshots.py``):
adds a URL that logs the screenshot user in, which no real settings must have."""

from .settings import *  # noqa: F403

ROOT_URLCONF = "tests.django.proj.urls_screens"
