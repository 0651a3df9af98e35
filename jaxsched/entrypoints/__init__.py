"""Network front ends over the engine: `jaxsched serve`, an OpenAI-compatible HTTP server."""
