"""What celery-lease runs in a worker's main process: the bootstep and its threads."""
