"""Ray Serve deployments and the OpenAI-compatible HTTP layer of radixserve."""
