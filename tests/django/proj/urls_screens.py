"""URLs for the screenshots only: ``/screenshot-login/?next=...`` logs in user "maria"."""

from django.contrib import admin
from django.contrib.auth import login
from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponseRedirect
from django.urls import path
from django.utils.http import url_has_allowed_host_and_scheme

from .urls import urlpatterns as base


def screenshot_login(request: HttpRequest) -> HttpResponseRedirect:
    login(request, User.objects.get(username="maria"))
    target = request.GET.get("next", "/admin/")
    if not url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()}):
        target = "/admin/"
    return HttpResponseRedirect(target)


# the narrow screenshot window has no room for the navigation sidebar
admin.site.enable_nav_sidebar = False

urlpatterns = [path("screenshot-login/", screenshot_login), *base]
