"""Engine-side KV connectors: loaded by vLLM's engine process (they import vLLM and torch), never by the server."""
