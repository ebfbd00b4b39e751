"""Run by ``manage.py test`` in a subprocess (test_runner.py): a Django test case that
uses the lease store, so the test database has lease connections open at teardown."""

from django.test import TestCase

from celery_lease import admin
from tests.django.proj.celery import app


class LeaseStoreTest(TestCase):
    def test_store_is_on_the_test_database(self) -> None:
        from django.db import connection

        # the project's own app, as its code uses it: the store followed the test database
        api = admin(app)
        self.assertEqual(api.store.engine.url.database, connection.settings_dict["NAME"])
        self.assertEqual(api.tasks(), [])
