"""The appliance's link to its hub: enrollment, identity, heartbeats and outbox sync."""
