"""The project's tooling: the `vllm-nvext` command and what it runs.

`cli` (the command), `server` (start and stop real vLLM servers), `tiny_model`, `parity` and
`parity_checks` (the A/B check; `parity_dynamo`: against a Dynamo frontend), `dynamo_conformance`
and `dynamo_differences` (the comparison with Dynamo 1.6.1), `_vllm_cli` (vLLM's own CLI from any
build). The server side (the middleware, the plugin, the connectors) never imports this package.
"""
