"""One step of many requests: each request's state, the calls a step makes, its scheduler, and the
features its rows keep between steps (step caching)."""
