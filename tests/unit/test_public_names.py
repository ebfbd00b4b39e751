"""Public names that moved keep importing, and mean what they meant."""

from __future__ import annotations

import importlib
import inspect

import pytest

from celery_lease import CeleryLeaseDeprecationWarning


def test_celery_lease_admin_stays_the_function_after_its_module_is_imported():
    import celery_lease

    importlib.import_module("celery_lease.admin")
    importlib.import_module("celery_lease.operations")
    assert inspect.isfunction(celery_lease.admin)
    assert celery_lease.admin.__name__ == "admin"


def test_the_operator_api_module_keeps_its_first_name():
    from celery_lease import Admin, admin
    from celery_lease.operations import Admin as OperationsAdmin

    with pytest.warns(CeleryLeaseDeprecationWarning, match="celery_lease.operations"):
        from celery_lease.admin import PURGEABLE, percentile
        from celery_lease.admin import Admin as FirstAdmin
        from celery_lease.admin import admin as first_admin

    assert Admin is FirstAdmin is OperationsAdmin and admin is first_admin
    assert percentile([1.0, 3.0], 0.5) == 2.0 and PURGEABLE


def test_admin_list_is_tasks():
    from celery_lease import Admin

    assert Admin.list is Admin.tasks


def test_admin_list_called_warns_and_names_tasks():
    from celery import Celery

    from celery_lease import Admin

    api = Admin(Celery(set_as_current=False))
    with pytest.warns(CeleryLeaseDeprecationWarning, match=r"Admin\.tasks"):
        method = api.list
    assert method == api.tasks


def test_moved_names_still_import_from_their_first_modules():
    from celery_lease import DuplicateStep, install
    from celery_lease._incarnation import Incarnation
    from celery_lease._runtime import Incarnation as RuntimeIncarnation
    from celery_lease.exceptions import CeleryLeaseError
    from celery_lease.exceptions import DuplicateStep as Moved
    from celery_lease.worker import install as worker_install

    assert DuplicateStep is Moved and issubclass(DuplicateStep, (CeleryLeaseError, ValueError))
    assert install is worker_install
    assert RuntimeIncarnation is Incarnation
