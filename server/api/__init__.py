"""The HTTP API: OpenAI's Images API plus model, shard and health views."""
