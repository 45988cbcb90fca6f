"""The proxy daemon: the harness's model endpoint with token-in/token-out capture.
`handlers.proxy.daemon` holds its config and wiring; `app` its routes, `call` the per-call
path, `state` what the handlers share (executions, admission, replayed state), `outbox`
the `call.completed` publishes and spills, `restart` what a (re)starting proxy does; one
module per API (`openai`, `anthropic`) around the shared parts (`api`, `body`, `http`,
`routing`)."""
