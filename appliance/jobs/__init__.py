"""Durable asynchronous jobs (IF-4): the runner, webhook delivery, and the service in front."""
