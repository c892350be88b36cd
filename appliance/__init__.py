"""The Kovenlab Edge appliance: a self-contained OpenAI-compatible inference service for a LAN."""
