"""The LAN API over HTTP: aiohttp routes, middleware, the OpenAI-compatible handlers, SSE and
WebSocket streaming, the OpenAPI document. HTTP only: the services the handlers call are
`appliance.inference`."""
