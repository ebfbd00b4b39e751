"""Settings of the test project: PostgreSQL, django-celery-results, the lease admin.

The database server comes from ``CELERY_LEASE_TEST_PG_ADMIN_URL`` (default: the local
server as user postgres). The test runner creates and drops ``test_celery_lease_django``;
``CELERY_LEASE_DJANGO_DB`` names the database ``manage.py`` uses (screenshots).
"""

import os

from sqlalchemy.engine import make_url

_PG = make_url(
    os.environ.get("CELERY_LEASE_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/test")
)

SECRET_KEY = "celery-lease-tests-only-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_celery_results",
    "django_celery_beat",
    "celery_lease.contrib.django",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "tests.django.proj.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("CELERY_LEASE_DJANGO_DB", "celery_lease_django"),
        "USER": _PG.username or "",
        "PASSWORD": _PG.password or "",
        "HOST": _PG.host or "",
        "PORT": str(_PG.port or ""),
        "TEST": {"NAME": os.environ.get("CELERY_LEASE_DJANGO_TEST_DB", "test_celery_lease_django")},
    }
}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "/static/"

# -- Celery (read by proj/celery.py with namespace="CELERY") ------------------------------

CELERY_BROKER_URL = os.environ.get(
    "CELERY_LEASE_TEST_DJANGO_BROKER_URL", "redis://127.0.0.1:6379/14"
)
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("CELERY_LEASE_TEST_DJANGO_QUEUE", "lease-django-tests")
CELERY_RESULT_BACKEND = "django-db"
CELERY_IMPORTS = ["tests.django.proj.tasks"]

# -- celery-lease: no CELERY_LEASE_DATABASE_URL, so the store uses DATABASES["default"] -----

CELERY_LEASE_APP = "tests.django.proj.celery:app"
CELERY_LEASE_TABLE_PREFIX = "lease_"
