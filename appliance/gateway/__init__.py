"""The LAN API: aiohttp routes, middleware, OpenAI-compatible handlers, SSE streaming."""
