"""The services behind the LAN API, which the job runner and the package generator call too:
completions (the one drive of a completion, from prepare to its usage record), embeddings,
the admission control at the door, and the request schemas they take. No aiohttp here."""
