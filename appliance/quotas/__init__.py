"""Rate limits and quotas: token buckets (pure), for the admission control and the fleet's
budget leases."""
