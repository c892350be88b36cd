"""What the appliance tells its operators: OpenMetrics, and OpenTelemetry spans."""
