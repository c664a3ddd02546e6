"""The agent routes: /v1/responses (both mounts) and /v1/messages (the endpoint plugin), with token ids."""
