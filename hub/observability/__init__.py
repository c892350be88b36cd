"""The hub's own observability: its Prometheus metrics (`metrics`), and the fleet's gauges
read from the store at each scrape (`fleet`)."""
