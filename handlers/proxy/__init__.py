"""The proxy daemon: the harness's model endpoint with token-in/token-out capture.
`handlers.proxy.daemon` holds its config and wiring; one module per API (`openai`,
`anthropic`) around the shared parts (`api`, `body`, `http`, `routing`)."""
