"""What celery-lease runs in a pool process: one attempt of a leased task."""
