"""Names the demo's runner and its project share (importing them creates no app)."""

#: Environment variables the demo sets for itself and its workers.
DATA_ENV = "CELERY_LEASE_DEMO_DATA"
STEP_SECONDS_ENV = "CELERY_LEASE_DEMO_STEP_SECONDS"

#: The steps of every order.
STEPS = ("reserve", "charge", "ship")
