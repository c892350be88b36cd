"""The alerts the hub evaluates: the rules (`rules`, pure), the loop that evaluates and
records them (`loop`), their webhook deliveries (`delivery`), the same rules as a
Prometheus rules file (`prometheus`), and their settings (`settings`)."""
